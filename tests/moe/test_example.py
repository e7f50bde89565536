"""examples/train_moe.py runs through the real launcher (short run): two MoE layers with
different expert counts (PR-MoE pyramid, residual), ep 2, ZeRO-2, checkpoint and resume."""
import json
import os
import subprocess
import sys
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow   # make test budget: a whole-script run (~12-21 s); make test-all runs it
def test_train_moe_example_short_run(tmp_path):
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_procs", "2", "--master_port", "0", os.path.join(ROOT, "examples", "train_moe.py"),
           "--deepspeed", "--deepspeed_config", os.path.join(ROOT, "examples", "moe_config.json"),
           "--steps", "16", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert summary["world_size"] == 2 and summary["ep_size"] == 2 and summary["zero_stage"] == 2
    assert summary["loss_last"] < summary["loss_first"]
    # layer 0 has 2 experts, layer 1 has 4: one file per global expert
    assert summary["expert_files"] == [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(2)] + \
        [f"layer_1_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)]
