"""User-driven backward (DeepSpeed 0.19): ``loss = engine(x); loss.backward(); engine.step()``,
``engine.scale(loss).backward()``, several engines under one loss (``_backward_epilogue``) and
``engine.coalesce_grad_reduction()``, against plain PyTorch trained on the same global batches.

One spawned world of two ranks runs every distributed check (tests/helpers/dist.py)."""
import weakref

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import full_weights, row_batches

GAS = 2
LR = 0.1


class _Net(torch.nn.Module):
    """Returns (loss, prediction): the loss is computed from the prediction, so the output hooks
    must not divide the prediction's gradient a second time."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x, y):
        pred = self.fc2(torch.tanh(self.fc1(x)))
        return torch.nn.functional.mse_loss(pred.float(), y.float()), pred


def _model(seed=0):
    torch.manual_seed(seed)
    return _Net()


_batches = row_batches   # n global micro-batches of 4 rows: rank r trains on rows [2r, 2r + 2)


class _Box:
    def __init__(self, t):
        self.t = t


def _engine(stage, gas=GAS, fp16=False, seed=0, extra=None):
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 0,
           "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40}, **(extra or {})}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    model = _model(seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine




def _reference(batches, gas, seed=0, scale=1.0):
    """Plain PyTorch: each optimizer step averages the global micro-batches' gradients (every
    rank's two rows are one rank's micro-batch: the global mean over ranks of loss / gas)."""
    model = _model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i, (x, y) in enumerate(batches):
        loss = sum(model(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])[0] for r in range(2)) / 2
        (loss * scale / gas).backward()
        if (i + 1) % gas == 0:
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _train(engine, batches, rank, how):
    for x, y in batches:
        loss, pred = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        if how == "pred":   # a loss of the user's own, from the prediction only
            ((pred - y[2 * rank:2 * rank + 2]) ** 2).mean().backward()
        elif how == "engine":
            engine.backward(loss)
        elif how == "scale":
            engine.scale(loss).backward()
        else:
            loss.backward()
        engine.step()
    return full_weights(engine)


def _body(rank, world_size):
    out = {}
    batches = _batches(4)
    # 1. loss.backward() + engine.step() at every stage, gas 2 (two optimizer steps); the model's
    #    loss output, or a loss of the user's own from its prediction output
    for stage in (0, 1, 2, 3):
        for how in ("engine", "torch", "pred"):
            e = _engine(stage)
            out[(stage, how)] = _train(e, batches, rank, how)
            e.destroy()
    # 2. fp16: a direct backward is refused; engine.scale(loss).backward() == engine.backward(loss)
    e = _engine(1, fp16=True)
    out["needs_scaler"] = (e.optimizer.needs_scaler(), _engine(2).optimizer.needs_scaler())
    x, y = batches[0]
    loss, _ = e(x[2 * rank:2 * rank + 2].half(), y[2 * rank:2 * rank + 2].half())
    try:
        loss.backward()
        out["fp16_error"] = None
    except RuntimeError as err:
        out["fp16_error"] = str(err)
    out["fp16_grads_after_refusal"] = [p.grad for p in e.module.parameters() if p.grad is not None
                                       and p.grad.abs().sum() > 0]
    e.destroy()
    half = [(x.half(), y.half()) for x, y in batches]
    for stage in (1, 2):
        for how in ("engine", "scale"):
            e = _engine(stage, fp16=True)
            out[("fp16", stage, how)] = _train(e, half, rank, how)
            out[("fp16_scale", stage, how)] = e.loss_scale
            e.destroy()
    # 3. two engines, one loss: through the engines' outputs (the pass finishes by itself) and
    #    through engine.module with an explicit _backward_epilogue() (DeepSpeed's test pattern)
    for route in ("outputs", "module"):
        engines = [_engine(1, gas=1, seed=0), _engine(2, gas=1, seed=5)]
        for x, y in batches[:2]:
            xs, ys = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]
            fwd = [(e if route == "outputs" else e.module)(xs, ys)[0] for e in engines]
            (fwd[0] + 0.5 * fwd[1]).backward()
            if route == "module":
                for e in engines:
                    e._backward_epilogue()
            for e in engines:
                e.step()
        out[("shared", route)] = [full_weights(e) for e in engines]
        for e in engines:
            e.destroy()
    # 4. coalesce_grad_reduction: three backward passes, one reduction, same weights
    for stage in (2, 3):
        for coalesce in (False, True):
            e = _engine(stage, gas=1)
            counter = (lambda: sum(e.optimizer.launch_counts.values())) if stage == 2 else \
                (lambda: e.optimizer.reducer.launches)
            start = counter()
            import contextlib
            ctx = e.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
            with ctx:
                for i, (x, y) in enumerate(batches[:3]):
                    loss, _ = e(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
                    e.set_gradient_accumulation_boundary(i == 2)
                    e.backward(loss)
                    if coalesce:
                        out[("inside", stage, i)] = counter() - start
            out[("launches", stage, coalesce)] = counter() - start
            e.step()
            out[("coalesce", stage, coalesce)] = full_weights(e)
            e.destroy()
    # 5. outputs dropped without a backward free their graph (saved activations included): the
    #    hooks hold nothing that keeps it alive. Reference: the same forward through engine.module.
    e = _engine(0, gas=1)
    x, y = batches[0]
    for route in ("engine", "module"):
        boxes = []

        def pack(t, boxes=boxes):
            box = _Box(t)
            boxes.append(weakref.ref(box))
            return box

        for _ in range(3):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
                res = (e if route == "engine" else e.module)(x[:2], y[:2])
            del res
        out[("alive_saved", route)] = sum(r() is not None for r in boxes)
    e.destroy()
    # refusals
    refusals = {}
    e = _engine(0, gas=1)
    try:
        with e.coalesce_grad_reduction():
            pass
    except NotImplementedError as err:
        refusals["stage0"] = str(err)
    e.destroy()
    e = _engine(2, gas=1)
    for name, inner in (("step", lambda: e.step()), ("no_sync", lambda: e.no_sync().__enter__())):
        try:
            with e.coalesce_grad_reduction():
                inner()
        except AssertionError as err:
            refusals[name] = str(err)
    try:
        with e.no_sync():
            with e.coalesce_grad_reduction():
                pass
    except AssertionError as err:
        refusals["nested"] = str(err)
    e.destroy()
    out["refusals"] = refusals
    return out


def _close(a, b, tol=1e-6):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def test_user_driven_backward_matches_engine_backward_and_pytorch():
    res = run_distributed(_body, 2, timeout=240)
    batches = _batches(4)
    ref = _reference(batches, GAS)
    for r in res:
        # 1. every stage: loss.backward() == engine.backward(loss) == plain PyTorch
        for stage in (0, 1, 2, 3):
            _close(r[(stage, "torch")], r[(stage, "engine")])
            _close(r[(stage, "torch")], ref, tol=1e-5)
            _close(r[(stage, "pred")], ref, tol=1e-5)
        # 2. fp16
        assert r["fp16_error"] is not None and "Loss scaling is required" in r["fp16_error"] \
            and "engine.scale(loss).backward()" in r["fp16_error"], r["fp16_error"]
        assert r["fp16_grads_after_refusal"] == []
        assert r["needs_scaler"] == (True, False)
        for stage in (1, 2):
            _close(r[("fp16", stage, "scale")], r[("fp16", stage, "engine")], tol=0)
            assert r[("fp16_scale", stage, "scale")] == r[("fp16_scale", stage, "engine")] == 256.0
            _close(r[("fp16", stage, "scale")], ref, tol=5e-3)
        # 3. shared loss: model A gets the loss's gradient, model B half of it
        ref_a = _reference(batches[:2], 1, seed=0)
        ref_b = _reference(batches[:2], 1, seed=5, scale=0.5)
        for route in ("outputs", "module"):
            a, b = r[("shared", route)]
            _close(a, ref_a, tol=1e-5)
            _close(b, ref_b, tol=1e-5)
        # 4. coalesce: one reduction's launches instead of three, the same weights as reducing
        #    every backward, and as plain PyTorch on the summed micro-batches
        ref_sum = _summed_reference(batches[:3])
        for stage in (2, 3):
            plain, coal = r[("launches", stage, False)], r[("launches", stage, True)]
            assert all(r[("inside", stage, i)] == 0 for i in range(3)), "reduced inside the block"
            assert plain > 0 and coal * 3 == plain, (stage, plain, coal)
            _close(r[("coalesce", stage, True)], r[("coalesce", stage, False)], tol=1e-6)
            _close(r[("coalesce", stage, True)], ref_sum, tol=1e-5)
        assert r[("alive_saved", "engine")] == r[("alive_saved", "module")], \
            (r[("alive_saved", "engine")], r[("alive_saved", "module")])
        ref_msgs = r["refusals"]
        assert "ZeRO stage 1/2/3" in ref_msgs["stage0"] and "zero_optimization.stage" in ref_msgs["stage0"]
        assert "no_sync" in ref_msgs["step"] and "engine.step()" in ref_msgs["step"]
        assert "no_sync" in ref_msgs["no_sync"]
        assert "nested" in ref_msgs["nested"]


def _summed_reference(batches):
    """One SGD step on the sum of the micro-batches' (rank-averaged) gradients."""
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches:
        (sum(model(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])[0] for r in range(2)) / 2).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_count_used_parameters_in_backward():
    from deepspeed.runtime.utils import count_used_parameters_in_backward
    a, b, c = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    c.requires_grad_(False)
    seen = []
    y = (a * 2).sum() + (b * 3).sum() + (c * 4).sum()
    y.register_hook(lambda g: seen.append(count_used_parameters_in_backward([a, b, c, a])))
    y.backward()
    z = (a * 2).sum() + (b * 3).sum()
    z.register_hook(lambda g: seen.append(count_used_parameters_in_backward([a, b])))
    z.backward(inputs=[a])          # only a is reached
    assert seen == [2, 1]
    with pytest.raises(RuntimeError, match="during backward"):
        count_used_parameters_in_backward([a])
