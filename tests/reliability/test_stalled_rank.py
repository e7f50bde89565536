"""A rank that stops mid-step (SIGSTOP before its backward): the other rank fails at the
collective timeout with an error naming the collective and the training step (at every ZeRO
stage, including the gradient-bucket waits of stages 0-2), and the launcher and every rank
are gone within timeout + 2 s."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers.dist import free_port

BIN = os.path.dirname(sys.executable)
DEEPSPEED = os.path.join(BIN, "deepspeed")
SCRIPT = os.path.join(os.path.dirname(__file__), "_stall_script.py")
TIMEOUT_S = 3.0


def _run(stage, tmp_path):
    env = dict(os.environ, STALL_TIMEOUT_S=str(TIMEOUT_S), PYTHONPATH=os.getcwd())
    t0 = time.time()
    proc = subprocess.run([DEEPSPEED, "--num_procs", "2", "--master_port", str(free_port()), SCRIPT, str(stage),
                           str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    end = time.time()
    out = proc.stdout + proc.stderr
    stalled = os.path.join(tmp_path, "stalled")
    assert os.path.exists(stalled), out[-3000:]
    with open(stalled) as f:
        t_stall = json.load(f)["t"]
    with open(os.path.join(tmp_path, "error_rank0")) as f:
        t_error = json.load(f)["t"]
    return proc.returncode, out, t_error - t_stall, end - t_error


def _check(stage, tmp_path):
    rc, out, to_error, to_exit = _run(stage, tmp_path)
    assert rc != 0, out[-3000:]
    assert "CollectiveTimeoutError" in out, out[-3000:]
    # the error names the collective and the step (rank 1 stalled in step index 2: global step 2)
    line = next(ln for ln in out.splitlines() if "CollectiveTimeoutError:" in ln)
    assert "did not complete" in line and "at global step 2 (micro step 2)" in line, line
    assert "deepspeed.comm." in line or "collective #" in line, line   # the collective (ZeRO-3: its own name)
    # the error comes at the timeout (not before: rank 0 waited for the stopped rank), and the job
    # (the launcher, hence every rank: it waits for all of them) is down within 2 s after it
    assert to_error >= TIMEOUT_S - 0.5, (to_error, out[-3000:])
    assert to_exit <= 2.0, (to_exit, out[-3000:])
    print(f"stage {stage}: error {to_error:.2f}s after the stall, job down {to_exit:.2f}s after the error")
    return to_error, to_exit


def test_stalled_rank_stage2_named_and_fast(tmp_path):
    """Stage 2: the gradient-bucket wait used to raise gloo's bare 'Timed out waiting ... for recv'."""
    _check(2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_stalled_rank_every_stage(stage, tmp_path):
    _check(stage, tmp_path)
