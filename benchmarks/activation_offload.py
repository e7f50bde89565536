"""Device memory held between forward and backward, and step time, with and without activation offload.

Prints one JSON object. A stack of MLP blocks, each under ``torch.utils.checkpoint(use_reentrant=False)``
(Hugging Face's mode), run three ways in the same process on the same inputs:

* ``checkpoint``: checkpointing alone (each block's input stays on the device until its backward);
* ``offload_streams``: the same inside ``CheckpointHiddenStatesOffload`` (defaults: pinned host buffers,
  side-stream copies, ``keep_last_count=1``, ``max_fwd_stash_count=2``), every block input marked;
* ``offload_sync``: the same with ``use_streams=False`` (copies ordered on the compute stream).

Figures: ``held_after_forward_mib`` is ``memory_allocated()`` right after the forward minus before it
(what the step keeps on the device for backward: the checkpoint inputs, less what was offloaded);
``peak_mib`` is the peak over forward + backward above the memory before the step; ``step_ms`` the
median over alternating rounds (forward + backward). ``max_abs_grad_diff`` compares every
parameter gradient with the ``checkpoint`` run (offload moves values, it must not change them).
Needs a CUDA GPU; on a machine without one it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def step(blocks, x, offload=None):
    h = x
    for b in blocks:
        if offload is not None:
            offload.mark(h)
        h = checkpoint(b, h, use_reentrant=False)
    return h.float().square().mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs a CUDA GPU"}))
        return
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(args.d) for _ in range(args.layers)).cuda().to(dtype)
    x = torch.randn(args.tokens, args.d, device="cuda", dtype=dtype, requires_grad=True)
    modes = {
        "checkpoint": None,
        "offload_streams": CheckpointHiddenStatesOffload(),
        "offload_sync": CheckpointHiddenStatesOffload(use_streams=False),
    }
    times = {m: [] for m in modes}
    result = {m: {} for m in modes}
    grads = {}

    def run(mode, record):
        offload = modes[mode]
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        ctx = offload if offload is not None else torch.enable_grad()
        with ctx:
            loss = step(blocks, x, offload)
            if record:
                torch.cuda.synchronize()
                result[mode]["held_after_forward_mib"] = round((torch.cuda.memory_allocated() - before) / 2**20, 1)
            loss.backward()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if record:
            result[mode]["peak_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
            grads[mode] = [p.grad.float().clone() for p in blocks.parameters()]
            if offload is not None:
                result[mode]["offloaded_tensors"] = offload.stats.offloaded_tensors
                result[mode]["kept_last_tensors"] = offload.stats.kept_last_tensors
        return elapsed

    for mode in modes:  # warm-up and the memory figures
        run(mode, record=False)
        run(mode, record=True)
    for _ in range(args.rounds):
        for mode in modes:
            times[mode].append(run(mode, record=False))
    for mode in modes:
        result[mode]["step_ms"] = round(statistics.median(times[mode]) * 1e3, 2)
        result[mode]["max_abs_grad_diff"] = max(float((g - r).abs().max())
                                                for g, r in zip(grads[mode], grads["checkpoint"]))
    base = result["checkpoint"]
    for mode in ("offload_streams", "offload_sync"):
        result[mode]["step_time_ratio"] = round(result[mode]["step_ms"] / base["step_ms"], 3)
        result[mode]["held_ratio"] = round(result[mode]["held_after_forward_mib"] / base["held_after_forward_mib"], 3)
    print(json.dumps({"config": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "checkpoint_input_mib": round(args.tokens * args.d * x.element_size() / 2**20, 1),
                      "results": result}, indent=1))


if __name__ == "__main__":
    main()
