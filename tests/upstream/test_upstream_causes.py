"""Regressions for the causes DeepSpeed's own unit tests found (issue 31, item 5; the driver is
``run_upstream.py``). Each check states DeepSpeed's behaviour against an independent reference
(plain PyTorch, a hand-computed value, the file layout DeepSpeed documents) and failed on the
code before the fix. One spawned world of 2 runs every distributed check."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.helpers.dist import run_distributed


# ---------------------------------------------------------------------------- no process group
def test_get_optim_files_globs_every_optim_states_file_in_natural_order(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_model_state_files, get_optim_files
    names = [f"zero_{i}_optim_states.pt" for i in range(12)]   # not DeepSpeed's rank-file names
    for n in reversed(names):
        (tmp_path / n).write_text("x")
    (tmp_path / "mp_rank_00_model_states.pt").write_text("x")
    assert get_optim_files(tmp_path) == [str(tmp_path / n) for n in names]   # zero_2 before zero_10
    assert get_model_state_files(str(tmp_path)) == [str(tmp_path / "mp_rank_00_model_states.pt")]
    with pytest.raises(FileNotFoundError, match=r"\*_optim_states.pt"):
        get_optim_files(tmp_path / "nothing_here")


def test_inference_schedule_step_layout():
    """DeepSpeed's InferenceSchedule: the forward of micro-batch i on stage s at step i + s;
    its activation is sent at the next step (received there by stage s + 1); two buffers
    alternate; even stages send before they receive, odd stages receive first."""
    from deepspeed.runtime.pipe import schedule as S
    m, p = 3, 3
    steps = {s: list(S.InferenceSchedule(micro_batches=m, stages=p, stage_id=s)) for s in range(p)}
    kinds = {s: [[type(c).__name__ for c in st] for st in steps[s]] for s in steps}
    assert kinds[0] == [["LoadMicroBatch", "ForwardPass"], ["LoadMicroBatch", "SendActivation", "ForwardPass"],
                        ["LoadMicroBatch", "SendActivation", "ForwardPass"], ["SendActivation"], []]
    assert kinds[1] == [[], ["RecvActivation", "ForwardPass"], ["RecvActivation", "SendActivation", "ForwardPass"],
                        ["RecvActivation", "SendActivation", "ForwardPass"], ["SendActivation"]]
    assert kinds[2] == [[], [], ["LoadMicroBatch", "RecvActivation", "ForwardPass"],
                        ["LoadMicroBatch", "RecvActivation", "ForwardPass"],
                        ["LoadMicroBatch", "RecvActivation", "ForwardPass"]]
    for s in range(p):
        for t, st in enumerate(steps[s]):
            fwd = [c.buffer_id for c in st if isinstance(c, S.ForwardPass)]
            send = [c.buffer_id for c in st if isinstance(c, S.SendActivation)]
            if t > 0 and send:   # the buffer sent is the one the previous step's forward filled
                prev = [c.buffer_id for c in steps[s][t - 1] if isinstance(c, S.ForwardPass)]
                assert send == prev and (not fwd or fwd != send)


def test_prime_factors():
    from deepspeed.runtime.pipe.topology import _prime_factors
    for n in range(1, 200):
        fs = _prime_factors(n)
        assert math.prod(fs) == n and fs == sorted(fs)
        assert all(_prime_factors(f) == [f] for f in fs)
    with pytest.raises(ValueError):
        _prime_factors(0)


def test_config_rules_deepspeed_states(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 8}')
    with pytest.raises(ValueError, match="train_batch_size"):     # json alone keeps the last value
        DeepSpeedConfig(str(path))
    path.write_text('{\n "train_batch_size": 8,\n "zero_optimization": {"stage": 1, "stage": 2},\n}')   # hjson
    with pytest.raises(ValueError, match="stage"):
        DeepSpeedConfig(str(path))
    # overlap_comm as DeepSpeed reports it when unset: false below stage 3, true at stage 3
    assert [DeepSpeedZeroConfig(stage=s).overlap_comm for s in range(4)] == [False, False, False, True]
    assert DeepSpeedZeroConfig(stage=1, overlap_comm=True).overlap_comm is True
    # the legacy spellings build DeepSpeed's section classes
    assert type(DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer) is DeepSpeedZeroOffloadOptimizerConfig
    assert type(DeepSpeedZeroConfig(cpu_offload_param=True).offload_param) is DeepSpeedZeroOffloadParamConfig
    from pydantic import Field

    class Conf(DeepSpeedConfigModel):
        new: int = 0
        old: int = Field(0, json_schema_extra={"deprecated": True, "new_param": "new"})

    with pytest.raises(AssertionError, match="'old' is deprecated"):   # DeepSpeed asserts here
        Conf(new=1, old=2)
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled is True   # the older spelling
    assert get_bfloat16_config({"bf16": {"enabled": True}}).enabled is True
    assert get_float16_config({"fp16": {"loss_scale": 128}}).loss_scale == 128


def test_accelerator_op_builders_and_engine_aliases():
    import typing
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from deepspeed.runtime.engine import DeepSpeedOptimizerCallable, DeepSpeedSchedulerCallable
    acc = get_accelerator()
    assert acc.get_op_builder("CPUAdamBuilder") is CPUAdamBuilder
    b = acc.create_op_builder("CPUAdamBuilder")
    assert isinstance(b, CPUAdamBuilder) and b.NAME == "cpu_adam" and b.is_compatible()
    assert acc.get_op_builder("NoSuchBuilder") is None and acc.create_op_builder("NoSuchBuilder") is None
    assert acc.unpin_memory(torch.zeros(2)) is None
    assert typing.get_origin(DeepSpeedOptimizerCallable) is typing.get_origin(DeepSpeedSchedulerCallable)
    assert typing.get_args(DeepSpeedSchedulerCallable)[1] is torch.optim.lr_scheduler.LRScheduler
    assert typing.get_args(DeepSpeedOptimizerCallable)[1] is torch.optim.Optimizer
    import deepspeed.accelerator.supa_accelerator as supa
    assert supa.SUPA_Accelerator().communication_backend_name() == "bccl"


def test_top1gating_accepts_use_tutel():
    from deepspeed.moe.sharded_moe import top1gating
    torch.manual_seed(0)
    logits = torch.randn(8, 4)
    a = top1gating(logits, 1.0, 1, use_tutel=False)
    b = top1gating(logits, 1.0, 1)
    assert all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]) if torch.is_tensor(x))
    with pytest.raises(ValueError, match="tutel"):
        top1gating(logits, 1.0, 1, use_tutel=True)


# ---------------------------------------------------------------------------- one world of 2
class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = torch.nn.Linear(6, 6)
        self.layer2 = torch.nn.Linear(6, 6)
        self.layer1.weight = self.layer2.weight

    def forward(self, x):
        return self.layer2(torch.tanh(self.layer1(x))).pow(2).mean()


def _body(rank, ws, out_dir):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.utils import groups
    from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                              load_state_dict_from_zero_checkpoint)
    out = {}
    torch.manual_seed(0)
    ref = _Tied()
    xs = torch.randn(2 * ws, 6)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
           "stage3_param_persistence_threshold": 0}, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    model = _Tied()
    model.load_state_dict(ref.state_dict())
    eng, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    opt = eng.optimizer

    # ZeRO-3 introspection after one backward: each rank's fp32 gradient partitions, gathered,
    # are plain PyTorch's gradient of the mean loss over the global batch
    eng.backward(eng(xs[2 * rank:2 * rank + 2]))
    parts = opt.get_fp32_grad_partitions()
    out["intro_keys"] = (sorted(parts), [sorted(v) for v in parts.values()], len(opt.fp16_groups),
                         len(opt.fp32_partitioned_groups_flat))
    out["grad_dtypes"] = {str(g.dtype) for v in parts.values() for g in v.values()}
    full = {}
    for gi, params in enumerate(opt.fp16_groups):
        for j, p in enumerate(params):
            mine = parts[gi][j]
            gathered = [torch.zeros_like(mine) for _ in range(ws)]
            dist.all_gather(gathered, mine)
            full[p.ds_id] = torch.cat(gathered)[:p.ds_numel].view(p.ds_shape)
    ref_loss = sum(ref(xs[2 * r:2 * r + 2]) for r in range(ws)) / ws
    ref_loss.backward()
    names = {id(p): n for n, p in model.named_parameters()}
    ref_grads = dict(ref.named_parameters())
    out["grad_err"] = max((full[p.ds_id] - ref_grads[names[id(p)]].grad).abs().max().item()
                          for params in opt.fp16_groups for p in params)
    out["avg_is_parts"] = all(torch.equal(opt.averaged_gradients[i][j].float(), parts[i][j])
                              for i in parts for j in parts[i])
    # safe_set_full_grad / safe_set_local_grad write back what the getters return
    from deepspeed.utils import safe_get_full_grad, safe_get_local_grad, safe_set_full_grad, safe_set_local_grad
    b = model.layer1.bias
    g = safe_get_full_grad(b)
    safe_set_full_grad(b, 2 * g)
    twice = safe_get_full_grad(b)
    loc = safe_get_local_grad(b)
    safe_set_local_grad(b, loc * 0.5)
    out["set_grad_z3"] = (torch.allclose(twice, 2 * g), torch.allclose(safe_get_full_grad(b), g))
    eng.step()
    out["state_steps"] = [int(opt.optimizer.state[m]["step"]) for m in opt.fp32_partitioned_groups_flat]
    out["global_grad_norm_set"] = opt._global_grad_norm is not None

    # GatheredParameters rebinds param.data on exit: a detach() taken inside keeps its values
    w = model.layer2.bias
    with deepspeed.zero.GatheredParameters([w]):
        inside = w.detach()
        copy = w.detach().clone()
    out["detach_alive"] = inside.numel() == copy.numel() and torch.equal(inside, copy)
    out["released"] = w.numel() == 0

    # parameter_offload.forward_hooks: off inside unwrap_model_for_generation, back after
    from deepspeed.runtime.zero import unwrap_model_for_generation
    hooks_before = len(opt.parameter_offload.forward_hooks)
    with unwrap_model_for_generation(eng):
        hooks_inside = len(opt.parameter_offload.forward_hooks)
        whole = model.layer1.weight.numel()
    loss_after = eng(xs[2 * rank:2 * rank + 2]).item()   # the hooks gather again
    out["hooks"] = (hooks_before > 0, hooks_inside, len(opt.parameter_offload.forward_hooks) == hooks_before,
                    whole, math.isfinite(loss_after))

    # checkpoint -> consolidated fp32 in DeepSpeed's 0.16+ form
    ckpt = os.path.join(out_dir, "ckpt")
    eng.save_checkpoint(ckpt, tag="t1")
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    dist.barrier()
    if rank == 0:
        d1 = os.path.join(out_dir, "fp32")
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, d1)
        sd = torch.load(os.path.join(d1, "pytorch_model.bin"), weights_only=True)
        out["tied_one_tensor"] = sd["layer1.weight"] is sd["layer2.weight"]
        out["fp32_err"] = max((sd[n] - t).abs().max().item() for n, t in trained.items())
        d2 = os.path.join(out_dir, "sharded")
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, d2, max_shard_size=100)   # bytes: forces shards
        with open(os.path.join(d2, "pytorch_model.bin.index.json")) as f:
            index = json.load(f)
        shards = sorted(set(index["weight_map"].values()))
        merged = {}
        for s in shards:
            merged.update(torch.load(os.path.join(d2, s), weights_only=True))
        out["shards"] = (len(shards), shards[0], set(index["weight_map"]) == set(sd),
                         all(torch.equal(merged[n], sd[n]) for n in sd))
        legacy = os.path.join(out_dir, "legacy.bin")   # pre-0.16 form: one file
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, legacy, tag="t1")
        out["legacy"] = set(torch.load(legacy, weights_only=True)) == set(sd)
        with pytest.raises(ValueError, match="max_shard_size"):
            convert_zero_checkpoint_to_fp32_state_dict(ckpt, d1, "t1")   # old positional tag
        half = _Tied().half()
        got = load_state_dict_from_zero_checkpoint(half, ckpt)
        out["fp16_kept"] = {str(p.dtype) for p in got.parameters()}
        out["fp16_values"] = max((got.state_dict()[n].float() - trained[n].half().float()).abs().max().item()
                                 for n in trained)
    dist.barrier()
    # every rank converts into the same directory at once (DeepSpeed's own test does): no shared temp file
    both = os.path.join(out_dir, "fp32_both")
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, both, max_shard_size=100)
    dist.barrier()
    with open(os.path.join(both, "pytorch_model.bin.index.json")) as f:
        both_index = json.load(f)
    both_sd = {}
    for s in sorted(set(both_index["weight_map"].values())):
        both_sd.update(torch.load(os.path.join(both, s), weights_only=True))
    out["both_ranks_convert"] = (sorted(os.listdir(both)) == sorted(set(both_index["weight_map"].values())) +
                                 ["pytorch_model.bin.index.json"],
                                 max((both_sd[n] - t).abs().max().item() for n, t in trained.items()))
    dist.barrier()

    # safe_set_full_grad at stage 2: the step uses the gradient written (SGD: p - lr * g)
    lin = torch.nn.Linear(3, 2)
    e2, _, _, _ = deepspeed.initialize(model=lin, config={"train_micro_batch_size_per_gpu": 1,
                                       "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0,
                                       "optimizer": {"type": "SGD", "params": {"lr": 0.5}}})
    e2.backward(e2(torch.ones(1, 3)).sum())
    w = e2.module.weight
    before = w.detach().clone()
    new_g = torch.arange(6, dtype=torch.float32).view(2, 3)
    safe_set_full_grad(w, new_g)
    got = safe_get_full_grad(w)
    e2.step()
    out["set_grad_z2"] = (torch.equal(got, new_g), torch.allclose(w.detach(), before - 0.5 * new_g))
    # DeepSpeed's single_partition_of_fp32_groups: the ranks' fp32 partitions hold every parameter value
    mine = e2.optimizer.single_partition_of_fp32_groups[0]
    parts = [torch.zeros_like(mine) for _ in range(ws)]
    dist.all_gather(parts, mine)
    vals = torch.cat([p.detach().reshape(-1) for p in e2.module.parameters()])
    out["fp32_partitions"] = (len(e2.optimizer.single_partition_of_fp32_groups),
                              bool(torch.isin(vals, torch.cat(parts)).all()))

    # tag validation: per-rank tags save one complete checkpoint under rank 0's tag (Warn and
    # Ignore); an empty save_dir is a ValueError on every rank, not a hang
    eng0, _, _, _ = deepspeed.initialize(model=torch.nn.Linear(3, 3), config={
        "train_micro_batch_size_per_gpu": 1, "checkpoint": {"tag_validation": "Ignore"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    eng0.save_checkpoint(os.path.join(out_dir, "tags"), tag=f"tag-{rank}")
    tags = os.path.join(out_dir, "tags")
    out["tag_dirs"] = sorted(n for n in os.listdir(tags) if os.path.isdir(os.path.join(tags, n)) and n[0] != ".")
    errs = []
    for bad in (None, ""):
        try:
            eng0.save_checkpoint(bad)
        except ValueError as err:
            errs.append(type(err).__name__)
    out["bad_dirs"] = errs

    # MoE-aware clip_grad_norm_ / CheckOverflow (expert parameters carry allreduce=False)
    groups._create_expert_and_data_parallel(2)
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    p1.grad, p2.grad = torch.tensor([1.0]), torch.tensor([float(rank + 1)])
    p2.allreduce = False
    norm = ds_utils.clip_grad_norm_([p1, p2], max_norm=0.1)
    local = [math.sqrt(1 + (r + 1) ** 2) for r in range(ws)]
    out["clip_norm"] = (norm, sum(local) / ws)   # DeepSpeed: the mean of the ranks' norms
    q1, q2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    q1.grad, q2.grad = torch.tensor([1.0]), torch.tensor([1.0 if rank == 0 else float("inf")])
    q2.allreduce = False
    flat = [torch.cat([q1.grad, q2.grad])]
    norm = ds_utils.get_weight_norm(flat)
    out["overflow"] = (ds_utils.CheckOverflow([[q1, q2]]).check_using_norm([norm], reduce_overflow=False),
                       ds_utils.CheckOverflow([[q1, q2]]).check())

    # reduce_scatter_coalesced (DeepSpeed narrows each output to this rank's real elements): the mean
    # over ranks of arange(3) * (rank + 1) is [0, 1.5, 3], split in chunks of ceil(3 / 2) = 2
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
    parts = reduce_scatter_coalesced([torch.arange(3.) * (rank + 1), torch.full((1,), rank + 1.)])
    out["rsc"] = [p.tolist() for p in parts]

    # sparse embedding gradients at stage 0 (sparse_gradients): reduced, kept sparse for SparseAdam, averaged
    # or summed per engine.gradient_average; a client optimizer whose groups have no 'lr' logs lr 0.0
    torch.manual_seed(0)
    emb = torch.nn.Sequential(torch.nn.Embedding(6, 2, sparse=True), torch.nn.Flatten(), torch.nn.Linear(4, 1))
    ref_emb = {n: t.clone() for n, t in emb.state_dict().items()}

    class _NoLr(torch.optim.Optimizer):   # as DeepSpeed's test optimizer: SGD + SparseAdam under defaults={}
        def __init__(self):
            super().__init__(list(emb.parameters()), defaults={})
            self.dense, self.sparse = torch.optim.SGD(list(emb[2].parameters()), lr=0.1), \
                torch.optim.SparseAdam(list(emb[0].parameters()), lr=0.1)

        def step(self, closure=None):
            self.dense.step()
            self.sparse.step()

    e3, _, _, _ = deepspeed.initialize(model=emb, optimizer=_NoLr(), config={
        "train_batch_size": ws, "steps_per_print": 1, "sparse_gradients": True})
    ids = [torch.tensor([[1, 3]]), torch.tensor([[3, 4]])]
    sums = {}
    for average in (True, False):
        e3.gradient_average = average
        e3.zero_grad()
        e3.backward(e3(ids[rank]).sum())
        sums[average] = {n: (p.grad.is_sparse, p.grad.to_dense().clone()) for n, p in e3.module.named_parameters()}
    e3.step()
    out["sparse_grad"] = {}
    for average in (True, False):
        ref = torch.nn.Sequential(torch.nn.Embedding(6, 2), torch.nn.Flatten(), torch.nn.Linear(4, 1))
        ref.load_state_dict(ref_emb)
        sum(ref(i).sum() for i in ids).backward()     # plain PyTorch on both ranks' batches: the SUM
        div = ws if average else 1
        out["sparse_grad"][average] = (
            sums[average]["0.weight"][0],
            max((sums[average][n][1] - p.grad / div).abs().max().item() for n, p in ref.named_parameters()))
    out["gathered"] = [t.item() for t in e3.all_gather_scalar(torch.tensor(float(rank + 7)))]
    return out


def test_deepspeed_unit_test_causes_on_two_ranks(tmp_path):
    r0, r1 = run_distributed(_body, world_size=2, args=(str(tmp_path),), timeout=240)
    for r in (r0, r1):
        assert r["intro_keys"] == ([0], [[0, 1, 2]], 1, 1), r["intro_keys"]   # layer1.weight is layer2.weight
        assert r["grad_dtypes"] == {"torch.float32"}
        assert r["grad_err"] < 1e-6 and r["avg_is_parts"]
        assert r["state_steps"] == [1] and r["global_grad_norm_set"]
        assert r["detach_alive"] and r["released"]
        assert r["set_grad_z3"] == (True, True) and r["set_grad_z2"] == (True, True)
        assert r["fp32_partitions"] == (1, True)
        assert r["hooks"] == (True, 0, True, 36, True)
        assert r["tag_dirs"] == ["tag-0"]
        assert r["bad_dirs"] == ["ValueError", "ValueError"]
        assert r["clip_norm"][0] == pytest.approx(r["clip_norm"][1], rel=1e-6)
        assert r["overflow"] == (True, True)
        assert r["both_ranks_convert"][0] and r["both_ranks_convert"][1] < 1e-6   # no temp files left, values
    assert r0["rsc"] == [[0.0, 1.5], [1.5]] and r1["rsc"] == [[3.0], []]
    for r in (r0, r1):
        assert r["sparse_grad"][True][0] and r["sparse_grad"][True][1] < 1e-6, r["sparse_grad"]     # mean
        assert r["sparse_grad"][False][1] < 1e-6, r["sparse_grad"]                                 # sum
        assert r["gathered"] == [7.0, 8.0]
    assert r0["tied_one_tensor"] and r0["fp32_err"] < 1e-6
    n, first, names_ok, values_ok = r0["shards"]
    assert n > 1 and first == f"pytorch_model-00001-of-{n:05d}.bin" and names_ok and values_ok
    assert r0["legacy"]
    assert r0["fp16_kept"] == {"torch.float16"} and r0["fp16_values"] == 0.0
    assert {"rng_state_rank_0.pt", "rng_state_rank_1.pt"} <= set(os.listdir(tmp_path / "tags" / "tag-0"))


def test_model_3d_desc_reshape_and_descriptor(tmp_path):
    """DeepSpeed's reshape maps (old files numbered dp * (pp*tp) + pp * tp + tp) and the shape of a
    tag directory read from checkpoint_parallel_dimensions or, without it, from the file counts."""
    from deepspeed.checkpoint import get_model_3d_descriptor, model_3d_desc
    src = model_3d_desc(pp_degree=2, tp_degree=2, dp_degree=2)
    one = src.reshape(model_3d_desc(1, 1, 1))
    assert len(one) == 1 and one[0].get_data(pp_index=0, tp_index=0) == [0, 4, 1, 5, 2, 6, 3, 7]
    tp2 = src.reshape(model_3d_desc(pp_degree=1, tp_degree=2, dp_degree=2))
    assert [[m.get_data(0, t) for t in range(2)] for m in tp2] == [[[0, 4], [1, 5]], [[2, 6], [3, 7]]]
    pp2 = src.reshape(model_3d_desc(pp_degree=2, tp_degree=1, dp_degree=1))
    assert [pp2[0].get_data(p, 0) for p in range(2)] == [[0, 4, 1, 5], [2, 6, 3, 7]]
    ok, why = src.can_reshape(model_3d_desc(4, 1, 1))
    assert not ok and "PP: 2 ---> 4" in why[0]
    with pytest.raises(ValueError, match="Expansion"):
        src.reshape(model_3d_desc(1, 4, 1))

    def layout(dims):
        for f in tmp_path.iterdir():
            f.unlink()
        for mp, d in enumerate(dims):
            state = {"param_shapes": [{}]} if d is None else {"param_shapes": [{}], "checkpoint_parallel_dimensions": d}
            torch.save(state, tmp_path / f"mp_rank_{mp:02d}_model_states.pt")
            for dp in range(2):
                torch.save({}, tmp_path / f"bf16_zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt")
        return get_model_3d_descriptor(str(tmp_path))

    d = layout([None, None])   # no dimensions recorded: 2 model files -> tp 2, 4 zero files -> dp 2
    assert (d.pp_degree, d.tp_degree, d.dp_degree) == (1, 2, 2)
    d = layout([{"pp_degree": 2, "tp_degree": 1}] * 2)
    assert (d.pp_degree, d.tp_degree, d.dp_degree) == (2, 1, 2)
    with pytest.raises(RuntimeError, match="missing from model-state files"):
        layout([{"pp_degree": 2, "tp_degree": 1}, None])
    with pytest.raises(RuntimeError, match="disagrees"):
        layout([{"pp_degree": 2, "tp_degree": 1}, {"pp_degree": 1, "tp_degree": 2}])


def test_driver_turns_a_workers_pytest_outcome_into_an_assertion(tmp_path):
    """The staged harness re-raises pytest.fail/"DID NOT RAISE" (BaseExceptions, which kill a Pool
    worker and hang the test) as an AssertionError; ordinary exceptions pass through unchanged."""
    from tests.upstream.run_upstream import _WORKER_RAISE, _patch_worker_failures
    src = ("class Skipped(BaseException):\n    pass\n\n\nclass Exec:\n    def _dist_run(self, fn):\n"
           "        try:\n            fn()\n        except BaseException as e:\n"
           "            if isinstance(e, Skipped):\n                pass\n" + _WORKER_RAISE)
    path = tmp_path / "common.py"
    path.write_text(src)
    _patch_worker_failures(str(path))
    ns = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)

    def fail():
        pytest.fail("DID NOT RAISE AssertionError")
    with pytest.raises(AssertionError, match="Failed: DID NOT RAISE AssertionError"):
        ns["Exec"]()._dist_run(fail)
    with pytest.raises(KeyError):
        ns["Exec"]()._dist_run(lambda: {}["k"])


def test_set_log_level_from_string_sets_logger_and_handlers():
    from deepspeed.utils import logger, set_log_level_from_string
    from deepspeed.utils.logging import should_log_le
    before = (logger.level, [h.level for h in logger.handlers])
    try:
        set_log_level_from_string("WARNING")
        assert logger.level == 30 and all(h.level == 30 for h in logger.handlers)
        assert not should_log_le("info") and should_log_le("error")
        with pytest.raises(ValueError, match="'loud' is not a log level; valid: debug, info"):
            set_log_level_from_string("loud")
    finally:
        logger.setLevel(before[0])
        for h, lv in zip(logger.handlers, before[1]):
            h.setLevel(lv)


def test_safe_getters_return_none_for_frozen_parameters():
    """DeepSpeed keeps no fp32 master, gradient or optimizer state for a parameter that does not
    require grad: every safe_get_* returns None for it (test_zero_tensor_fragment's validate_tensor)."""
    import deepspeed
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state)
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    eng, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "steps_per_print": 0,
                                                        "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
    eng.backward(eng(torch.ones(1, 3)).sum())
    getters = [safe_get_full_fp32_param, safe_get_full_grad, safe_get_local_fp32_param, safe_get_local_grad]
    assert [g(model.bias) for g in getters] == [None] * 4
    assert safe_get_full_optimizer_state(model.bias, "exp_avg") is None
    assert safe_get_local_optimizer_state(model.bias, "exp_avg") is None
    assert all(g(model.weight) is not None for g in getters)
    eng.destroy()


def test_trim_mean_sorted_copy():
    from deepspeed.utils.timer import trim_mean
    data = [3.0, 1.0, 2.0, 100.0, 0.0]
    assert trim_mean(data, 0.2) == 2.0 and data == [3.0, 1.0, 2.0, 100.0, 0.0]   # drops 0 and 100, keeps order
    assert trim_mean([], 0.1) == 0
    with pytest.raises(ValueError, match="trim_percent"):
        trim_mean(data, 1.5)


def test_checkpointing_module_globals_are_the_configuration():
    """DeepSpeed's ``deepspeed.checkpointing`` is runtime.activation_checkpointing.checkpointing, whose
    module globals (PARTITION_ACTIVATIONS, CPU_CHECKPOINT, num_layers, ...) are what configure() set and
    are assigned directly by clients; contiguous checkpointing without a layer count is an AssertionError."""
    import deepspeed
    import deepspeed.checkpointing as cp_import
    import deepspeed.runtime.activation_checkpointing.checkpointing as impl
    from deepspeed.runtime.activation_checkpointing import settings
    cp = deepspeed.checkpointing
    assert cp is impl and cp_import is impl
    try:
        settings._reset_settings()
        assert (cp.PARTITION_ACTIVATIONS, cp.CPU_CHECKPOINT, cp.num_layers, cp.mpu,
                cp.deepspeed_checkpointing_enabled) == (False, False, None, None, False)
        cp.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3,
                     checkpoint_in_cpu=True, synchronize=True)
        assert (cp.PARTITION_ACTIVATIONS, cp.CONTIGUOUS_CHECKPOINTING, cp.num_layers, cp.CPU_CHECKPOINT,
                cp.SYNCHRONIZE, cp.PROFILE_TIME, cp.deepspeed_checkpointing_enabled) == (
                    True, True, 3, True, True, False, True)
        cp.CPU_CHECKPOINT, cp.PROFILE_TIME = False, True   # assigned as DeepSpeed's clients do
        assert (settings.current().checkpoint_in_cpu, settings.current().profile) == (False, True)
        settings._reset_settings()
        with pytest.raises(AssertionError, match="number of layers"):
            cp.configure(None, partition_activations=True, contiguous_checkpointing=True)
        assert cp.deepspeed_checkpointing_enabled is False   # refused before anything was installed
    finally:
        settings._reset_settings()


def test_sparse_tensor_rows():
    """deepspeed.runtime.sparse_tensor.SparseTensor: the non-zero rows of a dense tensor or the rows of a
    row-sparse COO tensor; add() appends, to_dense() sums rows named twice (reference: dense arithmetic)."""
    from deepspeed.runtime.sparse_tensor import SparseTensor
    x = torch.zeros(5, 3)
    x[1], x[3] = torch.tensor([1., -1., 0.]), torch.tensor([2., 0., 5.])   # row 1 sums to 0 but is not zero
    sx = SparseTensor(x)
    assert sx.indices.tolist() == [1, 3] and torch.equal(sx.to_dense(), x)
    y = torch.zeros(5, 3)
    y[3], y[4] = 1.0, 2.0
    sx.add(SparseTensor(y.to_sparse(1)))
    assert torch.equal(sx.to_dense(), x + y) and torch.equal(sx.to_coo_tensor().to_dense(), x + y)
    assert sx.sparse_size() == (4 + 12, 15) and SparseTensor.type() == "deepspeed.SparseTensor"
    with pytest.raises(ValueError, match="dense sizes differ"):
        sx.add(SparseTensor(torch.ones(2, 3)))


def test_reentrant_checkpoint_takes_keyword_arguments():
    """DeepSpeed 0.19's checkpoint(function, *args, **kwargs): keyword arguments reach the function and a
    tensor passed by keyword gets its gradient (reference: the same function without checkpointing)."""
    import deepspeed

    def function(value, *, scale, offset):
        return value * scale + offset

    torch.manual_seed(0)
    value, scale = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    ref_value, ref_scale = value.detach().clone().requires_grad_(), scale.detach().clone().requires_grad_()
    function(ref_value, scale=ref_scale, offset=1.5).sum().backward()
    out = deepspeed.checkpointing.checkpoint(function, value, scale=scale, offset=1.5)
    out.sum().backward()
    assert torch.equal(out, function(ref_value, scale=ref_scale, offset=1.5))
    assert torch.equal(value.grad, ref_value.grad) and torch.equal(scale.grad, ref_scale.grad)


def test_zero_init_refuses_a_one_rank_group_under_a_multi_process_launcher(monkeypatch):
    """DeepSpeed 0.19: zero.Init raises when the launcher says WORLD_SIZE > 1 but the resolved group has one
    rank (nothing would be partitioned); an explicit group, WORLD_SIZE 1/absent/unreadable pass."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import _contradicting_single_rank_pg_error as check
    assert "WORLD_SIZE=8" in check(1, None, {"WORLD_SIZE": "8"}) and "init_distributed" in check(1, None,
                                                                                                 {"WORLD_SIZE": "8"})
    assert [check(1, None, env) for env in ({"WORLD_SIZE": "1"}, {}, {"WORLD_SIZE": ""}, {"WORLD_SIZE": "x"},
                                            {"WORLD_SIZE": None})] == [None] * 5
    assert check(8, None, {"WORLD_SIZE": "8"}) is None and check(1, object(), {"WORLD_SIZE": "8"}) is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4"):
        deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}})


def test_tiled_linear_is_the_linear_it_was_cut_from():
    """deepspeed.runtime.zero.tiling.TiledLinear: tiles hold the blocks of the source weight (bias on each
    row's last tile) and the forward (and its gradient) equals the source nn.Linear's."""
    from deepspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias
    torch.manual_seed(0)
    base = torch.nn.Linear(7, 5)
    tiled = TiledLinear(7, 5, in_splits=3, out_splits=2, init_linear=base)
    assert (tiled.in_parts, tiled.out_parts) == ([0, 3, 5, 7], [0, 3, 5])
    assert torch.equal(tiled.linears[1][2].weight, base.weight[3:5, 5:7]) and tiled.linears[1][0].bias is None
    x = torch.randn(4, 7, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    out = tiled(x)
    ref = base(xr)
    assert torch.allclose(out, ref, atol=1e-6)
    out.sum().backward()
    ref.sum().backward()
    assert torch.allclose(x.grad, xr.grad, atol=1e-6)
    parts = TiledLinear(7, 5, in_splits=3, out_splits=2, init_linear=base, combine_out_splits=False)(x)
    assert [tuple(p.shape) for p in parts] == [(4, 3), (4, 2)]
    for bad in (0, 8):
        with pytest.raises(RuntimeError, match="in splits"):
            TiledLinear(7, 5, in_splits=bad)

    class _ReturnsBias(torch.nn.Linear):   # Megatron-style: (x @ W.T, bias)
        def forward(self, inp):
            return torch.nn.functional.linear(inp, self.weight), self.bias

    tb = TiledLinearReturnBias(7, 5, in_splits=2, out_splits=2, linear_cls=_ReturnsBias, init_linear=base)
    t, b = tb(x.detach())
    assert torch.allclose(t + b, base(x.detach()), atol=1e-6) and torch.equal(b, base.bias)


def test_zero3_elastic_checkpoint_warns_and_recovery_script_permissions(tmp_path, monkeypatch):
    """DeepSpeed 0.19: ZeRO-3 with elastic_checkpoint warns that it is deprecated; the engine's
    _change_recovery_script_permissions makes the script executable, and only logs when it cannot."""
    import stat

    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    warned, infos = [], []
    monkeypatch.setattr(deepspeed.utils.logger, "warning", lambda m, *a, **k: warned.append(str(m)))
    monkeypatch.setattr(deepspeed.utils.logger, "info", lambda m, *a, **k: infos.append(str(m)))
    DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
    assert warned == []
    DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    assert any("elastic checkpointing is deprecated" in m.lower() for m in warned)
    script = tmp_path / "zero_to_fp32.py"
    script.write_text("print()\n")
    script.chmod(0o644)
    DeepSpeedEngine._change_recovery_script_permissions(None, str(script))
    assert script.stat().st_mode & stat.S_IXUSR and infos == []
    DeepSpeedEngine._change_recovery_script_permissions(None, str(tmp_path / "missing.py"))
    assert len(infos) == 1 and "missing.py" in infos[0]


def test_zero3_linear_function_matches_f_linear():
    """deepspeed.runtime.zero.linear: zero3_linear_wrap / LinearFunctionForZeroStage3 give F.linear's value and
    gradients (batched and unbatched), the forward's autocast dtype with fp32 gradients, and work under
    torch.func.vmap and grad_and_value."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap
    torch.manual_seed(0)
    for shape in ((3, 2, 6), (6,)):
        w, b, x = torch.randn(4, 6, requires_grad=True), torch.randn(4, requires_grad=True), \
            torch.randn(*shape, requires_grad=True)
        rw, rb, rx = (t.detach().clone().requires_grad_() for t in (w, b, x))
        out, ref = zero3_linear_wrap(x, w, b), F.linear(rx, rw, rb)
        (out * torch.arange(4.)).sum().backward()
        (ref * torch.arange(4.)).sum().backward()
        assert torch.allclose(out, ref) and all(torch.allclose(a.grad, r.grad, atol=1e-6)
                                                for a, r in ((w, rw), (b, rb), (x, rx)))
    w, x = torch.randn(4, 6, requires_grad=True), torch.randn(2, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = zero3_linear_wrap(x, w)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert torch.allclose(w.grad, torch.ones(2, 4).t() @ x.detach(), atol=0.05)
    xs = torch.randn(3, 6)
    wd = w.detach()
    assert torch.allclose(torch.func.vmap(lambda xi: LinearFunctionForZeroStage3.apply(xi, wd).sum())(xs),
                          (xs @ wd.t()).sum(-1), atol=1e-5)
    import functools
    from deepspeed.runtime.zero import linear as zl
    assert isinstance(zl.autocast_custom_fwd, functools.partial) and zl.autocast_custom_fwd.func is torch.amp.custom_fwd
    assert zl.autocast_custom_bwd.func is torch.amp.custom_bwd
    assert zl.autocast_custom_bwd.keywords == {"device_type": "cpu"}
    g, v = torch.func.grad_and_value(lambda ww: zero3_linear_wrap(xs, ww).sum())(wd)
    assert torch.allclose(g, torch.ones(3, 4).t() @ xs, atol=1e-5) and torch.allclose(v, (xs @ wd.t()).sum())


def test_no_sync_refuses_reentry_and_step_inside():
    """DeepSpeed: engine.step() inside no_sync() and a nested no_sync() are AssertionErrors; the flag
    inside_no_sync_ctxt is set inside and cleared after (also after an exception)."""
    import deepspeed
    lin = torch.nn.Linear(2, 1)
    eng, _, _, _ = deepspeed.initialize(model=lin, config={"train_micro_batch_size_per_gpu": 1,
                                        "gradient_clipping": 0.0,
                                        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert eng.inside_no_sync_ctxt is False
    with eng.no_sync():
        assert eng.inside_no_sync_ctxt is True
        eng.backward(eng(torch.ones(1, 2)).sum())
        with pytest.raises(AssertionError, match="illegal to call Engine.step"):
            eng.step()
        with pytest.raises(AssertionError, match="reentry is unsupported"):
            with eng.no_sync():
                pass
        assert eng.inside_no_sync_ctxt is True
    assert eng.inside_no_sync_ctxt is False
    before = lin.weight.detach().clone()
    eng.step()                                  # outside: the update applies the gradient kept by no_sync
    assert torch.allclose(lin.weight.detach(), before - 0.1 * torch.ones(1, 2))


def test_pin_memory_tracker_totals_and_doubling_checkpoints():
    """DeepSpeed 0.19's deepspeed.utils.pin_memory_tracker: every accelerator pin_memory() that pins adds
    the tensor's bytes to a process total; an INFO line the first time the total reaches 32 GiB, then
    64, 128, ... GiB (one rung per doubling); the CPU accelerator pins nothing and counts nothing."""
    import logging
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.utils import pin_memory_tracker as pmt
    gib = 1 << 30
    assert [pmt._fmt_bytes(n) for n in (512, 2048, 3 << 20, 5 * gib // 2)] == ["512 B", "2.0 KB", "3.00 MB",
                                                                               "2.500 GB"]

    class Collect(logging.Handler):       # the DeepSpeed logger's own records, whatever else is attached
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())
    ds_logger, seen = logging.getLogger("DeepSpeed"), Collect()
    old_level = ds_logger.level
    ds_logger.addHandler(seen)
    ds_logger.setLevel(logging.INFO)
    pmt._tracker.reset()
    try:
        for n in (30 * gib, 3 * gib, 31 * gib, 70 * gib):     # totals 30, 33, 64, 134 GiB
            pmt.track_pinned_memory(n)
        pmt.pinned_memory_summary("unit")
        lines = seen.lines
        assert (pmt._tracker._bytes, pmt._tracker._calls) == (134 * gib, 4)
        assert pmt._tracker._next_checkpoint == 256 * gib          # 32 -> 64 -> 128 crossed, 256 next
        assert [ln for ln in lines if "checkpoint" in ln] == [
            "[pinned-memory checkpoint] reached 32.000 GB: 33.000 GB pinned in 2 allocations",
            "[pinned-memory checkpoint] reached 64.000 GB: 64.000 GB pinned in 3 allocations",
            "[pinned-memory checkpoint] reached 128.000 GB: 134.000 GB pinned in 4 allocations"]
        assert lines[-1] == "[pinned-memory unit] 134.000 GB pinned in 4 allocations"

        class PinnableStandIn:                  # CPU torch cannot pin: record that CUDA's path pins once
            nbytes, pinned = 4096, 0

            def pin_memory(self):
                self.pinned += 1
                return self
        pmt._tracker.reset()
        t = PinnableStandIn()
        assert CUDA_Accelerator().pin_memory(t) is t and t.pinned == 1
        assert (pmt._tracker._bytes, pmt._tracker._calls) == (4096, 1)
        x = torch.zeros(1024)
        assert CPU_Accelerator().pin_memory(x) is x
        assert (pmt._tracker._bytes, pmt._tracker._calls) == (4096, 1)
    finally:
        ds_logger.removeHandler(seen)
        ds_logger.setLevel(old_level)
        pmt._tracker.reset()


def _locked_kib():
    """The kernel's count of this process's page-locked memory (/proc/self/status VmLck), in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the kernel's VmLck count (Linux)")
def test_native_pin_memory_backend_page_locks_copies_and_frees(monkeypatch):
    """DS_PIN_MEMORY_BACKEND=native (DeepSpeed 0.19): the accelerator's pin_memory returns a page-locked
    copy even on the CPU; is_pinned sees views of it; unpin_memory frees it once (True, then False); an
    allocation nobody unpins is freed when its last view is collected. The kernel's own VmLck count is
    the reference for 'page-locked' and 'freed'."""
    import gc
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    import deepspeed.ops.op_builder as op_builder
    import deepspeed.utils.pin_memory as pin_util
    from deepspeed.utils import pin_memory_tracker as pmt
    acc, page = CPU_Accelerator(), os.sysconf("SC_PAGESIZE")
    x = torch.arange(3 * 4096, dtype=torch.float32).reshape(3, 4096)          # 48 KiB, whole pages
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    pmt._tracker.reset()
    base_kib = _locked_kib()
    p = acc.pin_memory(x)
    assert torch.equal(p, x) and p.shape == x.shape and p.data_ptr() != x.data_ptr() and p.data_ptr() % page == 0
    assert _locked_kib() - base_kib == 48 and pmt._tracker._bytes == x.nbytes
    assert acc.is_pinned(p) and acc.is_pinned(p[2, 5:]) and not acc.is_pinned(x)
    assert not acc.is_pinned(torch.zeros(2, device="meta"))
    flat = acc.pin_memory(x, match_shape=False)
    assert flat.shape == (x.numel(),) and torch.equal(flat, x.reshape(-1)) and _locked_kib() - base_kib == 96
    view = p[1]
    assert acc.unpin_memory(p) is True and acc.unpin_memory(p) is False
    assert _locked_kib() - base_kib == 48 and not acc.is_pinned(view)
    del flat
    gc.collect()
    assert _locked_kib() == base_kib                                           # freed with its last tensor
    # the torch backend (default) pins nothing on the CPU; an unknown backend name is refused
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND")
    assert acc.pin_memory(x) is x and acc.unpin_memory(x) is None and not acc.is_pinned(x)
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "fast")
    with pytest.raises(ValueError, match="'torch' \\(default\\), 'native'"):
        acc.pin_memory(x)
    # native selected but the op cannot be loaded: an error at once, no silent torch fallback

    class Unloadable:
        def load(self):
            raise OSError("no libc here")
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    monkeypatch.setattr(pin_util, "_shared_native_pins", None)
    monkeypatch.setattr(op_builder, "PinMemoryBuilder", Unloadable)
    with pytest.raises(RuntimeError, match="DS_PIN_MEMORY_BACKEND=native needs the pin_memory op"):
        acc.pin_memory(x)
    pmt._tracker.reset()
