"""Training step time of a GPT-ish model on one GPU: plain PyTorch vs the engine at ZeRO 0-3.

Prints one JSON object (the last line of stdout; ``--out`` also writes it to a file).

* Model: pre-LN GPT (token + position embeddings, ``layers`` blocks of causal SDPA attention
  and a 4x GELU MLP, LM head tied to the embedding). ``--size full`` (default): d=1024,
  8 layers, 16 heads, seq 512, batch 8, vocab 8192 (~109M parameters). ``--size tiny``: a
  toy size that runs on a CPU in seconds (to check the script, not to measure); it is the
  default when no GPU is visible.
* Reference ("plain"): PyTorch's standard mixed precision - fp32 parameters, forward and
  backward under ``torch.autocast(dtype=bfloat16)``, ``torch.optim.AdamW(fused=True)`` on fp32
  parameters/gradients, ``clip_grad_norm_(1.0)``.
* Engine ("zero0".."zero3"): ``bf16.enabled`` (bf16 parameters and gradients, fp32 master
  weights), the config's ``AdamW`` (FusedAdam), ``gradient_clipping: 1.0``, one process.
* Per mode: ``--warmup`` untimed steps, then ``--steps`` steps each timed between
  ``torch.cuda.synchronize()`` calls; median and IQR in ms, ratio of medians to plain, peak
  ``torch.cuda.max_memory_allocated`` (reset before the model is built, so it counts weights,
  optimizer state, gradients and activations), and first/last loss as a sanity check.
* A mode that fails records its error and the others still run; a time budget (``--budget``
  seconds) skips modes that would not fit.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    "full": dict(d=1024, layers=8, heads=16, seq=512, batch=8, vocab=8192),
    "tiny": dict(d=64, layers=2, heads=4, seq=32, batch=2, vocab=256),
}


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d, layers, heads, seq, vocab, **_):
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for n, p in self.named_parameters():
            if p.dim() >= 2 and n != "pos":
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, self.vocab), targets.reshape(-1))


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _mem(dev, what):
    if dev.type != "cuda":
        return None
    return {"peak": torch.cuda.max_memory_allocated, "now": torch.cuda.memory_allocated}[what]()


def _time_steps(step, dev, warmup, steps):
    losses = []
    for _ in range(warmup):
        losses.append(step())
    _sync(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return times, losses


def _summary(times, losses, dev, n_params):
    ms = [t * 1e3 for t in times]
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    peak = _mem(dev, "peak")
    return {"median_ms": round(statistics.median(ms), 3), "iqr_ms": round(q[2] - q[0], 3),
            "min_ms": round(min(ms), 3), "steps_timed": len(ms),
            "peak_mem_gib": None if peak is None else round(peak / 2 ** 30, 3),
            "end_mem_gib": None if peak is None else round(_mem(dev, "now") / 2 ** 30, 3),
            "loss_first": losses[0], "loss_last": losses[-1],
            "losses_finite": all(math.isfinite(v) for v in losses), "params": n_params}


def run_plain(cfg, dev, data, warmup, steps):
    torch.manual_seed(0)
    model = GPT(**cfg).to(dev)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=dev.type == "cuda")
    x, y = data

    def step():
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    times, losses = _time_steps(step, dev, warmup, steps)
    out = _summary(times, losses, dev, n)
    del model, opt
    return out


def run_engine(stage, cfg, dev, data, warmup, steps):
    import deepspeed
    torch.manual_seed(0)
    model = GPT(**cfg)
    n = sum(p.numel() for p in model.parameters())
    ds_cfg = {"train_micro_batch_size_per_gpu": cfg["batch"], "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "steps_per_print": 0, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    x, y = data

    def step():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    times, losses = _time_steps(step, dev, warmup, steps)
    out = _summary(times, losses, dev, n)
    out["optimizer"] = type(getattr(engine.optimizer, "inner", engine.optimizer)).__name__
    out["strategy"] = type(engine.strategy).__name__
    out["skipped_steps"] = engine.skipped_steps
    engine.destroy()
    del engine, model
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default=None,
                    help="default: full on a GPU, tiny on a CPU (so `make bench` stays quick)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 20; tiny: 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per mode (default 5; tiny: 2)")
    ap.add_argument("--modes", default="plain,zero0,zero1,zero2,zero3")
    ap.add_argument("--budget", type=float, default=85.0, help="seconds; later modes are skipped past it")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    if a.size is None:
        a.size = "full" if torch.cuda.is_available() else "tiny"
    tiny = a.size == "tiny"
    steps = a.steps if a.steps is not None else (5 if tiny else 20)
    warmup = a.warmup if a.warmup is not None else (2 if tiny else 5)
    cfg = SIZES[a.size]
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True   # both sides alike; bf16 matmuls dominate
        torch.backends.cudnn.allow_tf32 = True
    import deepspeed
    deepspeed.init_distributed(verbose=False)     # a world of one (NCCL on CUDA, gloo on CPU)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    data = (idx[:, :-1].contiguous().to(dev), idx[:, 1:].contiguous().to(dev))

    result = {
        "benchmark": "gpu_step",
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "deepspeed_file": deepspeed.__file__,
        "size": a.size, "model": cfg, "tokens_per_step": cfg["batch"] * cfg["seq"],
        "warmup": warmup, "steps": steps,
        "plain": "fp32 params + torch.autocast(bfloat16) + torch.optim.AdamW(fused=True on cuda) + clip 1.0",
        "engine": "bf16.enabled (bf16 params/grads, fp32 masters) + config AdamW (FusedAdam) + clip 1.0",
        "modes": {}, "errors": {}, "skipped": [],
    }
    per_mode = []
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        elapsed = time.perf_counter() - t_start
        est = max(per_mode) if per_mode else 0.0
        if elapsed + est > a.budget:
            result["skipped"].append(mode)
            continue
        t0 = time.perf_counter()
        start_mem = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            start_mem = round(torch.cuda.memory_allocated() / 2 ** 30, 3)   # > ~0: an earlier mode leaked
        try:
            if mode == "plain":
                result["modes"][mode] = run_plain(cfg, dev, data, warmup, steps)
            elif mode.startswith("zero") and mode[4:].isdigit():
                result["modes"][mode] = run_engine(int(mode[4:]), cfg, dev, data, warmup, steps)
            else:
                raise ValueError(f"unknown mode {mode!r}")
        except Exception as err:  # noqa: BLE001 - record it, measure the rest
            result["errors"][mode] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"
        gc.collect()
        per_mode.append(time.perf_counter() - t0)
        if mode in result["modes"]:
            result["modes"][mode].update(mode_wall_s=round(per_mode[-1], 2), start_mem_gib=start_mem)
        print(f"[gpu_step] {mode}: {json.dumps(result['modes'].get(mode) or result['errors'].get(mode))}",
              file=sys.stderr, flush=True)
    base = result["modes"].get("plain", {}).get("median_ms")
    result["ratio_vs_plain"] = {m: round(r["median_ms"] / base, 3) for m, r in result["modes"].items()
                                if base and m != "plain" and "median_ms" in r}
    result["wall_s"] = round(time.perf_counter() - t_start, 2)
    text = json.dumps(result)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
