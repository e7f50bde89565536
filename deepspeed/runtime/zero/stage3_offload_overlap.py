"""``offload_optimizer.super_offload``: ZeRO-3 CPU-offload sub-groups stepped while backward runs.

Without it the CPU optimizer runs after backward, sub-group after sub-group, while
the accelerator (or, on a CPU, the other work of the step) waits. With it, each
sub-group (a :class:`~.stage3_master.Chunk` of at most ``sub_group_size`` elements) is
handed to one worker thread as soon as its last gradient partition has arrived in
host memory (the gradient reduce-scatter sinks run in backward's gradient hooks), and
that thread computes the sub-group's gradient norm and steps it while backward goes on
with the earlier layers (PyTorch kernels release the GIL).

The step is *speculative*, as DeepSpeed's SuperOffload's: it is taken with coefficient
1 before the global gradient norm is known. At ``engine.step()``:

* no clipping needed (or ``gradient_clipping`` 0) and finite: the speculative updates
  stand - bit-identical to the step taken at the end (Adam is elementwise; the norm is
  the same per-sub-group norms summed in the same order); the sub-groups not stepped
  yet (a parameter without a gradient, a sub-group still arriving) are stepped then;
* clipping triggers: each speculative update is rolled back (the Adam formula solved
  back from the same gradient, :func:`deepspeed.ops.adam.cpu_adam.adam_rollback_`,
  exact up to rounding) and the sub-group is stepped again with the coefficient;
* a non-finite gradient anywhere: the step is skipped as before and the speculative
  updates are rolled back (a sub-group whose own gradient is non-finite is never
  stepped speculatively).

A gradient that arrives for a sub-group already stepped (more backward passes than
``gradient_accumulation_steps`` before a step) rolls it back first, and reading the
masters or gradients through the partition API (``grad_view``, ``master_view``,
checkpoint reads) between backward and step rolls back too, so what they see is the
state before the step. Only DeepSpeed's fused/CPU Adam is stepped speculatively (the
rollback is Adam's formula); fp16 (loss scaling) and NVMe-swapped masters keep the step
at the end.

Timeline: :attr:`OverlapStepper.last_timeline` holds the worker's ranges of the last
step (``offload.optimizer_subgroup``; ``time.perf_counter`` seconds) and the main
thread marks each hand-over with an ``offload.submit`` range, so the ranges can be
placed into the engine's step trace (:func:`merge_into_trace`).
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ...utils.logging import logger

SUBGROUP_RANGE = "offload.optimizer_subgroup"
SUBMIT_RANGE = "offload.submit"


def plan_overlap(parts):
    """An :class:`OverlapStepper` for ``parts`` when its owner's config asks for
    ``offload_optimizer.super_offload`` and the step can be taken early; else None."""
    from ...ops.adam.fused_adam import FusedAdam
    owner = None
    for c in parts.chunks:
        owner = getattr(c.params[0], "_ds_state_owner", None) if c.params else None
        if owner is not None:
            break
    cfg = getattr(getattr(owner, "ctx", None), "config", None)
    if cfg is None:
        return None
    off = getattr(cfg.zero, "offload_optimizer", None)
    if off is None or not getattr(off, "super_offload", False):
        return None
    why = None
    if parts.opt_device.type != "cpu":
        why = "the optimizer is not offloaded to the CPU"
    elif parts.nvme is not None or parts._nvme_holders:
        why = "offload_optimizer.device 'nvme' swaps the masters (its own pipeline overlaps them)"
    elif type(parts).__name__ != "MasterPartitions":
        why = "offload_param.device 'nvme' swaps the partitions the step writes"
    elif getattr(owner, "fp16", False):
        why = "fp16 loss scaling needs the overflow check first"
    elif not isinstance(getattr(owner, "inner", None), FusedAdam):
        why = "only DeepSpeed's Adam/AdamW (FusedAdam, DeepSpeedCPUAdam) can be rolled back"
    if why is not None:
        logger.warning(f"zero_optimization.offload_optimizer.super_offload: the step stays after backward: {why}.")
        return None
    return OverlapStepper(parts, owner.inner, getattr(cfg, "gradient_accumulation_steps", 1) or 1)


class OverlapStepper:
    """One worker thread; sub-groups handed to it as their gradients complete."""

    def __init__(self, parts, optimizer, gas: int):
        self.parts = parts
        self.opt = optimizer
        self.gas = max(1, int(gas))
        # the worker uses as many intra-op threads as the training thread (a fresh thread would
        # otherwise start from OpenMP's default: every core, on top of the training thread's)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds-offload-step",
                                       initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        self.arrived = [0] * len(parts.chunks)
        self.pending = {}            # chunk index -> Future
        self.stepped = set()         # chunk indices updated speculatively, not yet confirmed by step()
        self.norms = {}              # chunk index -> the chunk's gradient norm(s), computed by the worker
        self.timeline, self.last_timeline = [], []
        self.counts = {"speculative": 0, "rolled_back": 0, "at_step": 0}
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self._tid = None

    # -- main thread, during backward ----------------------------------------------------------
    def before_add(self, ci: int) -> None:
        """A gradient is about to be added into chunk ``ci``: if that chunk was handed over
        already, wait and undo its speculative step (it is taken again at the step)."""
        if ci in self.pending or ci in self.stepped:
            self.drain()
            if ci in self.stepped:
                self._rollback(ci)

    def added(self, ci: int, n: int) -> None:
        self.arrived[ci] += n
        if self.arrived[ci] == self.gas * self.parts.chunks[ci].numel and ci not in self.stepped:
            with torch.profiler.record_function(SUBMIT_RANGE):
                self.timeline.append((SUBMIT_RANGE, threading.get_native_id(), time.perf_counter(), None, ci))
                self.pending[ci] = self.pool.submit(self._job, ci)

    # -- worker thread -------------------------------------------------------------------------
    def _job(self, ci: int) -> None:
        t0 = time.perf_counter()
        self._tid = threading.get_native_id()
        c = self.parts.chunks[ci]
        norms = self.parts._chunk_norms(c)
        self.norms[ci] = norms
        finite = all(bool(torch.isfinite(n)) for n in norms)
        if finite:
            self.parts._step_wave(self.opt, [c], 1.0)
            self.stepped.add(ci)
            self.counts["speculative"] += 1
        self.timeline.append((SUBGROUP_RANGE, self._tid, t0, time.perf_counter(), ci))

    # -- main thread, at the step ------------------------------------------------------------
    def drain(self) -> None:
        pending, self.pending = self.pending, {}
        for f in pending.values():
            f.result()

    def rollback_all(self) -> None:
        self.drain()
        for ci in sorted(self.stepped):
            self._rollback(ci)

    def _rollback(self, ci: int) -> None:
        from ...ops.adam.cpu_adam import adam_rollback_
        c = self.parts.chunks[ci]
        st = self.opt.state[c.master]
        g = self._group_of[id(c.master)]
        b1, b2 = g["betas"]
        adam_rollback_(c.master, c.grad.to(torch.float32), st["exp_avg"], st["exp_avg_sq"], int(float(st["step"])),
                       lr=float(g["lr"]), beta1=float(b1), beta2=float(b2), eps=float(g["eps"]),
                       weight_decay=float(g["weight_decay"]), bias_correction=g["bias_correction"],
                       adam_w_mode=self.opt.adam_w_mode)
        st["step"].sub_(1.0)
        self.parts._master_to_lp(c)
        self.stepped.discard(ci)
        self.counts["rolled_back"] += 1

    def step(self, optimizer, coef: float) -> None:
        """The step: keep the speculative updates (coef 1) or redo them, then step the rest."""
        self.drain()
        if coef != 1.0:
            self.rollback_all()
        rest = [c for i, c in enumerate(self.parts.chunks) if i not in self.stepped]
        for c in rest:
            with torch.profiler.record_function(SUBGROUP_RANGE):
                t0 = time.perf_counter()
                self.parts._step_wave(optimizer, [c], coef)
                self.timeline.append((SUBGROUP_RANGE, threading.get_native_id(), t0, time.perf_counter(), -1))
        self.counts["at_step"] += len(rest)
        self.stepped.clear()      # confirmed

    def reset(self) -> None:
        """After the step (or a skipped one): undo unconfirmed updates, start counting anew."""
        self.rollback_all()
        self.arrived = [0] * len(self.parts.chunks)
        self.norms = {}
        if self.timeline:    # (a second zero_grads after the step keeps the step's timeline)
            self.last_timeline, self.timeline = self.timeline, []

    def close(self) -> None:
        self.drain()
        self.pool.shutdown(wait=True)


def merge_into_trace(trace_file: str, timeline, out_file: str = None) -> int:
    """Write the worker's ranges of ``timeline`` (:attr:`OverlapStepper.last_timeline`) into a
    Chrome trace of the same step, on their own thread row. The clocks are matched on the
    ``offload.submit`` ranges the main thread left in the trace (median offset). Returns
    the number of ranges added (0 when there was nothing to match)."""
    with open(trace_file) as f:
        trace = json.load(f)
    events = trace.get("traceEvents", [])
    marks = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("name") == SUBMIT_RANGE)
    subs = sorted(t0 for name, _, t0, _, _ in timeline if name == SUBMIT_RANGE)
    if not marks or len(marks) != len(subs):
        return 0
    offs = sorted(m - s * 1e6 for m, s in zip(marks, subs))
    off = offs[len(offs) // 2]
    main_tids = {e.get("tid") for e in events if e.get("name") in ("forward", "backward")}
    pid = next((e.get("pid") for e in events if e.get("name") == "backward"), 0)
    added = 0
    for name, tid, t0, t1, ci in timeline:
        if name != SUBGROUP_RANGE or t1 is None or tid in main_tids:
            continue
        events.append({"ph": "X", "name": name, "cat": "user_annotation", "pid": pid, "tid": "ds-offload-step",
                       "ts": t0 * 1e6 + off, "dur": (t1 - t0) * 1e6, "args": {"sub_group": ci}})
        added += 1
    with open(out_file or trace_file, "w") as f:
        json.dump(trace, f)
    return added
