"""Pipeline parallelism on CPU/gloo: bubble fraction, activation memory, step time.

1. Bubble. Every stage holds one fixed-cost layer whose forward takes ``tf`` and whose
   backward takes ``tb`` seconds of *sleep* (not CPU work: this box has 2 shared cores,
   so CPU-bound stages would steal time from each other and distort the schedule; sleeping
   isolates what the schedule and the engine do). Per stage we measure, over one
   ``train_batch`` between barriers (wall time ``T``, the same on every stage):
   ``bubble = 1 - m * c_alone / T``, where ``c_alone`` is the same stage's work for one
   micro-batch (its layers' forward and backward, and the loss on the last stage) timed alone
   in plain PyTorch in the same process right before (median of ``repeats``): the fair
   comparison, in which engine work inside a forward or backward counts as overhead. Also
   ``bubble_in_pipe = 1 - compute / T`` (compute = time inside ForwardPass/BackwardPass, which
   counts that engine work as compute) and ``recv_wait / T`` (time blocked in receives),
   against the 1F1B theory ``(p - 1) / (m + p - 1)``, at p = 2, 4 and m = 1, 2, 4, ... up to
   4p. Medians over repeats, with the spread (max - min); where the time goes (wall time per
   instruction class and stage; host time per micro-batch outside compute and receive waits;
   the latency of a hop, from a send's start to the waiting receiver's return, from the
   instruction timestamps of the last batch), the p2p messages sent and the receives posted
   ahead per batch, and the machine's load average (1 min) before and after each p.
2. Activation memory. The same layer saves one activation tensor for backward; a weakref
   counts how many are alive. Peak per stage for 1F1B against the schedule's buffer bound
   ``min(p - s, m)``, and for an all-forwards-then-all-backwards (GPipe) schedule, which
   holds ``m``.
   The same with interleaved 1F1B (2 chunks per stage, each chunk half the stage's cost)
   against ``(p - 1) / (2m + p - 1)`` and the 1F1B figure of the same run.
3. Step time. The same 8-block MLP, global batch 32, trained as pp=2 (8 micro-batches)
   and as plain data parallelism over 2 processes (DeepSpeedEngine, 4 micro-batches of
   4 per rank), in the same run; median step time and the ratio.

Prints one JSON object. Usage: ``python benchmarks/pipeline.py [--quick] [--only bubble|step]
[--stages 2 4] [--no-interleaved] [--slack-diagnostic]`` (the last: each 1F1B batch also run with a
diagnostic schedule that keeps two micro-batches more in flight per neighbour than its successor).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ACT = {"live": 0, "peak": 0}
ACT_NUMEL = 64 * 1024          # 256 KiB of fp32 saved per micro-batch per stage


def _note_alive(t):
    ACT["live"] += 1
    ACT["peak"] = max(ACT["peak"], ACT["live"])
    weakref.finalize(t, _note_dead)


def _note_dead():
    ACT["live"] -= 1


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, tf, tb):
        time.sleep(tf)
        saved = torch.empty(ACT_NUMEL)
        _note_alive(saved)
        ctx.save_for_backward(saved)
        ctx.tb = tb
        return x * w

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.tb)
        return g, g.sum().reshape(1), None, None


class FixedCost(nn.Module):
    def __init__(self, tf, tb):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.tf, self.tb = tf, tb

    def forward(self, x):
        return _Sleep.apply(x, self.w, self.tf, self.tb)


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _pipe_engine(specs, p, micro, gas, dp, loss_fn=_mse, partition="uniform", chunks=1):
    import deepspeed
    from deepspeed.pipe import PipelineModule
    module = PipelineModule(specs, num_stages=p, loss_fn=loss_fn, partition_method=partition, chunks_per_stage=chunks)
    cfg = {"train_batch_size": micro * gas * dp, "train_micro_batch_size_per_gpu": micro,
           "gradient_accumulation_steps": gas, "steps_per_print": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-6}}}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    return engine


def _forever(x, y):
    while True:
        yield x, y


def _slack_schedule_cls():
    from deepspeed.runtime.pipe import schedule as S

    class Slack2Schedule(S.PipeSchedule):
        """Diagnostic, not an engine schedule: 1F1B whose stage s keeps ``2(p - s) - 1``
        micro-batches in flight (1F1B: ``p - s``), i.e. two more than its successor, so the
        neighbour cycle that 1F1B runs without slack gets one forward+backward of slack and the
        hop between stages leaves the critical path. Costs about twice 1F1B's activations."""

        def num_pipe_buffers(self):
            return min(2 * (self.stages - self.stage_id) - 1, self.micro_batches)

        def steps(self):
            m, first, last = self.micro_batches, self.is_first_stage, self.is_last_stage
            n = self.num_pipe_buffers()
            order = [("F", i) for i in range(n)]
            for i in range(m):
                order.append(("B", i))
                if n + i < m:
                    order.append(("F", n + i))
            for kind, i in order:
                buf = i % n
                if kind == "F":
                    yield ([] if first else [S.RecvActivation(buf)]) + \
                        ([S.LoadMicroBatch(buf)] if first or last else []) + \
                        [S.ForwardPass(buf)] + ([] if last else [S.SendActivation(buf)])
                else:
                    yield ([] if last else [S.RecvGrad(buf)]) + [S.BackwardPass(buf)] + \
                        ([] if first else [S.SendGrad(buf)])
            yield [S.ReduceTiedGrads(), S.ReduceGrads(), S.OptimizerStep()]

    return Slack2Schedule


def _bubble_worker(rank, world, ms, repeats, tf, tb, chunks=1, slack=False):
    from deepspeed.pipe import LayerSpec
    sys.path.insert(0, ROOT)
    from tests.runtime.pipe.test_pipe_features import GPipeSchedule
    p = world
    out = {}
    # one-way latency of a small message between neighbouring stages (ping-pong / 2)
    t = torch.zeros(2)
    lat = []
    for _ in range(30):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        lat.append((time.perf_counter() - t0) / 2)
    out["latency_s"] = statistics.median(lat)
    for m in ms:
        if chunks > 1 and m % p:
            continue
        # the same work per stage: `chunks` layers of 1/chunks the cost (one per virtual stage)
        eng = _pipe_engine([LayerSpec(FixedCost, tf / chunks, tb / chunks) for _ in range(p * chunks)], p, 1, m, 1,
                           chunks=chunks)
        it = _forever(torch.ones(1, 8), torch.zeros(1, 8))
        eng.train_batch(it)   # warm-up
        # the stage's work for one micro-batch timed alone (plain autograd, same layers and loss),
        # on every stage at once, right before the pipelined batches
        alone_layers = [FixedCost(tf / chunks, tb / chunks) for _ in range(chunks)]
        alone = []
        dist.barrier()
        for _ in range(repeats):
            x = torch.ones(1, 8, requires_grad=rank > 0)
            t0 = time.perf_counter()
            h = x
            for layer in alone_layers:
                h = layer(h)
            (_mse(h, torch.zeros(1, 8)) if rank == p - 1 else h.sum()).backward()
            alone.append(time.perf_counter() - t0)
        c_alone = statistics.median(alone)
        # where the time goes: wall time per instruction class (summed over the batch), and the
        # timestamps of the last batch's instructions (perf_counter is shared by the processes)
        per_instr, events = {}, []

        def timed(cls, fn):
            def run(self, **kw):
                t0 = time.perf_counter()
                fn(self, **kw)
                t1 = time.perf_counter()
                per_instr[cls.__name__] = per_instr.get(cls.__name__, 0.0) + t1 - t0
                events.append((cls.__name__, t0, t1))
            return run
        eng._INSTRUCTIONS = {cls: timed(cls, fn) for cls, fn in type(eng)._INSTRUCTIONS.items()}
        msgs0, ahead0 = getattr(eng.p2p, "messages_sent", 0), getattr(eng.p2p, "posted_ahead", 0)
        bubbles, bubbles_pipe, waits, sched_bubbles, batch_times, host = [], [], [], [], [], []
        ACT["peak"] = ACT["live"]
        for _ in range(repeats):
            events.clear()
            dist.barrier()
            t0 = time.perf_counter()
            eng.train_batch(it)
            t_stage = time.perf_counter() - t0
            dist.barrier()
            T = time.perf_counter() - t0
            batch_times.append(T)
            bubbles.append(1 - m * c_alone / T)   # c_alone: all of this stage's chunks for one micro-batch
            bubbles_pipe.append(1 - eng.compute_time / T)
            waits.append(eng.idle_time / T)
            # the pipelined part only: without this stage's gradient reduction and optimizer step
            sched_bubbles.append(1 - eng.compute_time / (T - eng.reduce_step_time))
            # this stage's own time outside compute, receive waits and the reduction/step
            host.append((t_stage - eng.compute_time - eng.idle_time - eng.reduce_step_time) / (m * chunks))
        peak_1f1b = ACT["peak"]
        per_instr_ms = {k: round(v / repeats * 1000, 2) for k, v in per_instr.items()}
        msgs = (getattr(eng.p2p, "messages_sent", 0) - msgs0) / repeats
        ahead = (getattr(eng.p2p, "posted_ahead", 0) - ahead0) / repeats
        eng._INSTRUCTIONS = type(eng)._INSTRUCTIONS
        last_events = list(events)
        slack_bubbles, slack_peak = [], None
        if chunks == 1 and slack:   # diagnostic: the same batches with two in flight per neighbour
            eng.train_schedule_cls = _slack_schedule_cls()
            eng.train_batch(it)
            ACT["peak"] = ACT["live"]
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                eng.train_batch(it)
                dist.barrier()
                slack_bubbles.append(1 - m * c_alone / (time.perf_counter() - t0))
            slack_peak = ACT["peak"]
        if chunks == 1:
            eng.train_schedule_cls = GPipeSchedule
            ACT["peak"] = ACT["live"]
            eng.train_batch(it)
        out[m] = {"slack_bubble": statistics.median(slack_bubbles) if slack_bubbles else None,
                  "slack_bubble_spread": max(slack_bubbles) - min(slack_bubbles) if slack_bubbles else None,
                  "peak_live_slack": slack_peak,
                  "bubble": statistics.median(bubbles), "bubble_spread": max(bubbles) - min(bubbles),
                  "bubble_in_pipe": statistics.median(bubbles_pipe),
                  "bubble_in_pipe_spread": max(bubbles_pipe) - min(bubbles_pipe),
                  "compute_alone_ms": c_alone * 1000, "compute_in_pipe_ms": eng.compute_time / (m * chunks) * 1000,
                  "host_ms_per_microbatch": statistics.median(host) * 1000,
                  "batch_time": statistics.median(batch_times),
                  "recv_wait": statistics.median(waits), "bubble_excl_step": statistics.median(sched_bubbles),
                  "peak_live_1f1b": peak_1f1b,
                  "peak_live_gpipe": ACT["peak"], "buffers_1f1b": min(p - rank, m),
                  "per_instr_ms": per_instr_ms, "messages_sent_per_batch": msgs, "receives_posted_ahead_per_batch": ahead,
                  "events": last_events}
    return out


def _hop_latencies(stage_events):
    """Per hop between neighbouring stages whose receiver was already waiting: milliseconds from
    the send's start to the receiver's return (transport plus the receiver's wake-up)."""
    hops = []
    for s in range(len(stage_events) - 1):
        for send, recv, src, dst in (("SendActivation", "RecvActivation", s, s + 1),
                                     ("SendGrad", "RecvGrad", s + 1, s)):
            sends = [e for e in stage_events[src] if e[0] == send]
            recvs = [e for e in stage_events[dst] if e[0] == recv]
            hops += [(r[2] - a[1]) * 1000 for a, r in zip(sends, recvs) if r[1] < a[1]]
    return hops


def _step_worker(rank, world, steps, warmup):
    """Both engines live in the same two processes; their steps alternate, so drifting load
    on the shared machine hits both alike."""
    import deepspeed
    from deepspeed.pipe import LayerSpec
    from _common import Block
    torch.manual_seed(0)
    d, n_blocks, global_batch = 256, 8, 32
    x, y = torch.randn(global_batch, d), torch.randn(global_batch, d)
    model = nn.Sequential(*[Block(d) for _ in range(n_blocks)])
    cfg = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": 4, "steps_per_print": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-6}}}
    # the plain engine first: a pipeline engine leaves its grid as the global mpu
    dp, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    pipe = _pipe_engine([LayerSpec(Block, d) for _ in range(n_blocks)], 2, 4, 8, 1, partition="parameters")
    it = _forever(x[:4], y[:4])

    def dp_step():
        for j in range(4):
            sl = slice(8 * rank + 4 * (j % 2), 8 * rank + 4 * (j % 2) + 4)
            dp.backward(_mse(dp(x[sl]), y[sl]))
            dp.step()

    steps_of = {"pp2": lambda: pipe.train_batch(it), "dp2": dp_step}
    times = {k: [] for k in steps_of}
    for i in range(warmup + steps):
        for name, step in steps_of.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["bubble", "step"], default=None)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--no-interleaved", action="store_true")
    ap.add_argument("--slack-diagnostic", action="store_true",
                    help="also run each 1F1B batch with two micro-batches more in flight per neighbour "
                         "(a diagnostic schedule in this file): is the excess the hop between stages?")
    args = ap.parse_args()
    from tests.helpers.dist import run_distributed
    tf, tb = (0.02, 0.04) if args.quick else (0.04, 0.08)
    ms_of = {p: [m for m in (1, 2, 4, 8, 16, 32) if m <= 4 * p] for p in args.stages}   # m up to 4p
    repeats = 3 if args.quick else 5
    result = {"config": {"tf_s": tf, "tb_s": tb, "micro_batches": ms_of, "repeats": repeats,
                         "activation_bytes_per_microbatch": ACT_NUMEL * 4},
              "load_avg_1min_before": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(), "bubble": {}}
    for p in (args.stages if args.only != "step" else ()):
        ms = ms_of[p]
        load_before = round(os.getloadavg()[0], 2)
        res = run_distributed(_bubble_worker, world_size=p, args=(ms, repeats, tf, tb, 1, args.slack_diagnostic),
                              timeout=900)
        per_m = {}
        for m in ms:
            theory = (p - 1) / (m + p - 1)
            stages = [r[m] for r in res]
            hops = _hop_latencies([s.pop("events") for s in stages])
            per_m[f"m={m}"] = {
                "theory": round(theory, 4),
                "bubble_per_stage": [round(s["bubble"], 4) for s in stages],
                "bubble_spread_per_stage": [round(s["bubble_spread"], 4) for s in stages],
                "bubble_in_pipe_per_stage": [round(s["bubble_in_pipe"], 4) for s in stages],
                "max_rel_error_in_pipe": round(max(abs(s["bubble_in_pipe"] - theory) for s in stages) / theory, 4),
                "compute_alone_ms_per_stage": [round(s["compute_alone_ms"], 2) for s in stages],
                "compute_in_pipe_ms_per_stage": [round(s["compute_in_pipe_ms"], 2) for s in stages],
                "host_ms_per_microbatch_per_stage": [round(s["host_ms_per_microbatch"], 3) for s in stages],
                "hop_latency_ms_median": round(statistics.median(hops), 3) if hops else None,
                **({"diagnostic_slack2_bubble_per_stage": [round(s["slack_bubble"], 4) for s in stages],
                    "diagnostic_slack2_max_rel_error": round(max(abs(s["slack_bubble"] - theory) for s in stages) / theory, 4),
                    "diagnostic_slack2_peak_live_activations": [s["peak_live_slack"] for s in stages]}
                   if stages[0]["slack_bubble"] is not None else {}),
                "hops_timed": len(hops),
                "bubble_excl_step_per_stage": [round(s["bubble_excl_step"], 4) for s in stages],
                "recv_wait_per_stage": [round(s["recv_wait"], 4) for s in stages],
                "max_rel_error_vs_theory": round(max(abs(s["bubble"] - theory) for s in stages) / theory, 4),
                "batch_time_s": round(stages[0]["batch_time"], 4),
                "excess_idle_ms_stage0": round((stages[0]["bubble"] - theory) * stages[0]["batch_time"] * 1000, 1),
                "max_rel_error_excl_step": round(max(abs(s["bubble_excl_step"] - theory) for s in stages) / theory, 4),
                "peak_live_activations_1f1b": [s["peak_live_1f1b"] for s in stages],
                "schedule_buffers_1f1b": [s["buffers_1f1b"] for s in stages],
                "peak_live_activations_gpipe": [s["peak_live_gpipe"] for s in stages],
                "messages_sent_per_batch": [s["messages_sent_per_batch"] for s in stages],
                "receives_posted_ahead_per_batch": [s["receives_posted_ahead_per_batch"] for s in stages],
                "per_instruction_ms_per_batch": [s["per_instr_ms"] for s in stages],
            }
        result["bubble"][f"p={p}"] = per_m
        result.setdefault("p2p_one_way_latency_ms", {})[f"p={p}"] = round(res[0]["latency_s"] * 1000, 3)
        result.setdefault("load_avg_1min_after", {})[f"p={p}"] = round(os.getloadavg()[0], 2)
        result.setdefault("load_avg_1min_before_p", {})[f"p={p}"] = load_before
        if args.no_interleaved:
            continue
        # interleaved 1F1B, 2 chunks per stage, same work per stage
        v = 2
        res = run_distributed(_bubble_worker, world_size=p, args=(ms, repeats, tf, tb, v), timeout=600)
        per_m = {}
        for m in [m for m in ms if m % p == 0]:
            theory = (p - 1) / (v * m + p - 1)
            stages = [r[m] for r in res]
            for st in stages:
                st.pop("events")
            one_f1b = result["bubble"][f"p={p}"][f"m={m}"]["bubble_per_stage"]
            per_m[f"m={m}"] = {
                "theory": round(theory, 4), "theory_1f1b": round((p - 1) / (m + p - 1), 4),
                "bubble_per_stage": [round(s["bubble"], 4) for s in stages],
                "bubble_spread_per_stage": [round(s["bubble_spread"], 4) for s in stages],
                "max_rel_error_vs_theory": round(max(abs(s["bubble"] - theory) for s in stages) / theory, 4),
                "bubble_in_pipe_per_stage": [round(s["bubble_in_pipe"], 4) for s in stages],
                "bubble_excl_step_per_stage": [round(s["bubble_excl_step"], 4) for s in stages],
                "max_rel_error_excl_step": round(max(abs(s["bubble_excl_step"] - theory) for s in stages) / theory, 4),
                "below_1f1b_on_every_stage": all(s["bubble"] < b for s, b in zip(stages, one_f1b)),
                "peak_live_layer_activations": [s["peak_live_1f1b"] for s in stages],
            }
        result["bubble_interleaved_2_chunks"] = result.get("bubble_interleaved_2_chunks", {})
        result["bubble_interleaved_2_chunks"][f"p={p}"] = per_m
    steps, warmup = (5, 2) if args.quick else (11, 3)
    if args.only == "bubble":
        print(json.dumps(result))
        return
    times = run_distributed(_step_worker, world_size=2, args=(steps, warmup), timeout=600)[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    result["step_time"] = {
        "model": "8 x Block(d=256) MLP, global batch 32, 2 processes, SGD; steps alternate pp2/dp2",
        "pp2_median_s": round(med["pp2"], 4), "pp2_spread_s": round(max(times["pp2"]) - min(times["pp2"]), 4),
        "dp2_median_s": round(med["dp2"], 4), "dp2_spread_s": round(max(times["dp2"]) - min(times["dp2"]), 4),
        "ratio_pp2_over_dp2": round(med["pp2"] / med["dp2"], 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
