"""Mixed precision: the flat-buffer optimizer step against per-parameter torch AdamW on
the same parameters, and the measured model-state bytes per parameter, in one run.

Timed (median over steps after warm-up, one process, gradients already in place):
* ``flat_inner_adamw``: the config's ``AdamW`` (deepspeed FusedAdam) stepping our one
  flat fp32 master tensor per group;
* ``flat_full_step``: our whole 16-bit step as it runs on the host - the bf16 gradients
  cast chunk by chunk (256K elements) into a small fp32 staging buffer: once for the
  overflow check + norm (one reduction), once more for the flat AdamW update, which
  applies the unscale/clip factor inside the fused kernel; each updated chunk of masters
  is copied into the 16-bit parameters while still in cache;
* ``flat_full_step_whole_grad_copy``: the same step with one whole transient fp32 copy of
  the gradients, a separate multiply and a separate copy-back (the CUDA path);
* ``stage3_step_streamed`` / ``stage3_step_whole_grad_copy``: the optimizer step of ZeRO
  stage 3 (one process, bf16, same model) streamed, and with whole fp32 gradient copies
  for the norm and the update (timed alone, after a fresh backward each round);
* ``flat_full_step_grad_accum_fp32``: the same with ``data_types.grad_accum_dtype: fp32``
  (gradients kept in fp32, so no transient copy; 18 bytes per parameter);
* ``torch_adamw_per_param`` (foreach off, PyTorch's CPU default), ``..._foreach`` and
  ``..._fused``: torch AdamW over the same parameters as separate fp32 tensors;
* ``torch_per_param_mixed_full_step``: the whole 16-bit step done per parameter with
  torch primitives (per-tensor fp32 masters, grads cast one by one, ``clip_grad_norm_``,
  fused AdamW over the list, foreach copy back) - the reference for ``flat_full_step``.

Bytes per parameter sum the storages the strategy really holds (16-bit parameters,
gradient buffer, fp32 masters, Adam state; storage-deduplicated), beside the formula
2 + 2 + 4 + 8 = 16 (18 with ``grad_accum_dtype: fp32``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import BenchModel, median_time, n_params  # noqa: E402

D, LAYERS, MB = 512, 4, 8


def _engine(prec, accum=None):
    import deepspeed
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": MB, "steps_per_print": 0, "gradient_clipping": 1.0,
           prec: {"enabled": True}}
    if prec == "fp16":
        cfg["fp16"]["initial_scale_power"] = 8
    if accum:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}   # -> deepspeed's FusedAdam
    engine, *_ = deepspeed.initialize(model=BenchModel(D, LAYERS), config=cfg)
    dt = torch.float16 if prec == "fp16" else torch.bfloat16
    x, y = torch.randn(MB, D, dtype=dt), torch.randn(MB, 16, dtype=dt)
    engine.backward(engine(x, y))
    engine.step()                                # creates the Adam state
    engine.backward(engine(x, y))                # leaves reduced gradients in the flat buffer
    return engine


def _stage3_step_ms(rounds: int) -> dict:
    """ZeRO stage 3 (one process, bf16, config AdamW): the optimizer step alone, streamed
    vs with whole fp32 gradient copies, timed in alternating rounds after a fresh backward."""
    import time
    import deepspeed

    def make(streamed):
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": MB, "steps_per_print": 0, "gradient_clipping": 1.0,
               "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
               "zero_optimization": {"stage": 3}}
        eng, *_ = deepspeed.initialize(model=BenchModel(D, LAYERS), config=cfg)
        if not streamed:
            eng.strategy.parts.streamed = False
        return eng
    engines = {"stage3_step_streamed": make(True), "stage3_step_whole_grad_copy": make(False)}
    x, y = torch.randn(MB, D, dtype=torch.bfloat16), torch.randn(MB, 16, dtype=torch.bfloat16)
    times = {k: [] for k in engines}
    for r in range(rounds + 2):
        for k, eng in engines.items():
            eng.backward(eng(x, y))
            t0 = time.perf_counter()
            eng.step()
            if r >= 2:  # two warm-up rounds
                times[k].append(time.perf_counter() - t0)
    assert engines["stage3_step_streamed"].strategy.parts.streamed
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def state_bytes_per_param(engine) -> float:
    opt = engine.optimizer
    tensors = list(engine.module.parameters()) + opt.grad_bufs + opt.part_grads + \
        [m for m in opt.masters if m is not None] + \
        [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    tensors += [p.grad for p in engine.module.parameters() if p.grad is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) / sum(p.numel() for p in engine.module.parameters())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    engine = _engine("bf16")
    opt = engine.optimizer

    opt._attach_master_grads()
    inner_only = opt.inner.step

    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in engine.module.parameters()]
    for p in ref_params:
        p.grad = torch.randn_like(p) * 1e-3
    variants = {"flat_inner_adamw": inner_only}
    for name, kw in (("torch_adamw_per_param", {"foreach": False}),
                     ("torch_adamw_per_param_foreach", {"foreach": True}),
                     ("torch_adamw_per_param_fused", {"fused": True})):
        o = torch.optim.AdamW(ref_params, lr=1e-4, **kw)
        o.step()
        variants[name] = o.step

    # the same 16-bit step done per parameter with torch primitives: per-tensor fp32 masters,
    # grads cast one by one, clip_grad_norm_ (foreach), fused AdamW over the list, foreach copy back
    params16 = [p.detach().clone() for p in engine.module.parameters()]
    grads16 = [torch.randn_like(p) * 1e-3 for p in params16]
    masters = [torch.nn.Parameter(p.float()) for p in params16]
    mp_opt = torch.optim.AdamW(masters, lr=1e-4, fused=True)

    def per_param_mixed_step():
        for m, g in zip(masters, grads16):
            m.grad = g.float()
        torch.nn.utils.clip_grad_norm_(masters, 1.0, foreach=True)
        mp_opt.step()
        torch._foreach_copy_(params16, masters)
        for m in masters:
            m.grad = None
    variants["torch_per_param_mixed_full_step"] = per_param_mixed_step

    def flat_full_step():
        opt._detach_master_grads()
        opt.step()
    variants["flat_full_step"] = flat_full_step
    # the same step with the whole fp32 gradient copy (the path CUDA takes) instead of the
    # chunked staging buffer, on a second engine with the same model
    engine_whole = _engine("bf16")
    opt_whole = engine_whole.optimizer
    opt_whole._streamed = False

    def flat_full_step_whole_buffer():
        opt_whole._detach_master_grads()
        opt_whole.step()
    variants["flat_full_step_whole_grad_copy"] = flat_full_step_whole_buffer
    # with data_types.grad_accum_dtype fp32 the reduced gradients already are fp32: the
    # step needs no transient fp32 copy (2 more bytes per parameter held: 18)
    engine32 = _engine("bf16", "fp32")
    opt32 = engine32.optimizer

    def flat_full_step_fp32_accum():
        opt32._detach_master_grads()
        opt32.step()
    variants["flat_full_step_grad_accum_fp32"] = flat_full_step_fp32_accum

    # rounds alternate the variants so machine noise hits all alike; median of round medians
    times = {k: [] for k in variants}
    for _ in range(args.rounds):
        for k, fn in variants.items():
            if k == "flat_inner_adamw":
                opt._attach_master_grads()
            times[k].append(median_time(fn, args.steps, args.warmup))
    t = {k: statistics.median(v) for k, v in times.items()}
    s3 = _stage3_step_ms(max(8, args.rounds * 2))

    bpp = {"fp16": state_bytes_per_param(_engine("fp16")), "bf16": state_bytes_per_param(engine),
           "bf16_grad_accum_fp32": state_bytes_per_param(engine32)}
    best_ref = min(t[k] for k in ("torch_adamw_per_param", "torch_adamw_per_param_foreach",
                                  "torch_adamw_per_param_fused"))
    out = {"benchmark": "mixed_precision",
           "config": {"model": f"{LAYERS}-block MLP d={D}", "params": n_params(engine.module),
                      "param_tensors": len(ref_params), "optimizer": type(opt.inner).__name__ + " (config AdamW)",
                      "threads": args.threads, "steps": args.steps, "rounds": args.rounds, "device": "cpu",
                      "precision": "bf16"},
           "step_ms": {**{k: round(v * 1e3, 3) for k, v in t.items()}, **{k: round(v, 3) for k, v in s3.items()}},
           "ratios": {"flat_inner_adamw_vs_best_torch_per_param": round(t["flat_inner_adamw"] / best_ref, 3),
                      "flat_full_step_vs_torch_per_param_mixed_full_step":
                          round(t["flat_full_step"] / t["torch_per_param_mixed_full_step"], 3),
                      "flat_full_step_vs_whole_grad_copy":
                          round(t["flat_full_step"] / t["flat_full_step_whole_grad_copy"], 3),
                      "stage3_step_streamed_vs_whole_grad_copy":
                          round(s3["stage3_step_streamed"] / s3["stage3_step_whole_grad_copy"], 3)},
           "bytes_per_param": {k: round(v, 4) for k, v in bpp.items()},
           "bytes_per_param_formula": {"fp16": 16, "bf16": 16, "bf16_grad_accum_fp32": 18}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
