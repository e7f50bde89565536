"""The demo script runs end to end through the real `deepspeed` launcher (short run)."""
import json
import os
import subprocess
import sys
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow   # make test budget: a whole-script run (~12-21 s); make test-all runs it
def test_demo_short_run(tmp_path):
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_procs", "2", "--master_port", "0",
           os.path.join(ROOT, "examples", "train_gpt.py"), "--deepspeed",
           "--deepspeed_config", os.path.join(ROOT, "examples", "ds_config.json"),
           "--steps", "30", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("{")))
    assert summary["world_size"] == 2 and summary["steps"] == 30
    assert summary["loss_last20"] < summary["loss_first20"]
    assert (tmp_path / "demo_loss.png").stat().st_size > 1000
    assert (tmp_path / "demo_ckpt" / "latest").read_text() == "global_step15"
    # TensorBoard logs (examples/ds_config.json), read back with tensorboard's own reader
    from tests.monitor._readers import tensorboard_scalars
    tb = tensorboard_scalars(str(tmp_path / "tensorboard" / "train_gpt"))
    assert [s for s, _ in tb["Train/Samples/train_loss"]] == [32 * (i + 1) for i in range(30)]  # 16 x 2 ranks
