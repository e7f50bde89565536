"""Two-process pipeline checks (one spawned group): eval_batch against the plain forward,
user-written schedules, partition methods on a real module, tuple / integer / no-grad
activations, activation checkpointing, fp16 overflow agreed across stages, and the
disabled facade calls."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from deepspeed.runtime.pipe import schedule as S
from tests.helpers.dist import run_distributed
from tests.runtime.pipe import models as M
from tests.runtime.pipe.test_pipe_train import LR, CLIP, STEPS, _check, _config, _train


class GPipeSchedule(S.PipeSchedule):
    """All forwards, then all backwards (a user-written schedule)."""

    def steps(self):
        first, last = self.is_first_stage, self.is_last_stage
        for i in range(self.micro_batches):
            yield ([] if first else [S.RecvActivation(i)]) + ([S.LoadMicroBatch(i)] if first or last else []) + \
                [S.ForwardPass(i)] + ([] if last else [S.SendActivation(i)])
        for i in range(self.micro_batches):
            yield ([] if last else [S.RecvGrad(i)]) + [S.BackwardPass(i)] + ([] if first else [S.SendGrad(i)])
        yield [S.ReduceTiedGrads(), S.ReduceGrads(), S.OptimizerStep()]

    def num_pipe_buffers(self):
        return self.micro_batches


def _gpt_engine(pp, dp, gas=4, micro=2, zero=0, extra=None, **module_kw):
    import deepspeed
    from deepspeed.pipe import PipelineModule
    module = PipelineModule(M.gpt_specs(4), num_stages=pp, loss_fn=M.lm_loss, seed_layers=True,
                            base_seed=M.BASE_SEED, **module_kw)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                           config=_config(micro, gas, dp, zero, extra=extra))
    return engine


def _train_params(engine, micro=2, gas=4, dp=1):
    data = M.batches(STEPS, micro * gas * dp)
    it = M.micro_iter(data, micro, gas, dp, engine.grid.get_data_parallel_rank())
    losses = [engine.train_batch(it).item() for _ in range(STEPS)]
    return {M.ref_name(n): (p.detach().float().clone(), 0, 1) for n, p in engine.module.named_parameters()}, losses


# ---- tuple activations: (float hidden, int64 token ids, a float tensor without grad) -----------
class TupleEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(M.V, M.D)

    def forward(self, tokens):
        return self.emb(tokens), tokens, torch.full(tokens.shape, 0.5)


class TupleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = M.Block(M.D)
        self.pos = nn.Embedding(M.V, M.D)

    def forward(self, inputs):
        x, ids, scale = inputs
        assert ids.dtype == torch.int64 and not scale.requires_grad
        return self.block(x) + self.pos(ids) * scale.unsqueeze(-1), ids, scale


class TupleHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(M.D, M.V)

    def forward(self, inputs):
        return self.out(inputs[0])


def _tuple_specs():
    from deepspeed.pipe import LayerSpec
    return [LayerSpec(TupleEmbed), LayerSpec(TupleBlock), LayerSpec(TupleBlock), LayerSpec(TupleHead)]


def _tuple_reference(data):
    layers = []
    for i, spec in enumerate(_tuple_specs()):
        torch.manual_seed(M.BASE_SEED + i)
        layers.append(spec.build())
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for x, y in data:
        opt.zero_grad()
        M.lm_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return dict(model.named_parameters())


# ---- fp16: a layer whose own gradient is inf on the last stage only ---------------------------
class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        return x + 0 * w.sum()

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((4,), float("inf"), dtype=g.dtype)


class InfGradLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return _InfGrad.apply(x, self.w)


def _body(rank, world, tmp):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.p2p import PipelineError
    out = {"pp2": _train(pp=2, dp=1)}

    # eval_batch before training equals the plain forward
    eng = _gpt_engine(pp=2, dp=1)
    data = M.batches(1, 8, seed=5)
    loss, logits = eng.eval_batch(M.micro_iter(data, 2, 4, 1, 0), return_logits=True)
    out["eval"] = (loss.item(), [t.clone() for t in logits] if logits is not None else None)
    out["eval_none"] = eng.eval_batch(M.micro_iter(data, 2, 4, 1, 0), reduce_output=None)
    described_once = eng.p2p.descriptions_sent
    # a shorter sequence: the activation description is sent again, once
    short = [(x[:, :4], y[:, :4]) for x, y in data]
    out["eval_short"] = eng.eval_batch(M.micro_iter(short, 2, 4, 1, 0)).item()
    after_change = eng.p2p.descriptions_sent
    eng.reset_activation_shape()
    eng.eval_batch(M.micro_iter(short, 2, 4, 1, 0))
    out["descriptions"] = (described_once, after_change, eng.p2p.descriptions_sent)
    for call in (lambda: eng.forward(None), lambda: eng.backward(None), lambda: eng.step()):
        with pytest.raises(PipelineError, match="train_batch"):
            call()
    with pytest.raises(ValueError, match="mpu"):
        deepspeed.initialize(model=eng.module, config=_config(2, 4, 1), mpu=eng.grid)

    # clear errors for bad input
    errors = {}
    for name, call in {
        "stages": lambda: PipelineModule(M.gpt_specs(2), num_stages=3),
        "zero3": lambda: _gpt_engine(pp=2, dp=1, zero=3),
        "no_data": lambda: _gpt_engine(pp=2, dp=1).train_batch(),
        "interleave_m": lambda: _gpt_engine(pp=2, dp=1, gas=3, chunks_per_stage=2).train_batch(
            M.micro_iter(M.batches(1, 6), 2, 3, 1, 0)),
        "not_pair": lambda: _gpt_engine(pp=2, dp=1).train_batch(iter([torch.zeros(2, 6, dtype=torch.long)] * 4)),
    }.items():
        try:
            call()
            errors[name] = None
        except Exception as err:  # noqa: BLE001 - the test reads the message
            errors[name] = f"{type(err).__name__}: {err}"
    out["errors"] = errors

    # a user-written schedule drives the engine (GPipe order) and trains the same model; the
    # CSV monitor and the wall-clock breakdown log work on the way
    eng = _gpt_engine(pp=2, dp=1, extra={"csv_monitor": {"enabled": True, "output_path": tmp, "job_name": "pipe"},
                                         "wall_clock_breakdown": True, "steps_per_print": 1})
    eng.train_schedule_cls = GPipeSchedule
    out["gpipe"] = _train_params(eng)
    out["gpipe_buffers"] = len(eng.pipe_buffers["inputs"])

    # the documented DataParallelSchedule at pp=1 x dp=2
    eng = _gpt_engine(pp=1, dp=2)
    eng.train_schedule_cls = S.DataParallelSchedule
    out["dp_schedule"] = _train_params(eng, dp=2)

    # interleaved 1F1B: 2 chunks per stage (4 virtual stages over 2 processes)
    eng = _gpt_engine(pp=2, dp=1, chunks_per_stage=2)
    assert isinstance(eng.train_schedule_cls(4, 2, 0, chunks=2), S.InterleavedTrainSchedule)
    out["interleaved_eval"] = eng.eval_batch(M.micro_iter(M.batches(1, 8, seed=5), 2, 4, 1, 0)).item()
    out["interleaved"] = _train_params(eng)
    out["interleaved_layers"] = eng.module._local_layer_ids

    # activation checkpointing every 2 layers
    out["ckpt_interval"] = _train_params(_gpt_engine(pp=2, dp=1, activation_checkpoint_interval=2))

    # pipeline.activation_checkpoint_interval / use_reentrant from the config (DeepSpeed 0.19): the
    # config's interval overrides the module's 0 and use_reentrant=False swaps in the non-reentrant
    # function, which needs no inputs requiring grad; the model still trains as the reference
    from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
    eng = _gpt_engine(pp=2, dp=1, extra={"pipeline": {"activation_checkpoint_interval": 2, "use_reentrant": False}})
    ck = {"interval": eng.module.activation_checkpoint_interval,
          "non_reentrant": eng.module.activation_checkpoint_func is non_reentrant_checkpoint,
          "needs_input_grads": eng._reentrant_activation_checkpointing()}
    out["ckpt_config"] = _train_params(eng)
    # the setter after initialize: the cached blocks follow the interval, and the engine's
    # reentrant decision reads the module (ReLU holds no parameters, Linear does)
    mixed = [nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.ReLU(), nn.ReLU()]
    module = PipelineModule(mixed, num_stages=2, partition_method=[0, 4, 8], loss_fn=M.lm_loss,
                            activation_checkpoint_interval=2)
    module._precompute_checkpointable_values()
    ck["blocks_2"] = list(module.is_checkpointable_results)
    eng, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=_config(2, 4, 1))
    ck["reentrant_2"] = eng._reentrant_activation_checkpointing()
    module.set_checkpoint_interval(1)
    ck["blocks_1"] = (module.activation_checkpoint_interval, list(module.is_checkpointable_results))
    module.set_checkpoint_interval(0)
    ck["reentrant_0"] = eng._reentrant_activation_checkpointing()
    for bad in (-1, 1.5, True):
        try:
            module.set_checkpoint_interval(bad)
        except ValueError as err:
            ck[f"bad_{bad}"] = str(err)
    out["ckpt_checks"] = ck

    # partition methods on a real module
    specs = [LayerSpec(nn.Linear, 4, 64), LayerSpec(nn.Linear, 64, 64), (lambda x: x * 1.0),
             LayerSpec(nn.Linear, 64, 4), LayerSpec(nn.ReLU)]
    parts = {}
    for method in ("parameters", "uniform", "type:relu", [0, 2, 5]):
        mod = PipelineModule(specs, num_stages=2, partition_method=method)
        parts[str(method)] = (mod.parts, [n for n, _ in mod.named_parameters()], mod.partition_log)
    out["parts"] = parts

    # tuple / int / no-grad activations between stages
    module = PipelineModule(_tuple_specs(), num_stages=2, loss_fn=M.lm_loss, seed_layers=True,
                            base_seed=M.BASE_SEED, partition_method="uniform")
    eng, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                        config=_config(2, 4, 1))
    tdata = M.batches(STEPS, 8)
    it = M.micro_iter(tdata, 2, 4, 1, 0)
    for _ in range(STEPS):
        eng.train_batch(it)
    out["tuple"] = {n: p.detach().clone() for n, p in module.named_parameters()}

    # fp16: only the last stage sees an inf gradient; every stage must skip the step
    specs = M.gpt_specs(2) + [LayerSpec(InfGradLayer)]
    specs = specs[:-2] + [specs[-1], specs[-2]]   # InfGradLayer before the LM head, on the last stage
    module = PipelineModule(specs, num_stages=2, loss_fn=M.lm_loss, partition_method=[0, 2, 5])
    cfg = _config(2, 4, 1, extra={"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}})
    eng, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    eng.train_batch(M.micro_iter(M.batches(1, 8), 2, 4, 1, 0))
    after = {n: p.detach().clone() for n, p in module.named_parameters()}
    out["fp16"] = (eng.skipped_steps, eng.loss_scale, all(torch.equal(before[n], after[n]) for n in before),
                   eng.is_last_stage())
    return out


@pytest.fixture(scope="module")
def monitor_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pipe_monitor"))


@pytest.fixture(scope="module")
def two(monitor_dir):
    return run_distributed(_body, world_size=2, timeout=240, args=(monitor_dir,))


def test_pp2_matches_plain_pytorch(two):
    _check([r["pp2"] for r in two], micro=2, gas=4, dp=1)


def test_eval_batch_equals_plain_forward(two):
    ref = M.RefGPT(4)
    data = M.batches(1, 8, seed=5)
    micro = list(M.micro_iter(data, 2, 4, 1, 0))
    with torch.no_grad():
        ref_logits = [ref(x) for x, _ in micro]
        ref_losses = [M.lm_loss(lg, y).item() for lg, (_, y) in zip(ref_logits, micro)]
    for rank, r in enumerate(two):
        loss, logits = r["eval"]
        assert loss == pytest.approx(sum(ref_losses) / len(ref_losses), abs=1e-5)
        if rank == 1:   # last stage returns the logits
            for got, want in zip(logits, ref_logits):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.stack(r["eval_none"]), torch.tensor(ref_losses), atol=1e-5, rtol=0)
        else:
            assert logits is None and r["eval_none"] is None


def test_custom_schedules_train_the_same_model(two):
    _check([r["gpipe"] for r in two], micro=2, gas=4, dp=1)
    assert all(r["gpipe_buffers"] == 4 for r in two)      # the custom schedule's buffer count was used
    _check([r["dp_schedule"] for r in two], micro=2, gas=4, dp=2)


def test_monitor_gets_the_batch_loss(two, monitor_dir):
    import csv
    import glob
    files = glob.glob(os.path.join(monitor_dir, "**", "*train_loss*.csv"), recursive=True)
    assert len(files) == 1, files
    rows = list(csv.reader(open(files[0])))[1:]
    losses = two[0]["gpipe"][1]
    assert [int(r[0]) for r in rows] == [8 * (i + 1) for i in range(STEPS)]      # keyed by samples
    assert [float(r[1]) for r in rows] == pytest.approx(losses, abs=1e-5)


def test_activation_checkpoint_interval(two):
    _check([r["ckpt_interval"] for r in two], micro=2, gas=4, dp=1)


def test_pipeline_use_reentrant_and_interval_setter(two):
    _check([r["ckpt_config"] for r in two], micro=2, gas=4, dp=1)
    for stage, r in enumerate(two):
        ck = r["ckpt_checks"]
        assert (ck["interval"], ck["non_reentrant"], ck["needs_input_grads"]) == (2, True, False)
        # stage 0 holds ReLU, Linear, ReLU, ReLU; stage 1 Linear, ReLU, ReLU, ReLU
        assert ck["blocks_2"] == [[True, False], [True, False]][stage]
        assert ck["blocks_1"] == (1, [[False, True, False, False], [True, False, False, False]][stage])
        assert (ck["reentrant_2"], ck["reentrant_0"]) == (True, False)
        for bad in (-1, 1.5, True):
            assert "set_checkpoint_interval" in ck[f"bad_{bad}"] and ">= 0" in ck[f"bad_{bad}"]


def test_partition_methods_split_as_documented(two):
    expected = {"parameters": [0, 1, 5], "uniform": [0, 3, 5], "type:relu": [0, 4, 5], "[0, 2, 5]": [0, 2, 5]}
    for method, parts in expected.items():
        got_parts = {tuple(r["parts"][method][0]) for r in two}
        assert got_parts == {tuple(parts)}, method
        for stage, r in enumerate(two):
            names = {n.split(".")[0] for n in r["parts"][method][1]}
            owned = {str(i) for i in range(parts[stage], parts[stage + 1]) if i in (0, 1, 3)}
            assert names == owned, (method, stage, names)
        log = two[0]["parts"][method][2]
        assert f"stage=0 layers={parts[1]}" in log and "params=" in log


def test_tuple_int_and_no_grad_activations(two):
    ref = _tuple_reference(M.batches(STEPS, 8))
    merged = {}
    for r in two:
        merged.update(r["tuple"])
    assert set(merged) == set(ref)
    for n, t in merged.items():
        torch.testing.assert_close(t, ref[n].detach(), atol=2e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_fp16_overflow_on_one_stage_skips_everywhere(two):
    scales = set()
    for r in two:
        skipped, scale, unchanged, _ = r["fp16"]
        assert skipped == 1 and unchanged
        scales.add(scale)
    assert scales == {2.0 ** 7}


def test_interleaved_1f1b_trains_the_same_model(two):
    _check([r["interleaved"] for r in two], micro=2, gas=4, dp=1)
    # 6 layers over 4 virtual stages: each stage holds two non-adjacent chunks
    ids0, ids1 = two[0]["interleaved_layers"], two[1]["interleaved_layers"]
    assert max(ids0) > min(ids1), (ids0, ids1)   # stage 0 also holds a chunk after stage 1's first
    assert sorted(two[0]["interleaved_layers"] + two[1]["interleaved_layers"]) == list(range(6))
    ref = M.RefGPT(4)
    with torch.no_grad():
        losses = [M.lm_loss(ref(x), y).item() for x, y in M.micro_iter(M.batches(1, 8, seed=5), 2, 4, 1, 0)]
    for r in two:
        assert r["interleaved_eval"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)


def test_shapes_are_described_once_and_again_on_change(two):
    ref = M.RefGPT(4)
    short = [(x[:, :4], y[:, :4]) for x, y in M.batches(1, 8, seed=5)]
    with torch.no_grad():
        losses = [M.lm_loss(ref(x), y).item() for x, y in M.micro_iter(short, 2, 4, 1, 0)]
    for r in two:
        assert r["eval_short"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    assert two[0]["descriptions"] == (1, 2, 3)    # stage 0: 8 micro-batches, 2 shapes, then a reset
    assert two[1]["descriptions"] == (0, 0, 0)    # the last stage sends no activations


def test_bad_input_gets_clear_errors(two):
    for rank, r in enumerate(two):
        e = r["errors"]
        assert "num_stages=3 must divide the world size 2" in e["stages"]
        assert "zero_optimization.stage 3" in e["zero3"]
        assert "needs data" in e["no_data"] and "data_iter" in e["no_data"]
        assert "multiple of the number of pipeline stages" in e["interleave_m"]
        if rank == 0:
            assert "pair (inputs, labels)" in e["not_pair"]
        else:   # the last stage hears of the first stage's failure
            assert "PipelineError" in e["not_pair"] and "stage 0" in e["not_pair"], e["not_pair"]
