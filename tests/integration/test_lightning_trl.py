"""The REAL PyTorch Lightning ``DeepSpeedStrategy`` and TRL ``SFTTrainer`` run on this package.

One ``torchrun`` launch of 2 CPU processes (``lightning_trl_driver.py``; start-up and
imports paid once) runs, at ZeRO stages 2 and 3:

* Lightning: ``fit`` (4 steps, a DeepSpeed checkpoint directory saved by ``ModelCheckpoint``
  at step 2), ``fit(ckpt_path=...)`` from a differently initialised model, and on rank 0
  ``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`` then
  ``LightningModule.load_from_checkpoint`` on its output. Lightning reads our checkpoint
  files directly there (``optimizer_state_dict["zero_stage"]`` in the optim-states file, its
  own ``epoch`` / ``global_step`` / ``hyper_parameters`` at the top level of the model-states
  file). Lightning refuses DeepSpeed on CPU by itself; the driver's ``lightning_cpu_shim``
  patches exactly two Lightning functions (see its docstring), nothing of ours.
* TRL: ``SFTTrainer`` 4 steps saving ``checkpoint-2``, and ``resume_from_checkpoint`` in a
  new trainer; at stage 3 with an untied head, so TRL's fused LM-head loss reads
  ``lm_head.weight`` inside the model's forward (a parameter used outside its module).

References: Lightning's losses against plain PyTorch AdamW on the same global batches
(computed here), resumed runs against the uninterrupted ones (same later losses, same
parameters), the converted fp32 weights against the parameters gathered at step 2.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("lightning")
pytest.importorskip("trl")

pytestmark = pytest.mark.timeout(900)

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "lightning_trl_driver.py")
BIN = os.path.dirname(sys.executable)


def _launch(work, *extra, timeout=600):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(work, "result.json")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")]))
    env.pop("ACCELERATE_USE_DEEPSPEED", None)
    cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(port), DRIVER,
           "--out", out, "--work", work, *extra]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"driver timed out after {timeout}s:\n{(err.stdout or '')[-3000:]}{(err.stderr or '')[-3000:]}")
    if proc.returncode != 0 or not os.path.exists(out):
        pytest.fail(f"driver failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(str(tmp_path_factory.mktemp("lightning_trl")), "--part", "lightning,trl", "--stages", "2,3")


def _ok(results, name):
    r = results.get(name)
    assert r is not None, f"{name} did not run"
    assert r["ok"], f"{name} failed: {r['error']}\n{r['traceback']}"
    return r


def _plain_lightning_losses():
    """The driver's LightningModule trained by plain PyTorch AdamW on the full 8-sample batch
    (the global batch of every step of the 2-rank run)."""
    import torch
    torch.manual_seed(0)   # the driver's LitRegressor(seed=0).net, built without Lightning
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.0)
    g = torch.Generator().manual_seed(3)   # the driver's lightning_samples()
    x = torch.randn(8, 8, generator=g)
    y = torch.stack([x[:, :4].sum(1), x[:, 4:].sum(1), (x[:, 0] * x[:, 1]), x[:, 2] - x[:, 3]], 1) * 0.5
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {f"net.{n}": p.detach() for n, p in net.named_parameters()}


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_deepspeed_strategy_fit_resume_convert(results, stage):
    import torch
    r = _ok(results, f"lightning_z{stage}")
    assert r["engine"] == "deepspeed.runtime.engine"
    ref_losses, ref_params = _plain_lightning_losses()
    assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), (r["losses"], ref_losses)
    assert r["losses"][-1] < r["losses"][0] * 0.6
    for n, p in ref_params.items():
        torch.testing.assert_close(torch.tensor(r["params"][n]), p, rtol=1e-5, atol=1e-6, msg=n)
    # the DeepSpeed checkpoint directory Lightning saved, in DeepSpeed's layout
    assert r["ckpt_files"] == ["checkpoint", "latest", "zero_to_fp32.py"]
    names = ({"mp_rank_00_model_states.pt"} if stage == 2 else
             {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"})
    assert names | {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} \
        <= set(r["ckpt_tag_files"])
    # fit(ckpt_path=...) continues exactly: the same losses and parameters as the uninterrupted run
    assert r["resumed_global_step"] == 4
    assert r["resumed_losses"] == r["losses"][2:]
    assert r["resumed_params_diff"] == 0.0
    # Lightning's converter read our files: its client state sat at the top level
    assert r["converted_epoch_step"] == [1, 2]
    assert {"epoch", "global_step", "hyper_parameters", "pytorch-lightning_version", "loops"} <= set(
        r["converted_keys"])
    assert r["converted_diff"] == 0.0 and r["load_from_checkpoint_diff"] == 0.0
    assert r["loaded_hparams"] == {"seed": 0, "lr": 0.02}


@pytest.mark.parametrize("stage", [2, 3])
def test_trl_sft_trainer_trains_and_resumes(results, stage):
    r = _ok(results, f"trl_z{stage}_{'tied' if stage == 2 else 'untied'}")
    assert r["engine"] == "deepspeed.runtime.engine"
    assert r["steps"] == [1, 2, 3, 4] and all(math.isfinite(x) for x in r["losses"])
    assert r["losses"][-1] < r["losses"][0] - 0.3, r["losses"]
    assert "global_step2" in r["checkpoint_files"] and "zero_to_fp32.py" in r["checkpoint_files"]
    # resume_from_checkpoint continues exactly: steps 3-4 give the same losses and parameters
    assert r["resumed_steps"] == [3, 4]
    assert r["resumed_losses"] == r["losses"][2:]
    assert r["resumed_params_diff"] == 0.0
    if stage == 3:   # the fused loss's read of lm_head.weight made it an external parameter of the model
        assert r["lm_head_external"] is True


@pytest.mark.slow
def test_trl_sft_trainer_tied_and_untied_at_both_stages(tmp_path):
    res = _launch(str(tmp_path), "--part", "trl", "--stages", "2,3", "--tied-too")
    for name in ("trl_z2_untied", "trl_z2_tied", "trl_z3_untied", "trl_z3_tied"):
        r = _ok(res, name)
        assert r["losses"][-1] < r["losses"][0] - 0.3, (name, r["losses"])
        assert r["resumed_steps"] == [3, 4] and r["resumed_losses"] == r["losses"][2:], name
        assert r["resumed_params_diff"] == 0.0, name
