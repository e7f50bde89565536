"""The real thing: ``deepspeed --autotuning tune|run`` on a tiny script. Every experiment is a
launcher subprocess (each imports torch), so the fast test keeps to three of them."""
import glob
import json
import os
import subprocess
import sys

import pytest

BIN = os.path.dirname(sys.executable)
DEEPSPEED = os.path.join(BIN, "deepspeed")
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_tiny.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(cwd, ds_config, launcher_args=(), script_args=(), mode="tune", timeout=600):
    with open(os.path.join(cwd, "ds.json"), "w") as f:
        json.dump(ds_config, f)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [DEEPSPEED, *launcher_args, "--autotuning", mode, SCRIPT, "--deepspeed_config", "ds.json", *script_args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _measured(results_dir):
    """name -> throughput, read from each experiment's own metrics file."""
    out = {}
    for m in glob.glob(os.path.join(results_dir, "z*", "metrics.json")):
        with open(m) as f:
            out[os.path.basename(os.path.dirname(m))] = json.load(f)["throughput"]
    return out


def _check_consistent(res_dir, measured):
    with open(os.path.join(res_dir, "ds_config_optimal.json")) as f:
        opt = json.load(f)
    best = max(measured, key=measured.get)
    with open(os.path.join(res_dir, best, "ds_config.json")) as f:
        best_cfg = json.load(f)
    best_cfg.pop("autotuning")
    assert opt == best_cfg                                    # the fastest measured experiment's config
    summary = open(os.path.join(res_dir, "summary.txt")).read()
    for name in measured:
        assert name in summary
    for d in glob.glob(os.path.join(res_dir, "z*")):
        with open(os.path.join(d, "result.json")) as f:
            rec = json.load(f)
        name = os.path.basename(d)
        assert os.path.exists(os.path.join(os.path.dirname(res_dir), "autotuning_exps", f"{name}.json"))
        if rec["error"] is None:
            assert rec["results"]["throughput"] == pytest.approx(measured[name])
    return opt, best


@pytest.mark.slow   # make test budget: a whole-script run (~12-21 s); make test-all runs it
def test_autotuning_run_tunes_then_trains_with_the_fastest_config(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 0},
           "autotuning": {"enabled": True, "fast": True, "start_profile_step": 1, "end_profile_step": 2,
                          "num_tuning_micro_batch_sizes": 2, "max_train_micro_batch_size_per_gpu": 8,
                          # given, so the fast test skips the profile run (the slow test makes it)
                          "model_info": {"num_params": 2372, "activation_mem_per_sample": 408}}}
    out = tmp_path / "trained.json"
    r = _run(str(tmp_path), cfg, script_args=["--steps", "4", "--out", str(out)], mode="run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = str(tmp_path / "autotuning_results")
    measured = _measured(res)
    assert sorted(measured) == ["z0_mbs1", "z0_mbs8"]        # the largest that fits first, then the low end
    opt, best = _check_consistent(res, measured)
    assert "experiment 2 of at most" in r.stdout and "best so far" in r.stdout
    # --autotuning run: the script trained to the end with the optimal config
    trained = json.load(open(out))
    assert trained["config"] == os.path.join(res, "ds_config_optimal.json")
    assert trained["micro_batch"] == opt["train_micro_batch_size_per_gpu"] and trained["steps"] == 4


@pytest.mark.slow
@pytest.mark.timeout(1600)   # eleven two-rank experiments, each a launcher subprocess
def test_autotuning_two_ranks_stages_knobs_and_a_crashing_micro_batch(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": [1, 3]},
           "autotuning": {"enabled": True, "fast": False, "tuner_type": "gridsearch", "tuner_num_trials": 2,
                          "start_profile_step": 1, "end_profile_step": 2, "num_tuning_micro_batch_sizes": 2,
                          "max_train_micro_batch_size_per_gpu": 4}}
    r = _run(str(tmp_path), cfg, launcher_args=["--num_gpus", "2"], script_args=["--crash_above_mbs", "2"],
             timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = str(tmp_path / "autotuning_results")
    info = json.load(open(os.path.join(res, "profile_model_info", "model_info.json")))
    assert info["num_params"] == 32 * 64 + 64 + 64 * 4 + 4 and info["activation_mem_per_gpu"] > 0
    for stage in (1, 3):
        rec = json.load(open(os.path.join(res, f"z{stage}_mbs4", "result.json")))
        assert "RuntimeError: simulated out of memory" in rec["error"]   # recorded and skipped
        assert not os.path.exists(os.path.join(res, f"z{stage}_mbs4", "metrics.json"))
        knobs = glob.glob(os.path.join(res, f"z{stage}_mbs*_*"))   # knob experiments at the stage's best size
        assert len(knobs) == 2                                   # tuner_num_trials
    measured = _measured(res)
    assert {"z1_mbs2", "z1_mbs1", "z3_mbs2", "z3_mbs1"} <= set(measured)
    for name in measured:
        m = json.load(open(os.path.join(res, name, "metrics.json")))
        assert m["world_size"] == 2 and m["train_batch_size"] == 2 * m["train_micro_batch_size_per_gpu"]
    _check_consistent(res, measured)
    assert "FAILED" in open(os.path.join(res, "summary.txt")).read()
