"""A file system that fills up at any point of a save: the error says "No space left on
device" with the path and what was kept, and the save directory holds either the previous
state exactly (``latest`` and every file unchanged, no ``.part``/``.tmp-*`` left) or the
complete new tag named by ``latest``.

The file system is a small tmpfs (mounted here as root), filled up to leave 0, 1, 2, ...
pages free, so the save runs out of space at each of its writes in turn: a rank file, the
manifest, the ``latest`` update. Without the right to mount, a per-process file-size limit
(RLIMIT_FSIZE, EFBIG) in a subprocess stands in for the rank-file case."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

import deepspeed
from deepspeed.runtime.checkpoint import CheckpointError
from tests.helpers.dist import free_port
from tests.helpers.models import make_model

PAGE = 4096


def _can_mount(path) -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", path], capture_output=True)
    if r.returncode != 0:
        return False
    subprocess.run(["umount", path], check=False)
    return True


def _snapshot(d):
    out = {}
    for root, _, files in os.walk(d):
        for n in files:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = f.read()
    return out


def _engine(stage):
    cfg = {"train_batch_size": 4, "steps_per_print": 0, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": stage}}
    eng, *_ = deepspeed.initialize(model=make_model(hidden=64), config=cfg)
    loss = eng(torch.randn(4, 8), torch.randn(4, 4))
    eng.backward(loss)
    eng.step()
    return eng


def _free_pages(d):
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize // PAGE


def _sweep(stage, tmp_path, max_pages):
    mnt = str(tmp_path / "mnt")
    os.makedirs(mnt)
    if not _can_mount(mnt):
        pytest.skip("cannot mount a tmpfs here (test_disk_full_file_size_limit covers the rank-file case)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], check=True)
    outcomes = set()
    try:
        eng = _engine(stage)
        save = os.path.join(mnt, "ckpt")
        eng.save_checkpoint(save)               # the previous checkpoint (global_step1)
        for free in range(0, max_pages):
            before = _snapshot(save)
            filler = os.path.join(mnt, "filler")
            with open(filler, "wb") as f:      # leave exactly `free` pages
                f.write(b"\0" * max(0, (_free_pages(mnt) - free) * PAGE))
            assert _free_pages(mnt) == free
            eng.global_steps += 1
            tag = f"global_step{eng.global_steps}"
            try:
                eng.save_checkpoint(save)
            except CheckpointError as err:
                msg = str(err)
                assert "No space left on device" in msg and "ENOSPC" in msg and mnt in msg, msg
                assert "'latest' still names 'global_step1'" in msg, msg
                assert _snapshot(save) == before, f"free={free}: the save directory changed after a failed save"
                outcomes.add("kept" if "rolled back" not in msg else "rolled back")
            else:
                after = _snapshot(save)
                assert after["latest"] == tag.encode()
                assert all(k in after for k in before)   # the old tags are still there
                eng.load_checkpoint(save)              # the new tag is complete (verified on load)
                outcomes.add("saved")
                os.remove(filler)
                break
            finally:
                if os.path.exists(filler):
                    os.remove(filler)
            assert not [n for n in os.listdir(save) if n.endswith(".part") or n.startswith(".tmp-")]
        # the disk fills exactly at the 'latest' update (the commit point): filled from inside it
        from deepspeed.runtime.checkpoint import io as ckpt_io
        real = ckpt_io.atomic_write_text

        def fill_then_write(path, text, sync_dir=True, **kw):
            if os.path.basename(path) == "latest":
                with open(os.path.join(mnt, "filler"), "wb") as f:
                    f.write(b"\0" * (_free_pages(mnt) * PAGE))
            return real(path, text, sync_dir, **kw)
        before = _snapshot(save)
        ckpt_io.atomic_write_text = fill_then_write
        try:
            eng.global_steps += 1
            with pytest.raises(CheckpointError) as err:
                eng.save_checkpoint(save)
        finally:
            ckpt_io.atomic_write_text = real
            os.remove(os.path.join(mnt, "filler"))
        msg = str(err.value)
        assert "No space left on device" in msg and os.path.join(save, "latest") in msg and "rolled back" in msg, msg
        assert _snapshot(save) == before   # the new tag removed again, no latest.part: the old state exactly
        outcomes.add("rolled back")
        eng.destroy()
    finally:
        subprocess.run(["umount", mnt], check=False)
    return outcomes


def test_disk_full_at_every_point_of_a_save_stage2(tmp_path):
    outcomes = _sweep(2, tmp_path, max_pages=40)
    # it ran out of space while writing files (kept), saved once there was room, and rolled back
    # when the disk filled at the 'latest' update
    assert outcomes == {"kept", "rolled back", "saved"}, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_disk_full_at_every_point_of_a_save(stage, tmp_path):
    assert _sweep(stage, tmp_path, max_pages=40) == {"kept", "rolled back", "saved"}


_FSIZE_SCRIPT = r"""
import os, resource, signal, sys, torch, deepspeed
from tests.helpers.models import make_model
from deepspeed.runtime.checkpoint import CheckpointError
save = sys.argv[1]
cfg = {"train_batch_size": 4, "steps_per_print": 0, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
       "zero_optimization": {"stage": 2}}
eng, *_ = deepspeed.initialize(model=make_model(hidden=256), config=cfg)
loss = eng(torch.randn(4, 8), torch.randn(4, 4)); eng.backward(loss); eng.step()
eng.save_checkpoint(save)
before = sorted(os.listdir(save)), open(os.path.join(save, "latest")).read()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))
eng.global_steps += 1
try:
    eng.save_checkpoint(save)
except CheckpointError as err:
    print("ERROR:", err)
after = sorted(os.listdir(save)), open(os.path.join(save, "latest")).read()
print("SAME" if before == after else f"CHANGED {before} {after}")
"""


@pytest.mark.slow
def test_disk_full_file_size_limit(tmp_path):
    """Where mounting is not allowed: EFBIG from a file-size limit while writing a rank file
    (slow: the tmpfs test covers the same path where it can run)."""
    script = tmp_path / "fsize.py"
    script.write_text(_FSIZE_SCRIPT)
    save = str(tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.getcwd(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run([sys.executable, str(script), save], capture_output=True, text=True, timeout=300, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "ERROR: Could not write checkpoint file" in out and "File too large (EFBIG)" in out, out[-3000:]
    assert "'latest' still names 'global_step1'" in out and "\nSAME" in out, out[-3000:]
