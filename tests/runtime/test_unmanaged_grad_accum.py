"""``managed_gradient_accumulation: false`` (DeepSpeed 0.19): ``backward()`` only accumulates, every
``step()`` reduces the window's gradients across the data-parallel ranks and updates.

Reference: plain PyTorch on the same global micro-batches, where one optimizer step uses the sum
over the window's backward passes of the gradient of ``loss / divisor`` averaged over the ranks
(``divisor``: ``gradient_accumulation_steps`` when the engine divides, ``scale_wrt_gas=True`` and a
user-driven ``loss.backward()``; the caller's own ``n`` with ``scale_wrt_gas=False``).

One spawned world of two ranks runs the fast checks (tests/helpers/dist.py)."""
import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import full_weights, row_batches

GAS = 4          # the configured value; the windows below run 1, 2 or 3 backward passes
LR = 0.1
MICRO = 2        # rows per rank per micro-batch


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))).float(), y.float())


def _model(seed=0):
    torch.manual_seed(seed)
    return _Net()


_batches = row_batches   # n global micro-batches of 4 rows: rank r trains on rows [2r, 2r + 2)


def _rows(t, rank):
    return t[MICRO * rank:MICRO * rank + MICRO]


def _config(stage, managed=False, optimizer=None, **zero):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 0,
            "gradient_clipping": 0.0, "managed_gradient_accumulation": managed,
            "optimizer": optimizer or {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, **zero}}


def _engine(cfg, seed=0):
    import deepspeed
    model = _model(seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine




# A window: (number of backward passes, how): "manual" = engine.backward(loss / n, scale_wrt_gas=False),
# "engine" = engine.backward(loss) (divided by GAS), "torch" = loss.backward() (divided by GAS by the hooks)
WINDOWS = [(2, "manual"), (3, "engine"), (1, "manual"), (2, "torch")]


def _divisor(n, how):
    return n if how == "manual" else GAS


def _reference(batches, windows, seed=0):
    model = _model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    it = iter(batches)
    for n, how in windows:
        for _ in range(n):
            x, y = next(it)
            loss = sum(model(_rows(x, r), _rows(y, r)) for r in range(2)) / 2   # mean over ranks
            (loss / _divisor(n, how)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _local_grads(seed, x, y, divisor):
    """One rank's own gradient of loss / divisor, without any reduction."""
    model = _model(seed)
    (model(x, y) / divisor).backward()
    return [p.grad.clone() for p in model.parameters()]


def _run_windows(engine, batches, windows, rank, out, key):
    it = iter(batches)
    info = []
    for n, how in windows:
        for _ in range(n):
            x, y = next(it)
            loss = engine(_rows(x, rank), _rows(y, rank))
            if how == "manual":
                engine.backward(loss / n, scale_wrt_gas=False)
            elif how == "engine":
                engine.backward(loss)
            else:
                loss.backward()
            info.append(("boundary_in_window", engine.is_gradient_accumulation_boundary()))
        engine.step()
        info.append(("applied", engine.was_step_applied(), engine.global_steps, engine.global_samples))
    out[key] = info
    return full_weights(engine)


def _body(rank, world_size):
    import deepspeed
    out = {}
    batches = _batches(sum(n for n, _ in WINDOWS) + 1)
    # 1. every stage: windows of 1-3 backward passes (none equal to GAS), each closed by step()
    for stage in (0, 1, 2, 3):
        e = _engine(_config(stage))
        out[("managed_query", stage)] = e.managed_gradient_accumulation()
        out[("weights", stage)] = _run_windows(e, batches, WINDOWS, rank, out, ("info", stage))
        e.destroy()
    # 2. stage 0 and 1: a backward keeps the gradients local; step() reduces them
    x, y = batches[-1]
    for stage in (0, 1):
        e = _engine(_config(stage))
        launches = (lambda: e.strategy.allreduce_launches) if stage == 0 else \
            (lambda: sum(e.optimizer.launch_counts.values()))
        before = launches()
        e.backward(e(_rows(x, rank), _rows(y, rank)))
        out[("local", stage)] = [p.grad.clone() for p in e.module.parameters()]
        out[("launches_in_backward", stage)] = launches() - before
        e.step()
        out[("launches_in_step", stage)] = launches() - before
        out[("one_step", stage)] = full_weights(e)
        e.destroy()
    out["local_ref"] = _local_grads(0, _rows(x, rank), _rows(y, rank), GAS)
    # 2b. (managed) ZeRO-2 inside coalesce_grad_reduction / no_sync: safe_get_full_grad is the local,
    #     not yet reduced param.grad, as DeepSpeed (upstream test_safe_get_full_grad_returns_local_pre_reduce_value)
    from deepspeed.utils import safe_get_full_grad
    for dtype in ("fp32", "bf16"):
        cfg = _config(2, managed=True)
        half = torch.float32
        if dtype == "bf16":
            cfg["bf16"], half = {"enabled": True}, torch.bfloat16
        e = _engine(cfg)
        with e.coalesce_grad_reduction():
            e.set_gradient_accumulation_boundary(True)
            e.backward(e(_rows(x, rank).to(half), _rows(y, rank).to(half)))
            out[("z2_local", dtype)] = [(safe_get_full_grad(p).clone(), p.grad.clone()) for p in e.module.parameters()]
        out[("z2_reduced", dtype)] = [safe_get_full_grad(p).clone() for p in e.module.parameters()]
        e.step()
        e.destroy()
    # 3. refusals
    refusals = {}
    for stage in (0, 2):
        e = _engine(_config(stage))
        try:
            e.set_gradient_accumulation_boundary(True)
        except AssertionError as err:
            refusals[("boundary", stage)] = str(err)
        try:
            with e.coalesce_grad_reduction():
                pass
        except AssertionError as err:
            refusals[("coalesce", stage)] = str(err)
        e.backward(e(_rows(x, rank), _rows(y, rank)))
        with e.no_sync():
            try:
                e.step()
            except AssertionError as err:
                refusals[("step_in_no_sync", stage)] = str(err)
        e.destroy()
    from deepspeed.pipe import PipelineModule
    pipe = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2,
                          loss_fn=torch.nn.MSELoss())
    try:
        deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(),
                             config={**_config(0), "train_micro_batch_size_per_gpu": 1})
    except AssertionError as err:
        refusals["pipeline"] = str(err)
    out["refusals"] = refusals
    return out


def test_unmanaged_gradient_accumulation_world2():
    res = run_distributed(_body, world_size=2, timeout=240)
    ref = _reference(_batches(sum(n for n, _ in WINDOWS) + 1), WINDOWS)
    samples = 0
    expected_info = []
    for i, (n, _) in enumerate(WINDOWS):
        samples += n * MICRO * 2          # micro-batches run x micro-batch x data-parallel ranks
        expected_info += [("boundary_in_window", False)] * n + [("applied", True, i + 1, samples)]
    for stage in (0, 1, 2, 3):
        for rank in (0, 1):
            r = res[rank]
            assert r[("managed_query", stage)] is False
            assert r[("info", stage)] == expected_info, (stage, rank)
            for got, want in zip(r[("weights", stage)], ref):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"stage {stage} rank {rank}")
    # stage 0/1: the backward reduced nothing; p.grad is the rank's own gradient (ranks differ)
    for stage in (0, 1):
        assert res[0][("launches_in_backward", stage)] == 0
        assert res[0][("launches_in_step", stage)] > 0
        for rank in (0, 1):
            for got, want in zip(res[rank][("local", stage)], res[rank]["local_ref"]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(res[0][("local", stage)][0], res[1][("local", stage)][0])
        # ... and the step used their average: the same as the one-window reference
        one = _reference(_batches(sum(n for n, _ in WINDOWS) + 1)[-1:], [(1, "engine")])
        for got, want in zip(res[0][("one_step", stage)], one):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for dtype in ("fp32", "bf16"):
        tol = dict(rtol=1e-5, atol=1e-7) if dtype == "fp32" else dict(rtol=2e-2, atol=2e-3)
        for rank in (0, 1):
            for (full, grad), want in zip(res[rank][("z2_local", dtype)], res[rank]["local_ref"]):
                assert torch.equal(full, grad)
                torch.testing.assert_close(full.float(), want, **tol)
        # after the block: the average of both ranks' gradients, the same on both
        for a, b, l0, l1 in zip(res[0][("z2_reduced", dtype)], res[1][("z2_reduced", dtype)],
                                res[0]["local_ref"], res[1]["local_ref"]):
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(a.float(), (l0 + l1) / 2, **tol)
    refusals = res[0]["refusals"]
    for stage in (0, 2):
        assert "set_gradient_accumulation_boundary" in refusals[("boundary", stage)]
        assert "managed_gradient_accumulation=False" in refusals[("boundary", stage)]
        assert "coalesce_grad_reduction" in refusals[("coalesce", stage)]
        assert "no_sync" in refusals[("step_in_no_sync", stage)]
    assert "not supported with pipeline parallelism" in refusals["pipeline"]


def test_unmanaged_overlap_comm_refused_at_stage_0_and_1():
    from deepspeed.config import DeepSpeedConfig
    for stage in (0, 1):
        with pytest.raises(AssertionError, match="overlap_comm only with ZeRO stage 2") as err:
            DeepSpeedConfig(_config(stage, overlap_comm=True), world_size=1)
        assert "zero_optimization.overlap_comm" in str(err.value)
    for stage in (2, 3):   # reduced in every backward there: overlap is fine
        assert DeepSpeedConfig(_config(stage, overlap_comm=True), world_size=1).zero.overlap_comm
    # unset overlap_comm (DeepSpeed's default: off below stage 3) and the managed default are accepted
    assert DeepSpeedConfig(_config(0), world_size=1).managed_gradient_accumulation is False
    assert DeepSpeedConfig(_config(1, managed=True, overlap_comm=True), world_size=1).managed_gradient_accumulation
    assert DeepSpeedConfig({"train_batch_size": 1}, world_size=1).managed_gradient_accumulation is True
    from deepspeed.runtime.config import get_managed_gradient_accumulation
    from deepspeed.runtime.constants import MANAGED_GRADIENT_ACCUMULATION, MANAGED_GRADIENT_ACCUMULATION_DEFAULT
    assert (MANAGED_GRADIENT_ACCUMULATION, MANAGED_GRADIENT_ACCUMULATION_DEFAULT) == \
        ("managed_gradient_accumulation", True)
    assert get_managed_gradient_accumulation({"managed_gradient_accumulation": False}) is False


# ---------------------------------------------------------------------------------- slow variants
ADAM = {"type": "Adam", "params": {"lr": 1e-2}}


def _slow_body(rank, world_size):
    """Unmanaged N backwards + one step() == managed GAS = N, with Adam, at every stage and with
    ZeRO's variants (overlap_comm at stage 2, optimizer offload, 16-bit)."""
    out = {}
    batches = _batches(2 * GAS)
    cases = [(s, {}) for s in (0, 1, 2, 3)] + [
        (2, {"overlap_comm": True, "contiguous_gradients": True}),
        (1, {"offload_optimizer": {"device": "cpu"}}),
        (2, {"offload_optimizer": {"device": "cpu"}}),
        (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    ]
    for i, (stage, zero) in enumerate(cases):
        for managed in (True, False):
            e = _engine(_config(stage, managed=managed, optimizer=ADAM, **zero))
            for c in range(2):
                for m in range(GAS):
                    x, y = batches[c * GAS + m]
                    e.backward(e(_rows(x, rank), _rows(y, rank)))
                    if managed:
                        e.step()
                if not managed:
                    e.step()
            out[(i, managed)] = full_weights(e)
            out[(i, managed, "steps")] = (e.global_steps, e.global_samples)
            e.destroy()
    for dtype in ("bf16", "fp16"):
        for stage in (0, 2):
            for managed in (True, False):
                cfg = _config(stage, managed=managed)
                cfg[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
                e = _engine(cfg)
                for c in range(2):
                    for m in range(GAS):
                        x, y = batches[c * GAS + m]
                        half = torch.bfloat16 if dtype == "bf16" else torch.float16
                        e.backward(e(_rows(x, rank).to(half), _rows(y, rank).to(half)))
                        if managed:
                            e.step()
                    if not managed:
                        e.step()
                out[(dtype, stage, managed)] = full_weights(e)
                e.destroy()
    return out, len(cases)


@pytest.mark.slow
def test_unmanaged_matches_managed_all_variants():
    res = run_distributed(_slow_body, world_size=2, timeout=600)
    out, n_cases = res[0]
    for i in range(n_cases):
        assert out[(i, False, "steps")] == out[(i, True, "steps")] == (2, 2 * GAS * MICRO * 2)
        for got, want in zip(out[(i, False)], out[(i, True)]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"case {i}")
    ref = _reference(_batches(2 * GAS), [(GAS, "engine"), (GAS, "engine")])
    for dtype in ("bf16", "fp16"):
        for stage in (0, 2):
            tol = dict(rtol=2e-2, atol=2e-2)
            for got, want in zip(out[(dtype, stage, False)], out[(dtype, stage, True)]):
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{dtype} stage {stage}")
            for got, want in zip(out[(dtype, stage, False)], ref):
                torch.testing.assert_close(got, want, **tol, msg=f"{dtype} stage {stage} vs fp32 reference")
