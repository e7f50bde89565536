"""ZeRO stages 1/2 with ``offload_optimizer.device: "nvme"`` (runtime/precision/nvme_master.py).

References: the same engine run without offload and with ``device: "cpu"`` (fp32 must be
bit-identical to no offload: the update is elementwise and the norm is computed the same
way), and checkpoints written/read by the existing layer at other offload modes and world
sizes. One spawned world-1 group and one world-2 group carry all the engine runs; a
killed subprocess leaves the stale swap directory the world-1 group must sweep.
"""
from __future__ import annotations

import glob
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import global_batches
from tests.runtime.zero._common import build_engine, ds_config, full_fp32, run_steps

MB, GAS, STEPS = 4, 2, 3
SGS = 37           # sub_group_size: rounded up to 64 -> the 448-element weight group has 7 sub-groups


def _nvme(path, **kw):
    return dict({"device": "nvme", "nvme_path": str(path)}, **kw)


def _cfg(stage, dtype="fp32", offload=None, bucket=60, config_adam=False, **zero):
    cfg = ds_config(stage, GAS, MB, dtype, clip=0.05, bucket=bucket, **zero)   # clip 0.05: clipping is active
    if offload is not None:
        cfg["zero_optimization"]["offload_optimizer"] = offload
        cfg["zero_optimization"]["sub_group_size"] = SGS
    if config_adam:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}
    return cfg


def _train(cfg, rank, world, steps=STEPS, first=0, opt="adamw", dtype="fp32", engine=None, keep=False):
    engine = engine or build_engine(cfg, opt_name=opt)
    batches = global_batches(first + steps, MB * GAS * world)[first:]
    run_steps(engine, rank, world, batches, dtype)
    out = {"module": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
           "fp32": full_fp32(engine), "inner": type(engine.optimizer.inner).__name__}
    if keep:
        return out, engine
    engine.destroy()
    return out


def _same(a, b):
    """Names of the tensors that differ (bit for bit)."""
    return [n for n in a if not torch.equal(a[n], b[n])]


def _fp32_and_moments(engine):
    """Every trainable parameter's fp32 master and Adam moments (through tensor_fragment)."""
    from deepspeed.utils import safe_get_full_optimizer_state
    out = {f"{n}.fp32": t for n, t in full_fp32(engine).items()}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{n}.{k}"] = safe_get_full_optimizer_state(p, k)
    return out


def _file_digest(folder):
    h = hashlib.sha256()
    for f in sorted(glob.glob(os.path.join(folder, "*.swp"))):
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


# ---------------------------------------------------------------------------- world 1
def _single(rank, world, root, stale_dir):
    out = {}
    nv = os.path.join(root, "nvme")
    # the stale directory of the killed run is swept by the next engine on the same nvme_path
    out["stale_before"] = os.path.isdir(stale_dir)
    e = build_engine(_cfg(1, offload=_nvme(nv)), opt_name="adamw")
    out["stale_after"] = os.path.isdir(stale_dir)
    e.destroy()

    # fp32, stages 1 and 2, torch AdamW (client), several buckets and sub-groups: vs no offload
    for stage in (1, 2):
        ref = _train(_cfg(stage), rank, world)
        for bc, pipe in ((1, False), (2, True), (3, True), (3, False)):
            got = _train(_cfg(stage, offload=_nvme(nv, buffer_count=bc, pipeline_read=pipe, pipeline_write=pipe)),
                         rank, world)
            out[f"s{stage}_bc{bc}_{pipe}"] = (_same(ref["module"], got["module"]), _same(ref["fp32"], got["fp32"]))
    # one bucket per group: no offload, cpu offload and nvme all agree
    ref = _train(_cfg(2, bucket=10**6), rank, world)
    cpu = _train(_cfg(2, bucket=10**6, offload={"device": "cpu"}), rank, world)
    got = _train(_cfg(2, bucket=10**6, offload=_nvme(nv, buffer_count=2, pipeline_read=True)), rank, world)
    out["s2_one_bucket"] = (_same(ref["fp32"], got["fp32"]), _same(cpu["fp32"], got["fp32"]))
    # config AdamW: FusedAdam without offload, DeepSpeedCPUAdam with cpu/nvme
    ref = _train(_cfg(1, config_adam=True), rank, world)
    got = _train(_cfg(1, config_adam=True, offload=_nvme(nv, buffer_count=3, pipeline_read=True,
                                                         pipeline_write=True)), rank, world)
    out["s1_config_adam"] = (ref["inner"], got["inner"], _same(ref["fp32"], got["fp32"]))
    # a client SGD with momentum (state 'momentum_buffer', created from the first gradient)
    ref = _train(_cfg(2), rank, world, opt="sgd")
    got = _train(_cfg(2, offload=_nvme(nv, buffer_count=2)), rank, world, opt="sgd")
    out["s2_sgd"] = _same(ref["fp32"], got["fp32"])
    # bf16 with the config's AdamW (the streamed update): vs cpu offload
    for stage in (1, 2):
        cpu = _train(_cfg(stage, "bf16", offload={"device": "cpu"}, config_adam=True), rank, world, dtype="bf16")
        got = _train(_cfg(stage, "bf16", offload=_nvme(nv, buffer_count=2, pipeline_read=True), config_adam=True),
                     rank, world, dtype="bf16")
        out[f"bf16_s{stage}"] = (_same(cpu["module"], got["module"]), _same(cpu["fp32"], got["fp32"]))

    # what stays in memory, and the files
    res, e = _train(_cfg(2, offload=_nvme(nv, buffer_count=2)), rank, world, keep=True)
    o = e.optimizer
    sw = o._nvme.swapper
    out["n_subgroups"] = len(o._nvme.subgroups)
    out["masters_numel"] = [m.numel() for m in o.masters]
    out["placeholder_numel"] = sum(p.numel() for g in o.param_groups for p in g["params"])
    out["state_keys"] = sorted({k for st in o.state.values() for k in st})
    out["buffers"] = (sw.buffer_count, sw.buffer_bytes())
    folder = sw.swap_folder
    out["files"] = len(glob.glob(os.path.join(folder, "*.swp")))
    e.destroy()
    out["after_destroy"] = (os.path.exists(folder), os.path.exists(os.path.join(nv, "ds_swap")))

    # checkpoint: nvme -> nvme resumes bit-identically; nvme -> none and none -> nvme too; nvme -> stage 1
    # with cpu offload loads the same masters and moments
    ck = os.path.join(root, "ck")
    full = _train(_cfg(2), rank, world, steps=4)
    first, e = _train(_cfg(2, offload=_nvme(nv, buffer_count=2, pipeline_read=True)), rank, world, steps=2, keep=True)
    saved = _fp32_and_moments(e)
    out["ck"], out["ck_saved"] = ck, saved      # the world-2 test loads it too
    e.save_checkpoint(ck, tag="nv")
    with open(os.path.join(ck, "nv", "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "rb") as f:
        out["ckpt_mentions_swap"] = b"ds_swap" in f.read()
    e.destroy()
    ck_none = os.path.join(root, "ck_none")
    _, e = _train(_cfg(2), rank, world, steps=2, keep=True)
    e.save_checkpoint(ck_none, tag="none")
    e.destroy()
    for name, cfg, src, tag in (("nv_nv", _cfg(2, offload=_nvme(nv, buffer_count=3)), ck, "nv"),
                                ("nv_none", _cfg(2), ck, "nv"),
                                ("nv_cpu_s1", _cfg(1, offload={"device": "cpu"}), ck, "nv"),
                                ("none_nv", _cfg(2, offload=_nvme(nv, buffer_count=1)), ck_none, "none")):
        e = build_engine(cfg, opt_name="adamw")
        e.load_checkpoint(src, tag=tag)
        loaded = _fp32_and_moments(e)
        if name == "nv_cpu_s1":   # (stage 1 + cpu offload clips by a per-group norm: another trajectory)
            out[name] = _same(saved, loaded)
            e.destroy()
            continue
        resumed = _train(None, rank, world, steps=2, first=2, engine=e)
        out[name] = _same(saved, loaded) + _same(full["fp32"], resumed["fp32"])

    # fp16: a skipped step (overflow) leaves the files untouched; the run equals cpu offload
    def fp16(offload):
        cfg = _cfg(1, "fp16", offload=offload)
        # 2**18 overflows the fp16 gradients: steps are skipped until the scale has come down
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 18, "hysteresis": 1}
        return cfg
    cpu = _train(fp16({"device": "cpu"}), rank, world, steps=6, dtype="fp16")
    e = build_engine(fp16(_nvme(nv, buffer_count=2, pipeline_read=True)), opt_name="adamw")
    folder, skipped = e.optimizer._nvme.swapper.swap_folder, []
    for i, batch in enumerate(global_batches(6, MB * GAS * world)):
        before = _file_digest(folder)
        run_steps(e, rank, world, [batch], "fp16")
        skipped.append((e.optimizer.overflow, before == _file_digest(folder)))
    out["fp16_skips"] = skipped
    out["fp16_vs_cpu"] = _same(cpu["fp32"], full_fp32(e))
    e.destroy()
    return out


_CRASH = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    sys.path.insert(0, os.getcwd())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from tests.runtime.swap_tensor.test_nvme_zero12 import _cfg, _nvme
    from tests.runtime.zero._common import build_engine, run_steps
    from tests.helpers.models import global_batches
    e = build_engine(_cfg(2, offload=_nvme(sys.argv[1], buffer_count=2, pipeline_read=True, pipeline_write=True)))
    print("SWAPDIR", e.optimizer._nvme.swapper.swap_folder, flush=True)
    while True:
        run_steps(e, 0, 1, global_batches(1, 8))
""")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nvme12"))
    nv = os.path.join(root, "nvme")
    os.makedirs(nv)
    from tests.helpers.dist import free_port
    proc = subprocess.Popen([sys.executable, "-c", _CRASH, nv, str(free_port())], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=os.getcwd())
    guard = threading.Timer(90, proc.kill)              # no hang if it never prints
    guard.start()
    try:
        stale = ""
        for line in proc.stdout:                        # the swap folder, once the engine is built
            if line.startswith("SWAPDIR "):
                stale = line.split(" ", 1)[1].strip()
                break
        time.sleep(1.0)                                 # mid-run: steps are swapping
        assert stale and os.path.isdir(stale), "the crashing run did not start"
    finally:
        guard.cancel()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert os.path.isdir(stale)                         # a SIGKILL leaves its files behind
    return run_distributed(_single, world_size=1, args=(root, stale), timeout=240)[0]


def test_fp32_bit_identical_to_no_offload(single):
    for stage in (1, 2):
        for bc, pipe in ((1, False), (2, True), (3, True), (3, False)):
            assert single[f"s{stage}_bc{bc}_{pipe}"] == ([], []), (stage, bc, pipe)
    assert single["s2_one_bucket"] == ([], [])          # == no offload and == cpu offload
    inner_ref, inner_nvme, diff = single["s1_config_adam"]
    assert (inner_ref, inner_nvme) == ("FusedAdam", "DeepSpeedCPUAdam") and diff == []
    assert single["s2_sgd"] == []


def test_bf16_equal_to_cpu_offload(single):
    assert single["bf16_s1"] == ([], []) and single["bf16_s2"] == ([], [])


def test_only_buffers_resident_and_files_removed_by_destroy(single):
    assert single["n_subgroups"] == 8                   # 448 weights -> 7 x 64; 20 biases -> 1
    assert single["masters_numel"] == [0, 0] and single["placeholder_numel"] == 0
    assert single["state_keys"] == ["step"]             # moments live in the files only
    count, nbytes = single["buffers"]
    # 2 buffers of param + exp_avg + exp_avg_sq, each of 64 elements padded to 4 KiB (direct I/O)
    assert count == 2 and nbytes == 2 * 3 * 4096
    assert single["files"] == 8
    assert single["after_destroy"] == (False, False)


def test_checkpoint_resume_and_cross_mode(single):
    assert single["ckpt_mentions_swap"] is False
    for name in ("nv_nv", "nv_none", "nv_cpu_s1", "none_nv"):
        assert single[name] == [], name


def test_fp16_skipped_step_leaves_files(single):
    skips = single["fp16_skips"]
    assert any(s for s, _ in skips) and not all(s for s, _ in skips), skips
    for overflow, untouched in skips:
        assert untouched == overflow                    # skipped: files unchanged; stepped: written
    assert single["fp16_vs_cpu"] == []


def test_crash_leaves_stale_dir_that_next_engine_removes(single):
    assert single["stale_before"] is True and single["stale_after"] is False


# ---------------------------------------------------------------------------- world 2
def _pair(rank, world, root, ck):
    nv = os.path.join(root, f"nvme{rank}")
    os.makedirs(nv, exist_ok=True)
    ref = _train(_cfg(2), rank, world, steps=4)
    got = _train(_cfg(2, offload=_nvme(nv, buffer_count=2, pipeline_read=True, pipeline_write=True)), rank, world,
                 steps=4)
    # the world-1 NVMe checkpoint loads into a world-2 NVMe run
    e = build_engine(_cfg(2, offload=_nvme(nv, buffer_count=3)), opt_name="adamw")
    e.load_checkpoint(ck, tag="nv")
    loaded = _fp32_and_moments(e)
    e.destroy()
    return {"fp32": _same(ref["fp32"], got["fp32"]), "module": _same(ref["module"], got["module"]),
            "loaded": loaded}


def test_two_ranks_stage2_and_load_world1_checkpoint(single, tmp_path):
    res = run_distributed(_pair, world_size=2, args=(str(tmp_path), single["ck"]), timeout=180)
    for r in res:
        assert r["fp32"] == [] and r["module"] == []
        assert _same(single["ck_saved"], r["loaded"]) == []


def test_config_errors(tmp_path):
    from deepspeed.config.ds_config import DeepSpeedConfig
    from deepspeed.config.errors import DeepSpeedConfigError
    for off in ({"device": "nvme"}, {"device": "nvme", "nvme_path": str(tmp_path / "missing")}):
        with pytest.raises(DeepSpeedConfigError, match="zero_optimization.offload_optimizer.nvme_path"):
            DeepSpeedConfig(_cfg(1, offload=off), world_size=1)
    DeepSpeedConfig(_cfg(2, offload=_nvme(tmp_path)), world_size=1)   # accepted at stage 2
