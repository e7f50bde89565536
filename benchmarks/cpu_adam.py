"""CPU Adam update time: ``deepspeed.ops.adam.DeepSpeedCPUAdam`` vs ``torch.optim.AdamW``
(foreach and fused) on the same parameters, in one run.

Prints one JSON object: configuration, per-optimizer median step time, parameters per
second and effective memory bandwidth (28 bytes per fp32 parameter: read p, g, m, v and
write p, m, v), and our speed-up over each reference. Optimizers are timed in
interleaved rounds (one step each per round) so machine noise hits all alike.

Layouts: ``flat`` is one tensor (a ZeRO-Offload partition); ``model`` is the same count
spread over the tensors of a GPT-style stack. ``--explore`` also times the alternatives
considered for our implementation (a ``torch.compile``d update, and our optimizer with
huge pages off) so the choice is visible in the numbers.

Usage: python benchmarks/cpu_adam.py [--numel 100000000] [--rounds 15] [--layout flat model] [--explore]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch

import deepspeed.ops.adam.cpu_adam as cpu_adam_module
from deepspeed.ops.adam import DeepSpeedCPUAdam

BYTES_PER_PARAM = 28
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def layout_shapes(kind: str, numel: int):
    if kind == "flat":
        return [(numel,)]
    d = 1024
    per_layer = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    layer_numel = sum(math.prod(s) for s in per_layer)
    shapes = []
    while sum(math.prod(s) for s in shapes) + layer_numel <= numel:
        shapes += per_layer
    rest = numel - sum(math.prod(s) for s in shapes)
    if rest:
        shapes.append((rest,))
    return shapes


def make_params(shapes):
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02)
        p.grad = torch.randn(s, generator=gen) * 1e-3
        params.append(p)
    return params


def real_deepspeed_cpu_adam():
    """The compiled DeepSpeed CPU Adam, if this environment had it (it cannot: the
    ``deepspeed`` import name is this project, and its op builders are not installed)."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder  # noqa: F401  (real DeepSpeed only)
        return None, "deepspeed.ops.op_builder.CPUAdamBuilder exists but is not this project's; not used"
    except ImportError:
        return None, ("not importable: the `deepspeed` package in this environment is this project (no compiled "
                      "DeepSpeed CPUAdamBuilder extension is installed)")


def compiled_adamw(params):
    """Candidate: a torch.compile'd single-pass AdamW over each tensor (Inductor C++/OpenMP)."""
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    step = [0]

    def update(p, g, m, v, lr, b1, b2, eps, wd, bc1, bc2_sqrt):
        p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.sub_(lr * m / (v.sqrt() / bc2_sqrt + eps) / bc1)

    fn = torch.compile(update, dynamic=True)  # one kernel for every tensor size

    def run():
        step[0] += 1
        b1, b2 = HP["betas"]
        # step-dependent scalars as 0-d tensors, so the compiled kernel is not re-specialised every step
        bc1 = torch.tensor(1 - b1 ** step[0], dtype=torch.float64)
        bc2_sqrt = torch.tensor((1 - b2 ** step[0]) ** 0.5, dtype=torch.float64)
        for p, (m, v) in zip(params, states):
            fn(p.data, p.grad, m, v, HP["lr"], b1, b2, HP["eps"], HP["weight_decay"], bc1, bc2_sqrt)

    return run


def candidates(params, explore: bool):
    opts = {
        "deepspeed_cpu_adam (ours)": DeepSpeedCPUAdam(params, **HP),
        "torch_adamw_foreach": torch.optim.AdamW(params, **HP, foreach=True),
        "torch_adamw_fused": torch.optim.AdamW(params, **HP, fused=True),
    }
    steps = {name: opt.step for name, opt in opts.items()}
    if explore:
        saved = cpu_adam_module._MIN_HUGE_BYTES
        cpu_adam_module._MIN_HUGE_BYTES = 1 << 62  # no huge pages for this instance's moments
        no_huge = DeepSpeedCPUAdam(params, **HP)
        no_huge.step()  # allocate its state now, while huge pages are off
        cpu_adam_module._MIN_HUGE_BYTES = saved
        steps["explore: ours without huge pages"] = no_huge.step
        steps["explore: torch.compile adamw"] = compiled_adamw(params)
    return steps


def time_layout(kind: str, numel: int, rounds: int, warmup: int, explore: bool) -> dict:
    shapes = layout_shapes(kind, numel)
    params = make_params(shapes)
    steps = candidates(params, explore)
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    n = sum(p.numel() for p in params)
    figures = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        figures[name] = {"median_s": round(med, 5), "min_s": round(min(ts), 5),
                         "params_per_s": round(n / med), "effective_GB_per_s": round(BYTES_PER_PARAM * n / med / 1e9, 1)}
    ours = figures["deepspeed_cpu_adam (ours)"]["median_s"]
    refs = ["torch_adamw_foreach", "torch_adamw_fused"]
    best_ref = min(refs, key=lambda r: figures[r]["median_s"])
    # Per-round ratios pair each of our steps with the reference step timed right after it,
    # so slow drifts in machine load (this host is shared) cancel out.
    paired = {r: round(statistics.median(t / o for t, o in zip(times[r], times["deepspeed_cpu_adam (ours)"])), 3)
              for r in refs}
    return {"layout": kind, "numel": n, "tensors": len(shapes), "figures": figures,
            "speedup_vs": {r: round(figures[r]["median_s"] / ours, 3) for r in refs},
            "speedup_vs_median_of_per_round_ratios": paired,
            "best_reference": best_ref,
            "ratio_ours_over_best_reference_time": round(ours / figures[best_ref]["median_s"], 3)}


def correctness_check() -> float:
    """Max |difference| between ours and torch AdamW after 3 steps on 1M parameters."""
    a, b = make_params([(1 << 20,)]), make_params([(1 << 20,)])
    ours, ref = DeepSpeedCPUAdam(a, **HP), torch.optim.AdamW(b, **HP)
    for _ in range(3):
        ours.step()
        ref.step()
    return float((a[0] - b[0]).detach().abs().max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layout", nargs="+", default=["flat", "model"], choices=["flat", "model"])
    ap.add_argument("--explore", action="store_true")
    args = ap.parse_args()
    _, real_status = real_deepspeed_cpu_adam()
    results = [time_layout(kind, args.numel, args.rounds, args.warmup, args.explore) for kind in args.layout]
    print(json.dumps({
        "benchmark": "cpu_adam",
        "config": {"numel": args.numel, "rounds": args.rounds, "warmup": args.warmup, "dtype": "float32",
                   "hyperparameters": {k: list(v) if isinstance(v, tuple) else v for k, v in HP.items()},
                   "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                   "cpu_capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
                   "bytes_per_param": BYTES_PER_PARAM},
        "results": results,
        "real_deepspeed_cpu_adam": real_status,
        "max_abs_diff_vs_torch_adamw_after_3_steps": correctness_check(),
    }, indent=1))


if __name__ == "__main__":
    main()
