"""Cost of ZeRO-3's parameter-access check (``ZeROOrderedDict``) on the normal path.

Every ``module.weight`` read goes through ``module._parameters.__getitem__``; under ZeRO-3 the
modules' ``_parameters`` are a dict subclass whose ``__getitem__`` gathers a parameter read
outside its own module's forward. This measures a ZeRO-3 training step (world size 1, a
small model of many modules, every read in-module: the normal path) with the subclass
installed vs. the plain dicts put back on the same engine, in alternating rounds of one
run. Prints one JSON object; the figure is the median of per-round medians, and the ratio
(check / plain) is what to compare (absolute times on shared machines are noisy).
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import BenchModel, median_time, n_params  # noqa: E402


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    d, layers, batch = 32, 8, 8
    rounds, steps, warmup = int(os.environ.get("ROUNDS", 9)), 10, 3
    torch.manual_seed(0)
    x, y = torch.randn(batch, d), torch.randn(batch, 16)

    import deepspeed
    try:
        from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
    except ImportError:   # before the check existed: the plain path only
        ZeROOrderedDict = None
    ZeroParamStatusCheck = ZeROOrderedDict
    model = BenchModel(d, layers)
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_batch_size": batch, "steps_per_print": 0, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    modules = list(engine.module.modules())
    installed = [m._parameters for m in modules]
    plain = [dict(p) for p in installed]

    def use(dicts):
        for m, p in zip(modules, dicts):
            m.__dict__["_parameters"] = p

    def step():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    res = {"plain": []}
    if ZeROOrderedDict is not None:
        res["check"] = []
    names = list(res)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            use(installed if name == "check" else plain)
            res[name].append(median_time(step, steps, warmup))
    use(installed)
    reads = {"n": 0}   # parameter reads per step (how often __getitem__ runs)
    if ZeROOrderedDict is not None:
        orig = ZeROOrderedDict.__getitem__

        def counting(self, key):
            reads["n"] += 1
            return orig(self, key)
        ZeROOrderedDict.__getitem__ = counting
        step()
        ZeROOrderedDict.__getitem__ = orig
    if ZeroParamStatusCheck is not None:
        out_reads = read_cost_ns(ZeROOrderedDict, engine)
    else:
        out_reads = {}
    out = {"benchmark": "zero3_param_access", "world_size": 1, "zero_stage": 3,
           "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
           "modules": len(modules), "batch": batch, "rounds": rounds, "steps_per_round": steps,
           "param_reads_per_step": reads["n"]}
    for name, ts in res.items():
        out[f"{name}_step_ms"] = round(statistics.median(ts) * 1e3, 3)
    if "check" in res:
        out["ratio_check_over_plain"] = round(statistics.median(res["check"]) / statistics.median(res["plain"]), 4)
    out.update(out_reads)
    engine.destroy()
    print(json.dumps(out))


def read_cost_ns(ZeROOrderedDict, engine) -> dict:
    """Nanoseconds per ``module.weight`` read (min over repeats of 100k reads, interleaved): a
    plain dict, and the ZeRO-3 dict outside a forward and inside one (the parameter available:
    the normal path)."""
    import timeit
    from deepspeed.runtime.zero import parameter_offload as po
    lin = engine.module.head
    zero_dict = lin._parameters
    plain = dict(zero_dict.items())
    n, reps = 100_000, 7
    best = {"plain": [], "zero_outside_forward": [], "zero_inside_forward": []}
    with deepspeed_gathered(lin):   # the weight available, as inside its module's forward
        for _ in range(reps):
            lin.__dict__["_parameters"] = plain
            best["plain"].append(timeit.timeit(lambda: lin.weight, number=n))
            lin.__dict__["_parameters"] = zero_dict
            best["zero_outside_forward"].append(timeit.timeit(lambda: lin.weight, number=n))
            po.FWD_MODULE_STACK.append((lin, engine.strategy.coordinator))
            best["zero_inside_forward"].append(timeit.timeit(lambda: lin.weight, number=n))
            po.FWD_MODULE_STACK.pop()
    return {f"read_ns_{k}": round(min(v) / n * 1e9, 1) for k, v in best.items()}


def deepspeed_gathered(module):
    import deepspeed
    return deepspeed.zero.GatheredParameters(list(module.parameters()))


if __name__ == "__main__":
    main()
