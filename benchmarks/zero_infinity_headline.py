"""The ZeRO-Infinity headline: a GPT whose model states do not fit in this machine's RAM,
built with ``zero.Init(remote_device="nvme")`` and trained for a few steps with ZeRO stage 3,
parameters and optimizer state on NVMe; plain PyTorch on the same model runs out of memory.

Two measured runs, each in its own child process so that a hard memory cap can be put on it
(``RLIMIT_AS``, set in the child before it imports torch) and the parent can watch it:

* ``deepspeed``: the GPT below (token + position embeddings, ``n_layer`` pre-LN blocks of
  causal self-attention and a 4x GELU MLP, final LayerNorm, untied LM head) constructed inside
  ``deepspeed.zero.Init(remote_device=..., config_dict_or_path=cfg, dtype=torch.bfloat16)``,
  then ``deepspeed.initialize`` (stage 3, bf16, Adam, ``offload_param`` and
  ``offload_optimizer`` on ``--offload nvme|cpu``), then ``--steps`` training steps on one
  fixed batch of random tokens (so a falling loss shows the update works). Reported: wall
  time of construction, initialize and each step's forward / backward / optimizer step, the
  losses, the child's peak resident set (its own ``VmHWM`` and the parent's view from
  ``wait4``), the resident set and the bytes allocated on disk under ``nvme_path`` (sampled
  every ``--sample-s`` by the parent, max kept), machine RAM and load average.
* ``plain``: the same model in plain PyTorch the usual mixed-precision way (fp32 parameters,
  ``torch.autocast`` bf16, ``torch.optim.AdamW``: 4 + 4 + 8 = 16 bytes per parameter, the
  same model-state bytes as DeepSpeed's bf16 + fp32 Adam), one step, under ``RLIMIT_AS``
  equal to the machine's RAM. Reported: the phase it reached, where it failed, the error.
  Because the machine is shared, the parent also kills the child if the machine's
  ``MemAvailable`` falls below ``--guard-gib`` (it says so in the result) - the kernel's OOM
  killer must never pick another process.

Usage::

    python benchmarks/zero_infinity_headline.py --size tiny --offload nvme      # seconds
    python benchmarks/zero_infinity_headline.py --size 2b --offload nvme --nvme-path /tmp/n4 \\
        --as-limit-gib 18 --steps 3 --out /tmp/n4/headline.json
    python benchmarks/zero_infinity_headline.py --size 2b --run plain
    python benchmarks/zero_infinity_headline.py --size 2b --offload nvme --nvme-path /tmp/n5 \\
        --as-limit-gib 60 --steps 1 --checkpoint --run deepspeed     # + a checkpoint round trip

Prints one JSON object (also written to ``--out``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

GiB = 1024 ** 3

# name -> (d_model, n_layer, n_head, vocab, seq)
SIZES = {
    "tiny": (128, 2, 4, 1024, 32),
    "50m": (640, 8, 10, 16384, 64),
    "2b": (2560, 24, 20, 50304, 128),
}


# ------------------------------------------------------------------------------- the model

def gpt_param_count(d: int, n_layer: int, vocab: int, seq: int) -> int:
    """Parameters of :class:`GPT` (untied head): embeddings, per block 12 d^2 + 13 d
    (qkv, proj, fc, out with biases, two LayerNorms), final LayerNorm, head."""
    return vocab * d + seq * d + n_layer * (12 * d * d + 13 * d) + 2 * d + vocab * d


def build_gpt(d, n_layer, n_head, vocab, seq):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, n_head, d // n_head).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = Attention()
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    return GPT()


# ------------------------------------------------------------------------------- measuring

def proc_status(pid="self") -> dict:
    """VmRSS / VmHWM / VmPeak / VmSize of a process, in bytes (empty if it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM", "VmPeak", "VmSize"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def meminfo() -> dict:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = int(v.split()[0]) * 1024
    return out


def disk_bytes(path: str) -> dict:
    """Allocated (st_blocks) and apparent bytes of the files under ``path``."""
    alloc = size = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(root, n))
            except OSError:
                continue
            alloc += st.st_blocks * 512
            size += st.st_size
            files += 1
    return {"allocated": alloc, "apparent": size, "files": files}


def _now():
    return time.perf_counter()


class PeakAnon:
    """Peak anonymous (``RssAnon``) and file-backed (``RssFile``) resident memory of this
    process while the block runs, sampled every 5 ms by a background thread."""

    @staticmethod
    def _read():
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("RssAnon", "RssFile"):
                    out[k] = int(v.split()[0]) * 1024
        return out.get("RssAnon", 0), out.get("RssFile", 0)

    def __enter__(self):
        self.base, self.file_peak = self._read()
        self.peak = self.base
        self._stop = threading.Event()

        def run():
            while not self._stop.is_set():
                anon, filed = self._read()
                self.peak, self.file_peak = max(self.peak, anon), max(self.file_peak, filed)
                self._stop.wait(0.005)
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        self._t0 = _now()
        return self

    def __exit__(self, *exc):
        self.wall = _now() - self._t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read()[0])


# ------------------------------------------------------------------------------- children

def child_deepspeed(a: dict) -> dict:
    """Build, initialize and train under DeepSpeed; returns the child's figures."""
    import torch
    import deepspeed

    torch.manual_seed(0)
    d, n_layer, n_head, vocab, seq = a["shape"]
    dev, opt_dev = a["offload_param"], a["offload_optimizer"]
    nvme = os.path.join(a["nvme_path"], "swap")
    os.makedirs(nvme, exist_ok=True)
    off_param = {"device": dev, "pin_memory": False}
    off_opt = {"device": opt_dev, "pin_memory": False}
    if dev == "nvme":
        off_param.update(nvme_path=nvme, buffer_count=a["param_buffer_count"],
                         buffer_size=a["param_buffer_size"], max_in_cpu=a["max_in_cpu"])
    if opt_dev == "nvme":
        off_opt.update(nvme_path=nvme, buffer_count=a["opt_buffer_count"])
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": a["lr"], "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "offload_param": off_param,
            "offload_optimizer": off_opt,
            "sub_group_size": a["sub_group_size"],
            # layer-sized limits: keep one block gathered at a time, not the whole model
            "stage3_max_live_parameters": a["max_live"],
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": a["prefetch"],
            "reduce_bucket_size": a["prefetch"],
            "stage3_param_persistence_threshold": 10 * d,
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True,
                "intra_op_parallelism": 2},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    res = {"config": cfg, "phases": {}, "steps": []}

    def mark(name, t0):
        res["phases"][name] = {"s": round(_now() - t0, 3), **proc_status(), "disk": disk_bytes(nvme)}
        print(f"[headline] {name}: {res['phases'][name]['s']:.1f} s, RSS "
              f"{res['phases'][name].get('VmRSS', 0) / GiB:.2f} GiB, HWM {res['phases'][name].get('VmHWM', 0) / GiB:.2f}"
              f" GiB, disk {res['phases'][name]['disk']['allocated'] / 1e9:.2f} GB", flush=True)

    def build(suffix=""):
        t0 = _now()
        with deepspeed.zero.Init(remote_device=dev, config_dict_or_path=cfg, dtype=torch.bfloat16):
            model = build_gpt(d, n_layer, n_head, vocab, seq)
        mark("construction" + suffix, t0)
        res["params"] = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
        t0 = _now()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        mark("initialize" + suffix, t0)
        return engine

    engine = build()
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def train_step(engine, i):
        t0 = _now()
        loss = engine(x, y)
        t1 = _now()
        engine.backward(loss)
        t2 = _now()
        engine.step()
        t3 = _now()
        st = {"step": i, "loss": float(loss.detach()), "fwd_s": round(t1 - t0, 3), "bwd_s": round(t2 - t1, 3),
              "opt_step_s": round(t3 - t2, 3), "total_s": round(t3 - t0, 3), **proc_status(),
              "disk": disk_bytes(nvme)}
        res["steps"].append(st)
        print(f"[headline] step {i}: loss {st['loss']:.4f}  fwd {st['fwd_s']:.1f} s  bwd {st['bwd_s']:.1f} s  "
              f"step {st['opt_step_s']:.1f} s  RSS {st.get('VmRSS', 0) / GiB:.2f} GiB  "
              f"disk {st['disk']['allocated'] / 1e9:.2f} GB", flush=True)
        return st["loss"]

    for i in range(a["steps"]):
        train_step(engine, i)
    if a.get("checkpoint"):
        # save, one more step (the uninterrupted run), then a fresh engine loads the checkpoint
        # and takes the same step: its loss must be the same; anonymous memory (RssAnon)
        # sampled every 5 ms around save_checkpoint and load_checkpoint
        ck = os.path.join(a["nvme_path"], "ckpt")
        cp = res["checkpoint"] = {}
        with PeakAnon() as m:
            engine.save_checkpoint(ck, tag="headline")
        cp.update(save_s=round(m.wall, 2), save_anon_before=m.base, save_anon_peak=m.peak,
                  save_rssfile_peak=m.file_peak, files=disk_bytes(ck), after_save=proc_status())
        print(f"[headline] save_checkpoint: {m.wall:.1f} s, RssAnon {m.base / GiB:.2f} -> peak {m.peak / GiB:.2f} GiB, "
              f"{cp['files']['allocated'] / 1e9:.2f} GB written", flush=True)
        cp["loss_uninterrupted"] = train_step(engine, a["steps"])
        engine.destroy()
        del engine
        import gc
        gc.collect()
        torch.manual_seed(1)                     # other initial weights: everything must come from the checkpoint
        engine = build(" (resume)")
        with PeakAnon() as m:
            engine.load_checkpoint(ck, tag="headline")
        cp.update(load_s=round(m.wall, 2), load_anon_before=m.base, load_anon_peak=m.peak,
                  load_rssfile_peak=m.file_peak, after_load=proc_status())
        print(f"[headline] load_checkpoint: {m.wall:.1f} s, RssAnon {m.base / GiB:.2f} -> peak {m.peak / GiB:.2f} GiB",
              flush=True)
        cp["loss_resumed"] = train_step(engine, a["steps"])
        cp["resumed_loss_equal"] = cp["loss_resumed"] == cp["loss_uninterrupted"]
    t0 = _now()
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()
    res["phases"]["destroy"] = {"s": round(_now() - t0, 3), "disk": disk_bytes(nvme)}
    res["final_status"] = proc_status()
    return res


def child_plain(a: dict) -> dict:
    """One plain-PyTorch mixed-precision training step; records the phase it failed in."""
    res = {"phases": {}, "reached": None, "failed_in": None, "error": None}
    phase = "import"
    try:
        import torch
        torch.manual_seed(0)
        d, n_layer, n_head, vocab, seq = a["shape"]
        phase = "construction"
        t0 = _now()
        model = build_gpt(d, n_layer, n_head, vocab, seq)          # fp32 parameters
        res["phases"][phase] = {"s": round(_now() - t0, 3), **proc_status()}
        res["reached"] = phase
        res["params"] = sum(p.numel() for p in model.parameters())
        phase = "optimizer"
        opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], betas=(0.9, 0.95), weight_decay=0.0)
        g = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, vocab, (1, seq + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        res["losses"] = []
        for i in range(a["steps"]):
            for what in ("forward", "backward", "step"):
                phase = f"{what}_{i}"
                t0 = _now()
                if what == "forward":
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(x, y)
                elif what == "backward":
                    loss.backward()
                else:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                res["phases"][phase] = {"s": round(_now() - t0, 3), **proc_status()}
                res["reached"] = phase
            res["losses"].append(float(loss.detach()))
        phase = None
    except BaseException as e:          # noqa: BLE001 - MemoryError / allocator RuntimeError is the result
        res["failed_in"] = phase
        res["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        res["status_at_failure"] = proc_status()
    res["final_status"] = proc_status()
    return res


def _child_main(kind: str, args_path: str, out_path: str) -> None:
    with open(args_path) as f:
        a = json.load(f)
    res = child_deepspeed(a) if kind == "deepspeed" else child_plain(a)
    with open(out_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out_path + ".tmp", out_path)


# ------------------------------------------------------------------------------- parent

def run_child(kind: str, a: dict, as_limit: int | None, timeout: float, sample_s: float,
              guard_bytes: int, disk_path: str | None) -> dict:
    """Run one child under ``RLIMIT_AS = as_limit``; sample its RSS, the machine's free memory
    and the disk under ``disk_path``; kill it on timeout or when the machine runs short."""
    work = tempfile.mkdtemp(prefix=f"zi_headline_{kind}_")
    args_path, out_path = os.path.join(work, "args.json"), os.path.join(work, "out.json")
    with open(args_path, "w") as f:
        json.dump(a, f)

    def limit():
        if as_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    env.setdefault("MALLOC_ARENA_MAX", "2")      # fewer 64 MiB malloc arenas reserved per thread
    t_start = _now()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_child", kind, args_path, out_path],
                            env=env, preexec_fn=limit)
    peak = {"rss": 0, "rss_at_s": None, "disk_alloc": 0, "disk_apparent": 0, "disk_at_s": None,
            "min_mem_available": None, "max_load1": 0.0, "samples": 0}
    killed = {"why": None}
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            st = proc_status(proc.pid)
            t = round(_now() - t_start, 1)
            if st.get("VmRSS", 0) > peak["rss"]:
                peak["rss"], peak["rss_at_s"] = st["VmRSS"], t
            avail = meminfo()["MemAvailable"]
            if peak["min_mem_available"] is None or avail < peak["min_mem_available"]:
                peak["min_mem_available"] = avail
            peak["max_load1"] = max(peak["max_load1"], os.getloadavg()[0])
            if disk_path is not None and os.path.isdir(disk_path):
                db = disk_bytes(disk_path)
                if db["allocated"] > peak["disk_alloc"]:
                    peak["disk_alloc"], peak["disk_apparent"], peak["disk_at_s"] = db["allocated"], db["apparent"], t
            peak["samples"] += 1
            if avail < guard_bytes and killed["why"] is None:
                killed["why"] = (f"machine MemAvailable {avail / GiB:.2f} GiB < guard {guard_bytes / GiB:.2f} GiB "
                                 f"at child RSS {st.get('VmRSS', 0) / GiB:.2f} GiB: killed to protect other processes")
                proc.kill()
            if _now() - t_start > timeout and killed["why"] is None:
                killed["why"] = f"timeout after {timeout:.0f} s"
                proc.kill()
            stop.wait(sample_s)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    stop.set()
    th.join()
    wall = _now() - t_start
    out = {"returncode": proc.returncode, "wall_s": round(wall, 1), "killed": killed["why"],
           "as_limit_bytes": as_limit, "parent_view_maxrss_bytes": ru.ru_maxrss * 1024,
           "sampled_peak_rss_bytes": peak["rss"], "sampled_peak_rss_at_s": peak["rss_at_s"],
           "sampled_min_mem_available_bytes": peak["min_mem_available"], "max_load1": round(peak["max_load1"], 2),
           "samples": peak["samples"]}
    if disk_path is not None:
        out.update(sampled_peak_disk_allocated_bytes=peak["disk_alloc"],
                   sampled_peak_disk_apparent_bytes=peak["disk_apparent"], sampled_peak_disk_at_s=peak["disk_at_s"])
    if os.path.exists(out_path):
        with open(out_path) as f:
            out["child"] = json.load(f)
    for p in (args_path, out_path):
        if os.path.exists(p):
            os.remove(p)
    os.rmdir(work)
    return out


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arithmetic(n: int, ram: int) -> dict:
    states = 16 * n
    return {"params": n, "model_state_bytes_16B_per_param": states, "machine_ram_bytes": ram,
            "states_over_ram": round(states / ram, 2),
            "breakdown_bytes": {"bf16_params": 2 * n, "bf16_grads": 2 * n, "fp32_master": 4 * n,
                                "adam_exp_avg": 4 * n, "adam_exp_avg_sq": 4 * n},
            "plain_pytorch_fp32_autocast_adamw_bytes": {"fp32_params": 4 * n, "fp32_grads": 4 * n,
                                                       "adamw_moments": 8 * n, "total": 16 * n}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--run", choices=("deepspeed", "plain", "both"), default="deepspeed")
    ap.add_argument("--offload", choices=("nvme", "cpu"), default="nvme",
                    help="device of offload_param and offload_optimizer (each overridable below)")
    ap.add_argument("--offload-param", choices=("nvme", "cpu"), default=None)
    ap.add_argument("--offload-optimizer", choices=("nvme", "cpu"), default=None)
    ap.add_argument("--nvme-path", default=None, help="directory for swap files (default: a new one under /tmp)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--sub-group-size", type=int, default=50_000_000)
    ap.add_argument("--opt-buffer-count", type=int, default=3)
    ap.add_argument("--param-buffer-count", type=int, default=5)
    ap.add_argument("--param-buffer-size", type=int, default=None,
                    help="elements per parameter swap buffer (default: the largest parameter)")
    ap.add_argument("--max-in-cpu", type=int, default=0)
    ap.add_argument("--as-limit-gib", type=float, default=18.0, help="RLIMIT_AS of the DeepSpeed child")
    ap.add_argument("--plain-as-limit-gib", type=float, default=None,
                    help="RLIMIT_AS of the plain-PyTorch child (default: the machine's RAM)")
    ap.add_argument("--guard-gib", type=float, default=1.5,
                    help="kill a child if the machine's MemAvailable falls below this")
    ap.add_argument("--timeout", type=float, default=2400)
    ap.add_argument("--sample-s", type=float, default=1.0)
    ap.add_argument("--keep", action="store_true", help="keep the swap directory")
    ap.add_argument("--checkpoint", action="store_true",
                    help="after the steps: save a checkpoint under --nvme-path/ckpt, take one more step, load it "
                         "into a fresh engine and take that step again (same loss expected); RssAnon sampled. "
                         "Saving and loading map the optimizer state (address space, not memory): raise "
                         "--as-limit-gib above the resident size plus the state (60 for --size 2b)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    d, n_layer, n_head, vocab, seq = SIZES[args.size]
    d = args.d_model or d
    n_layer = args.n_layer or n_layer
    n_head = args.n_head or n_head
    vocab = args.vocab or vocab
    seq = args.seq or seq
    if d % n_head:
        ap.error(f"--d-model {d} must be divisible by --n-head {n_head}")
    n = gpt_param_count(d, n_layer, vocab, seq)
    mi = meminfo()
    ram = mi["MemTotal"]
    res = {"benchmark": "zero_infinity_headline", "size": args.size,
           "shape": {"d_model": d, "n_layer": n_layer, "n_head": n_head, "vocab": vocab, "seq": seq, "batch": 1,
                     "tied_head": False},
           "arithmetic": arithmetic(n, ram), "cpus": os.cpu_count(),
           "mem_available_at_start_bytes": mi["MemAvailable"], "loadavg_at_start": os.getloadavg(),
           "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    a = {"shape": [d, n_layer, n_head, vocab, seq], "steps": args.steps, "lr": args.lr,
         "offload_param": args.offload_param or args.offload, "offload_optimizer": args.offload_optimizer or args.offload,
         "sub_group_size": args.sub_group_size, "opt_buffer_count": args.opt_buffer_count,
         "param_buffer_count": args.param_buffer_count,
         "param_buffer_size": args.param_buffer_size or max(vocab * d, 4 * d * d),
         "max_in_cpu": args.max_in_cpu, "max_live": max(vocab * d, 12 * d * d) + 1,
         "prefetch": 4 * d * d, "checkpoint": args.checkpoint}

    if args.run in ("deepspeed", "both"):
        own_dir = args.nvme_path is None
        base = args.nvme_path or tempfile.mkdtemp(prefix="zi_headline_nvme_")
        os.makedirs(base, exist_ok=True)
        a["nvme_path"] = base
        # bf16 params (2 B) and fp32 master + 2 moments (12 B) on disk, +1 B slack
        need = (3 if a["offload_param"] == "nvme" else 0) * n + (12 if a["offload_optimizer"] == "nvme" else 0) * n
        need += 15 * n if args.checkpoint else 0      # the checkpoint: fp32 master + moments, bf16 module
        free = os.statvfs(base).f_bavail * os.statvfs(base).f_frsize
        res["disk_free_at_start_bytes"] = free
        if need > free:
            raise SystemExit(f"--nvme-path {base}: {free / 1e9:.1f} GB free, the run needs about {need / 1e9:.1f} GB")
        r = run_child("deepspeed", a, int(args.as_limit_gib * GiB), args.timeout, args.sample_s,
                      int(args.guard_gib * GiB), os.path.join(base, "swap"))
        r["left_on_disk_after_exit"] = disk_bytes(base)
        if not args.keep:
            import shutil
            shutil.rmtree(os.path.join(base, "swap"), ignore_errors=True)
            shutil.rmtree(os.path.join(base, "ckpt"), ignore_errors=True)
            if own_dir:
                shutil.rmtree(base, ignore_errors=True)
        res["deepspeed"] = r
    if args.run in ("plain", "both"):
        lim = int(args.plain_as_limit_gib * GiB) if args.plain_as_limit_gib else ram
        a_plain = dict(a, steps=1)
        # sampled faster: a failing plain run grows by gigabytes per second near its end
        res["plain"] = run_child("plain", a_plain, lim, args.timeout, min(args.sample_s, 0.2),
                                 int(args.guard_gib * GiB), None)
    res["loadavg_at_end"] = os.getloadavg()
    res["finished_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return res


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--_child":
        _child_main(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
