"""ZeRO CPU offload, side by side: ours vs the real DeepSpeed vs plain PyTorch (DDP + AdamW).

Claim (issue 32): with ZeRO-3 parameters and optimizer offloaded to the CPU the wall
time per step is at most the real DeepSpeed's, and the step trace says how much of the
optimizer / host-transfer time is hidden behind forward/backward compute.

Same model (``_common.BenchModel``), same batches, same config, 2 ranks over gloo,
one process per implementation and configuration, run round by round interleaved
(ours, DeepSpeed, PyTorch, ours, ...) so that the load of a shared machine hits them
alike; the paired ratio of each round is reported with median and spread, and the
load average is recorded with every figure.

Per run: ``--warmup`` steps, then ``--steps`` timed steps (a barrier before and after):
wall seconds per step (rank 0) and CPU-seconds per step (user + system of both ranks,
threads included, from ``getrusage``). Each rank runs ``--threads`` intra-op threads
(``OMP_NUM_THREADS`` too, which DeepSpeed's CPU Adam reads), the same for all three.

The hidden fraction (ours): one more step is captured with the engine's step trace
(``deepspeed.runtime.engine_monitor.trace_step``, torch.profiler); the offload work is
the trace's ranges named ``offload.*`` (optimizer sub-group steps, gradient copies to
the optimizer's host buffers, parameter partitions written back); the hidden fraction
is the share of their time that lies inside the forward/backward ranges on another
thread, i.e. runs while compute runs.

Usage:
  python benchmarks/offload_overlap.py [--ds-python /tmp/realds/bin/python] [--rounds 5]
         [--configs z3_offload z2_offload] [--out result.json]
The real DeepSpeed runs with ``TORCH_EXTENSIONS_DIR`` (default /tmp/realds_ext) set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CONFIGS = {
    # name: (zero_optimization section, description)
    "z3_offload": ({"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
                   "ZeRO-3, offload_param + offload_optimizer to cpu"),
    "z2_offload": ({"stage": 2, "offload_optimizer": {"device": "cpu"}},
                   "ZeRO-2, offload_optimizer to cpu"),
}


# ----------------------------------------------------------------------------- rank side
def _batches(args, rank, n):
    import torch
    g = torch.Generator().manual_seed(1234 + rank)
    return [(torch.randn(args.batch, args.d, generator=g), torch.randn(args.batch, 16, generator=g))
            for _ in range(n)]


def _ds_config(args):
    zero = json.loads(json.dumps(CONFIGS[args.config][0]))
    if args.impl == "ours_so" and zero["stage"] == 3:   # ours with offload_optimizer.super_offload
        zero["offload_optimizer"]["super_offload"] = True
    zero["sub_group_size"] = args.sub_group_size
    zero["reduce_bucket_size"] = args.bucket
    if zero["stage"] == 3:
        zero["stage3_prefetch_bucket_size"] = args.bucket
    zero["overlap_comm"] = True
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "gradient_clipping": args.clip, "zero_optimization": zero, "steps_per_print": 10 ** 9,
            "wall_clock_breakdown": False}


def _usage():
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank(rank, args, q):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args.port))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    sys.path.insert(0, HERE)
    from _common import BenchModel
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(0)
    model = BenchModel(d=args.d, layers=args.layers)
    n = sum(p.numel() for p in model.parameters())
    batches = _batches(args, rank, args.warmup + args.steps + 1)
    trace = None
    if args.impl == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)

        def step(x, y):
            loss = ddp(x, y)
            loss.backward()
            if args.clip:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        import deepspeed
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_ds_config(args))

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    for x, y in batches[:args.warmup]:
        step(x, y)
    dist.barrier()
    t0, c0 = time.perf_counter(), _usage()
    for x, y in batches[args.warmup:args.warmup + args.steps]:
        step(x, y)
    dist.barrier()
    wall, cpu = (time.perf_counter() - t0) / args.steps, (_usage() - c0) / args.steps
    if args.impl in ("ours", "ours_so", "base") and args.trace_dir:
        from deepspeed.runtime.engine_monitor import trace_step
        trace_step(engine, output_dir=args.trace_dir)
        step(*batches[-1])
        trace = engine._obs.last_trace_file
        ov = getattr(getattr(engine.optimizer, "parts", None), "_ovl", None)
        if hasattr(ov, "last_timeline"):    # super_offload: the worker thread's ranges into the trace
            from deepspeed.runtime.zero.stage3_offload_overlap import merge_into_trace
            merge_into_trace(trace, ov.last_timeline)
    cpus = [None] * args.world
    dist.all_gather_object(cpus, cpu)
    if rank == 0:
        q.put({"wall_s": wall, "cpu_s": sum(cpus), "params": n, "trace": trace})
    dist.destroy_process_group()


def _worker(args):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    load = os.getloadavg()[0]
    procs = [ctx.Process(target=_rank, args=(r, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    res = q.get(timeout=args.timeout)
    for p in procs:
        p.join(60)
    res["load_before"] = load
    res["load_after"] = os.getloadavg()[0]
    if res.get("trace"):
        res["overlap"] = hidden_fraction(res["trace"])
    print("RESULT " + json.dumps(res), flush=True)


# ----------------------------------------------------------------------------- trace analysis
def _merge(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _covered(a, b, merged) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)


def hidden_fraction(trace_file: str) -> dict:
    """From a Chrome trace of one step: the ``offload.*`` ranges (name -> total ms), and how
    much of their time runs inside a forward/backward range on another thread (hidden)."""
    with open(trace_file) as f:
        ev = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    compute = [e for e in ev if e.get("name") in ("forward", "backward")]
    comp_iv = _merge([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    comp_tids = {e.get("tid") for e in compute}
    work = [e for e in ev if str(e.get("name", "")).startswith("offload.") and e["name"] != "offload.submit"]
    by_name, total, hidden = {}, 0.0, 0.0
    for e in work:
        a, b = e["ts"], e["ts"] + e["dur"]
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"] / 1000.0
        total += e["dur"]
        if e.get("tid") not in comp_tids:
            hidden += _covered(a, b, comp_iv)
    step_ms = sum(e["dur"] for e in ev if e.get("name") == "step") / 1000.0
    return {"offload_ms": round(total / 1000.0, 3), "hidden_ms": round(hidden / 1000.0, 3),
            "hidden_fraction": round(hidden / total, 4) if total else 0.0,
            "by_range_ms": {k: round(v, 3) for k, v in sorted(by_name.items())},
            "compute_ms": round(sum(b - a for a, b in comp_iv) / 1000.0, 3), "step_range_ms": round(step_ms, 3)}


# ----------------------------------------------------------------------------- driver
def _run(impl, config, args, python, port, trace_dir=None):
    cmd = [python, os.path.abspath(__file__), "--worker", "--impl", impl, "--config", config, "--port", str(port)]
    for k in ("d", "layers", "batch", "steps", "warmup", "world", "threads", "sub_group_size", "bucket", "clip",
              "timeout"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if trace_dir:
        cmd += ["--trace-dir", trace_dir]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    if impl == "ds":
        env.update(TORCH_EXTENSIONS_DIR=args.ext_dir, DS_ACCELERATOR="cpu")
        env.pop("PYTHONPATH", None)
    else:   # "ours_so": ours with super_offload; "base": another copy of our package (e.g. before a change)
        env["PYTHONPATH"] = (args.base_path if impl == "base" else REPO) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 120,
                       cwd=tempfile.gettempdir())
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{impl}/{config} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")


def _git_head():
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "n": len(xs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ds-python", default=None, help="interpreter with the real DeepSpeed installed")
    ap.add_argument("--base-path", default=None,
                    help="directory holding another copy of our 'deepspeed' package (e.g. before a change), "
                         "measured as 'base' in the same rounds")
    ap.add_argument("--ext-dir", default="/tmp/realds_ext", help="TORCH_EXTENSIONS_DIR for the real DeepSpeed")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sub-group-size", type=int, default=2_000_000)
    ap.add_argument("--bucket", type=int, default=2_000_000)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--super-offload", action="store_true",
                    help="also run ours with offload_optimizer.super_offload (sub-groups stepped during backward; "
                         "ZeRO-3 configs) as 'ours_so'")
    ap.add_argument("--no-torch", action="store_true", help="skip the plain PyTorch reference")
    ap.add_argument("--out", default=None)
    # worker mode
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="ours", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="z3_offload", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29611, help=argparse.SUPPRESS)
    ap.add_argument("--trace-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    impls = (["ours"] + (["ours_so"] if args.super_offload else []) + (["base"] if args.base_path else [])
             + (["ds"] if args.ds_python else []) + ([] if args.no_torch else ["torch"]))
    pythons = {"ours": sys.executable, "ours_so": sys.executable, "base": sys.executable, "ds": args.ds_python,
               "torch": sys.executable}
    raw = {c: {i: [] for i in impls} for c in args.configs}
    port = 29600 + (os.getpid() % 200) * 10
    trace_dir = tempfile.mkdtemp(prefix="offload_overlap_trace_")
    for r in range(args.rounds):
        for c in args.configs:
            order = impls if r % 2 == 0 else impls[::-1]     # ABAB... then BABA, so no side always goes first
            for impl in order:
                if impl == "ours_so" and CONFIGS[c][0]["stage"] != 3:
                    continue         # super_offload is a ZeRO-3 option
                port += 1
                res = _run(impl, c, args, pythons[impl], port,
                           trace_dir if impl in ("ours", "ours_so", "base") else None)
                res["round"] = r
                raw[c][impl].append(res)
                print(f"round {r} {c:11s} {impl:5s} wall {res['wall_s']:.4f}s cpu {res['cpu_s']:.4f}s "
                      f"load {res['load_before']:.2f}" +
                      (f" hidden {res['overlap']['hidden_fraction']:.2f}" if res.get("overlap") else ""),
                      file=sys.stderr, flush=True)
    summary = {}
    for c in args.configs:
        s = {}
        for impl in impls:
            runs = raw[c][impl]
            if not runs:
                continue
            s[impl] = {"wall_s": _stats([x["wall_s"] for x in runs]), "cpu_s": _stats([x["cpu_s"] for x in runs]),
                       "load": _stats([x["load_before"] for x in runs])}
        for mine, other in [("ours", o) for o in impls[1:]] + [("ours_so", o) for o in impls if o not in
                                                               ("ours", "ours_so") and "ours_so" in impls]:
            pairs = list(zip(raw[c][mine], raw[c][other]))
            if not pairs:
                continue
            s[f"{mine}/{other}"] = {
                "wall_ratio": _stats([a["wall_s"] / b["wall_s"] for a, b in pairs]),
                "cpu_ratio": _stats([a["cpu_s"] / b["cpu_s"] for a, b in pairs]),
                "rounds_wall_not_higher": sum(a["wall_s"] <= b["wall_s"] for a, b in pairs),
                "rounds": len(pairs)}
        for impl in ("ours", "ours_so", "base"):
            ov = [x["overlap"] for x in raw[c].get(impl, []) if x.get("overlap")]
            if ov:
                s[f"{impl}_hidden_fraction"] = _stats([o["hidden_fraction"] for o in ov])
                s[f"{impl}_trace_last"] = ov[-1]
        summary[c] = s
    out = {"benchmark": "offload_overlap", "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "setup": {k: getattr(args, k) for k in ("d", "layers", "batch", "steps", "warmup", "world", "threads",
                                                   "sub_group_size", "bucket", "clip", "rounds")},
           "configs": {c: {"zero_optimization": _ds_config(argparse.Namespace(**dict(vars(args), config=c)))[
               "zero_optimization"], "what": CONFIGS[c][1]} for c in args.configs},
           "params": raw[args.configs[0]]["ours"][0]["params"], "cpu_count": os.cpu_count(),
           "commit": _git_head(),
           "summary": summary, "raw": raw}
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
