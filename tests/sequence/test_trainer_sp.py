"""Transformers' Trainer + Accelerate with DeepSpeed sequence parallelism (sp=2) on CPU, against
the same Trainer without it (one process): the logged losses agree step by step, and the logged
gradient norm is sp times the reference's - DeepSpeed's reduction (sum over the sequence ranks)
applied to the Trainer's loss, which averages the ranks' losses through a differentiable
all_gather (docs/sequence_parallel.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.dist import free_port

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_sp_driver.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(sp, out):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={sp}", f"--master_port={free_port()}",
           DRIVER, str(sp), out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.slow
def test_trainer_with_sequence_parallelism_matches_plain_trainer(tmp_path):
    pytest.importorskip("accelerate")
    sp = _launch(2, str(tmp_path / "sp2.json"))
    ref = _launch(1, str(tmp_path / "sp1.json"))
    assert len(sp["losses"]) == len(ref["losses"]) == 3
    assert sp["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert [g / r for g, r in zip(sp["grad_norm"], ref["grad_norm"])] == pytest.approx([2.0] * 3, rel=1e-4)
