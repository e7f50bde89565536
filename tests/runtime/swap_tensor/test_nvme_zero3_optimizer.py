"""ZeRO stage 3 with ``offload_optimizer.device: nvme`` (runtime/zero/stage3_nvme.py): the
fp32 masters and Adam moments live in swap files, one sub-group per chunk.

* training ends bit-identical (``torch.equal``) to the same run without offload and with
  CPU offload (fp32; bf16 against CPU offload), for several chunks, pipelined or not,
  1 or 3 swap buffers, with ``offload_param.device: cpu`` too, and at 2 ranks;
* checkpoints: no swap path in any saved file; resume bit-identical to an uninterrupted
  run; loads across nvme / cpu / no offload and from 2 ranks to 1;
* swap files are removed by ``engine.destroy()``; a SIGKILLed run's directory is removed
  by the next engine on the same ``nvme_path``;
* the masters never all exist in memory: peak RSS growth of an NVMe run stays far below
  its fp32 master + Adam bytes (a CPU-offload run of the same model, measured the same
  way, grows by more than them).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.helpers.dist import free_port, run_distributed
from tests.runtime.zero3._models import lm_batches, make_lm, shard, stage3_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LR, WD, CLIP, SUB = 0.02, 0.1, 0.5, 100


def _cfg(off=None, gas=2, mb=2, prec=None, param_off=None, optimizer=None):
    cfg = stage3_config(gas=gas, mb=mb, sub_group_size=SUB)
    cfg["gradient_clipping"] = CLIP
    if off is not None:
        cfg["zero_optimization"]["offload_optimizer"] = dict(off)
    if param_off is not None:
        cfg["zero_optimization"]["offload_param"] = {"device": param_off}
    if prec:
        cfg[prec] = {"enabled": True}
    if optimizer:
        cfg["optimizer"] = {"type": optimizer, "params": {"lr": LR, "weight_decay": WD}}
    return cfg


def _nvme(path, **kw):
    return dict({"device": "nvme", "nvme_path": str(path)}, **kw)


def _engine(cfg, seed=0):
    import deepspeed
    model = make_lm(seed=seed)
    opt = None if "optimizer" in cfg else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]


def _steps(eng, batches, rank=0, ws=1):
    gas, mb = eng.gradient_accumulation_steps(), eng.train_micro_batch_size_per_gpu()
    for b in batches:
        for m in range(gas):
            x, y = shard(b, rank, ws, m, mb)
            eng.backward(eng(x, y))
            eng.step()


def _train(cfg, steps=3, rank=0, ws=1, check=None):
    eng = _engine(cfg)
    gas, mb = cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"]
    _steps(eng, lm_batches(steps, gas * mb * ws), rank, ws)
    if check is not None:
        check(eng)
    sd = eng.module_state_dict()
    eng.destroy()
    return sd


def _swapped_for_real(eng):
    """The state really lives in the swapper: no in-memory masters or moments, I/O happened."""
    parts = eng.strategy.parts
    assert parts.nvme is not None and len(parts.chunks) > 2
    assert all(c.master.numel() == 0 for c in parts.chunks)
    assert parts.bytes()["master"] == 0 and parts.bytes()["nvme_swap_buffers"] > 0
    for st in eng.strategy.inner.state.values():
        assert all(not torch.is_tensor(v) or v.numel() <= 1 for v in st.values()), list(st)
    stats = parts.nvme.swapper.stats
    assert stats["bytes_read"] > 0 and stats["bytes_written"] > 0
    files = [f for f in os.listdir(parts.nvme.swap_folder) if f.endswith(".swp")]
    assert len(files) == len(parts.chunks)


def _assert_equal(a, b, what):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max |diff| {(a[k] - b[k]).abs().max().item()})"


# ------------------------------------------------------------------ parity, one rank

def test_fp32_nvme_is_bit_identical_to_no_offload_and_cpu_offload(tmp_path):
    ref = _train(_cfg())
    initial = make_lm(seed=0).state_dict()
    assert any(not torch.equal(ref[k], initial[k]) for k in ref)     # it trained
    _assert_equal(ref, _train(_cfg({"device": "cpu"})), "cpu offload")
    cases = {
        "buffer_count 1, no pipeline": _nvme(tmp_path, buffer_count=1),
        "buffer_count 3, pipeline read+write": _nvme(tmp_path, buffer_count=3, pipeline_read=True,
                                                     pipeline_write=True),
        "buffer_count 1, pipeline write": _nvme(tmp_path, buffer_count=1, pipeline_write=True),
    }
    for what, off in cases.items():
        _assert_equal(ref, _train(_cfg(off), check=_swapped_for_real), what)
    # with the parameters offloaded to host memory too (the master is then never shared)
    both = _train(_cfg(_nvme(tmp_path, buffer_count=3, pipeline_read=True), param_off="cpu"), check=_swapped_for_real)
    _assert_equal(ref, both, "offload_param cpu + offload_optimizer nvme")
    cfg = _cfg(_nvme(tmp_path, buffer_count=2, pipeline_write=True))   # and parameters on NVMe (helper N3's swapper)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
    _assert_equal(ref, _train(cfg, check=_swapped_for_real), "offload_param nvme + offload_optimizer nvme")
    assert not os.path.exists(tmp_path / "ds_swap")       # every engine removed its files at destroy


def test_bf16_nvme_equals_cpu_offload(tmp_path):
    def streamed(flag):
        def check(eng):
            _swapped_for_real(eng) if eng.strategy.parts.nvme is not None else None
            assert eng.strategy.parts.streamed is flag
        return check
    # client torch AdamW: whole-copy step; DeepSpeed's Adam (DeepSpeedCPUAdam): the streamed step
    for optimizer, flag in ((None, False), ("AdamW", True)):
        cpu = _train(_cfg({"device": "cpu"}, prec="bf16", optimizer=optimizer), check=streamed(flag))
        nvme = _train(_cfg(_nvme(tmp_path, buffer_count=3, pipeline_read=True, pipeline_write=True), prec="bf16",
                           optimizer=optimizer), check=streamed(flag))
        _assert_equal(cpu, nvme, f"bf16, optimizer {optimizer or 'client AdamW'}")
        assert all(v.dtype == torch.bfloat16 for v in nvme.values())


# ------------------------------------------------------------------ config errors

def test_nvme_path_is_checked(tmp_path):
    from deepspeed.config.errors import DeepSpeedConfigError
    key = "zero_optimization.offload_optimizer.nvme_path"
    for off, why in (({"device": "nvme"}, "required"),
                     (_nvme(tmp_path / "missing"), "not an existing directory")):
        with pytest.raises(DeepSpeedConfigError) as e:
            _engine(_cfg(off))
        assert key in str(e.value) and why in str(e.value)
    with pytest.raises(ValueError, match="pipeline_read needs buffer_count >= 2"):
        _engine(_cfg(_nvme(tmp_path, buffer_count=1, pipeline_read=True)))
    if os.geteuid() != 0:     # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(DeepSpeedConfigError, match="not writable"):
            _engine(_cfg(_nvme(ro)))


# ------------------------------------------------------------------ checkpoints

def _files_containing(root, needle: bytes):
    hits = []
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                if needle in fh.read():
                    hits.append(os.path.join(d, f))
    return hits


def _resume(cfg, ckpt, batches, rank=0, ws=1):
    eng = _engine(cfg, seed=123)      # other initial weights: everything must come from the checkpoint
    eng.load_checkpoint(ckpt)
    _steps(eng, batches, rank, ws)
    sd = eng.module_state_dict()
    eng.destroy()
    return sd


def test_checkpoint_resume_and_cross_mode(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    nv = _nvme(swap, buffer_count=3, pipeline_read=True, pipeline_write=True)
    batches = lm_batches(4, 4)
    uninterrupted = _train(_cfg(), steps=4)

    eng = _engine(_cfg(nv))
    _steps(eng, batches[:2])
    folder = eng.strategy.parts.nvme.swap_folder
    eng.save_checkpoint(str(tmp_path / "ckpt_nvme"), tag="s2")
    _steps(eng, batches[2:])
    _assert_equal(uninterrupted, eng.module_state_dict(), "NVMe run continuing after its save")
    eng.destroy()
    assert not _files_containing(tmp_path / "ckpt_nvme", folder.encode())
    assert not _files_containing(tmp_path / "ckpt_nvme", b"ds_swap")   # (nvme_path itself is in the saved config)

    eng = _engine(_cfg())
    _steps(eng, batches[:2])
    eng.save_checkpoint(str(tmp_path / "ckpt_none"), tag="s2")
    eng.destroy()

    for ckpt, mode, off in (("ckpt_nvme", "nvme", nv), ("ckpt_nvme", "cpu", {"device": "cpu"}),
                            ("ckpt_nvme", "none", None), ("ckpt_none", "nvme, no pipeline", _nvme(swap, buffer_count=1))):
        got = _resume(_cfg(off), str(tmp_path / ckpt), batches[2:])
        _assert_equal(uninterrupted, got, f"{ckpt} loaded with offload_optimizer {mode}")
    assert not os.path.exists(swap / "ds_swap")

    # a checkpoint without optimizer state: the NVMe engine starts its moments fresh, like
    # the in-memory one
    fresh = {}
    for mode, off in (("nvme", nv), ("none", None)):
        eng = _engine(_cfg(off), seed=123)
        eng.load_checkpoint(str(tmp_path / "ckpt_nvme"), load_optimizer_states=False)
        _steps(eng, batches[2:])
        fresh[mode] = eng.module_state_dict()
        eng.destroy()
    _assert_equal(fresh["none"], fresh["nvme"], "load_optimizer_states=False")


def _two_rank_body(rank, ws, root):
    """At 2 ranks: no offload vs NVMe (pipelined), 4 steps; the NVMe run saves after 2."""
    swap = os.path.join(root, "swap")
    batches = lm_batches(4, 4)
    out = {}
    for mode in ("none", "nvme"):
        cfg = _cfg(_nvme(swap, buffer_count=3, pipeline_read=True, pipeline_write=True) if mode == "nvme" else None,
                   gas=1, mb=2)
        eng = _engine(cfg)
        _steps(eng, batches[:2], rank, ws)
        if mode == "nvme":
            _swapped_for_real(eng)
            eng.save_checkpoint(os.path.join(root, "ckpt_ws2"), tag="s2")
        _steps(eng, batches[2:], rank, ws)
        out[mode] = eng.module_state_dict()
        eng.destroy()
    return out


def test_two_ranks_and_load_at_one_rank(tmp_path):
    os.makedirs(tmp_path / "swap")
    res = run_distributed(_two_rank_body, world_size=2, args=(str(tmp_path),), timeout=180)
    _assert_equal(res[0]["none"], res[0]["nvme"], "2 ranks, NVMe vs no offload")
    assert not os.listdir(tmp_path / "swap")
    # the 2-rank NVMe checkpoint loads at 1 rank, into NVMe and into no offload, identically
    batches = lm_batches(4, 4)[2:]
    got = {mode: _resume(_cfg(off, gas=1, mb=4), str(tmp_path / "ckpt_ws2"), batches)
           for mode, off in (("nvme", _nvme(tmp_path / "swap", buffer_count=2)), ("none", None))}
    _assert_equal(got["none"], got["nvme"], "2-rank NVMe checkpoint loaded at 1 rank")
    for k, v in res[0]["none"].items():   # and continues like the 2-rank run (other reduction order)
        torch.testing.assert_close(got["nvme"][k], v, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ crash, memory (one child process)

CHILD = textwrap.dedent(r"""
    import gc, json, os, sys, time
    sys.path.insert(0, {repo!r})
    import torch
    torch.set_num_threads(1)
    import deepspeed

    def rss():
        with open("/proc/self/status") as f:
            st = dict(l.split(":", 1) for l in f)
        return int(st["VmRSS"].split()[0]) * 1024, int(st["VmHWM"].split()[0]) * 1024

    mode, path = sys.argv[1], sys.argv[2]

    def run(layers, dim):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)]).bfloat16()
        off = {{"device": "cpu"}} if mode == "cpu" else {{"device": "nvme", "nvme_path": path, "buffer_count": 2,
                                                         "pipeline_write": True}}
        cfg = {{"train_micro_batch_size_per_gpu": 2, "bf16": {{"enabled": True}},
               "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
               "zero_optimization": {{"stage": 3, "sub_group_size": dim * dim // 2, "offload_optimizer": off,
                                     "stage3_param_persistence_threshold": 0, "reduce_bucket_size": dim * dim,
                                     "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0,
                                     "stage3_prefetch_bucket_size": 0}}}}
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                             # reset the peak-RSS mark (VmHWM)
        base = rss()[0]
        eng = deepspeed.initialize(model=model, config=cfg)[0]
        init = rss()[1]
        x = torch.randn(2, dim).bfloat16()
        for _ in range(2):
            eng.backward(eng(x).float().pow(2).mean())
            eng.step()
        return eng, {{"numel": layers * dim * dim, "peak_growth": rss()[1] - base, "init_growth": init - base,
                     "bytes": eng.strategy.model_state_bytes()}}

    run(1, 64)[0].destroy()                          # one-time imports and set-up out of the measurement
    eng, out = run(24, 512)
    out["folder"] = eng.strategy.parts.nvme.swap_folder if mode == "nvme" else None
    print(json.dumps(out), flush=True)
    if mode == "nvme":
        time.sleep(600)                              # the test kills us here
""")


def _child(mode, path):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    return subprocess.Popen([sys.executable, "-c", CHILD.format(repo=REPO), mode, str(path)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc, timeout):
    deadline = time.time() + timeout
    line, seen = "", []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{"):
            break
        if line:
            seen.append(line)
        elif proc.poll() is not None:    # EOF and exited: nothing more will come
            break
    if not line.startswith("{"):
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"child failed (exit code {proc.returncode}); stdout tail: {''.join(seen)[-2000:]}\n"
                             f"stderr tail: {proc.stderr.read()[-3000:]}")
    return json.loads(line)


def test_crash_leaves_stale_dir_that_next_run_removes_and_masters_never_all_in_memory(tmp_path):
    nvme = _child("nvme", tmp_path)
    cpu = _child("cpu", tmp_path)                    # runs alongside: same model, moments in memory
    try:
        got = _result(nvme, 120)
        stale = got["folder"]
        assert os.path.isdir(stale) and any(f.endswith(".swp") for f in os.listdir(stale))
        os.kill(nvme.pid, signal.SIGKILL)            # crash: no destroy, no atexit
        nvme.wait(30)
        assert os.path.isdir(stale)                  # the crash left its swap files behind
        ref = _result(cpu, 120)
        cpu.wait(30)
    finally:
        for p in (nvme, cpu):
            if p.poll() is None:
                p.kill()

    # memory: the fp32 master + Adam moments are 12 bytes per parameter. Both runs also hold
    # the bf16 gradient partitions (and the NVMe run its swap buffers); the bf16 parameter
    # partitions replace the bf16 model, which was built before the baseline.
    state_bytes = 12 * got["numel"]
    assert got["bytes"]["optimizer_state"] == 0 and got["bytes"]["master"] == 0
    extra_nvme = got["peak_growth"] - got["bytes"]["grads"] - got["bytes"]["nvme_swap_buffers"]
    extra_cpu = ref["peak_growth"] - ref["bytes"]["grads"]
    assert extra_cpu > 0.9 * state_bytes, ref       # the measurement sees state held in memory
    print("RSS", json.dumps({"state_bytes": state_bytes, "extra_nvme": extra_nvme, "extra_cpu": extra_cpu,
                             "nvme": got, "cpu": ref}))
    assert extra_nvme < 0.2 * state_bytes, got      # all masters at once (a third of state_bytes) would fail

    # the next engine on the same nvme_path removes the dead run's directory
    eng = _engine(_cfg(_nvme(tmp_path)))
    assert not os.path.exists(stale)
    live = eng.strategy.parts.nvme.swap_folder
    assert os.path.isdir(live)
    eng.destroy()
    assert not os.path.exists(live) and not os.path.exists(tmp_path / "ds_swap")


def test_tensor_fragment_api_reads_and_writes_the_swapped_state(tmp_path):
    """deepspeed.utils.safe_get/set_full_fp32_param & optimizer state go through the swap files."""
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                                 safe_set_full_optimizer_state)
    batches = lm_batches(3, 4)
    out = {}
    for mode, off in (("none", None), ("nvme", _nvme(tmp_path, buffer_count=2))):
        eng = _engine(_cfg(off))
        assert safe_get_full_optimizer_state(eng.module.blocks[0].fc1.weight, "exp_avg") is None   # no step yet
        _steps(eng, batches[:2])
        named = dict(eng.module.named_parameters())
        got = {n: (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg_sq")) for n, p in named.items()}
        w = named["blocks.1.fc2.weight"]
        safe_set_full_fp32_param(w, torch.full(w.ds_shape, 0.25))
        safe_set_full_optimizer_state(w, torch.full(w.ds_shape, -0.5), "exp_avg")
        assert torch.equal(safe_get_full_optimizer_state(w, "exp_avg"), torch.full(w.ds_shape, -0.5))
        _steps(eng, batches[2:])
        out[mode] = (got, eng.module_state_dict())
        eng.destroy()
    for n, (fp32, v) in out["none"][0].items():
        assert torch.equal(fp32, out["nvme"][0][n][0]) and torch.equal(v, out["nvme"][0][n][1]), n
    _assert_equal(out["none"][1], out["nvme"][1], "after safe_set_full_* and one more step")
