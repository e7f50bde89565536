"""examples/train_gpt_pipe.py runs through the real `deepspeed` launcher (pp=2, short run)."""
import json
import os
import subprocess
import sys
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.slow   # make test budget: a whole-script run (~12-21 s); make test-all runs it
def test_train_gpt_pipe_short_run(tmp_path):
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_procs", "2", "--master_port", "0", os.path.join(ROOT, "examples", "train_gpt_pipe.py"),
           "--stages", "2", "--steps", "12", "--ctx", "32", "--d_model", "32", "--n_layer", "2",
           "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert summary["stages"] == 2 and summary["steps"] == 12
    assert summary["loss_last"] < summary["loss_first"]
    files = sorted(os.listdir(summary["checkpoint"]))
    # embedding, 2 blocks, final LayerNorm, LM head: one file per layer
    assert [f for f in files if f.startswith("layer_")] == [f"layer_{i:02d}-model_states.pt" for i in range(5)]
    assert any(f.startswith("pipe_stage_01-zero_pp_rank_0") for f in files)
