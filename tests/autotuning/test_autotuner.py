"""The autotuner's search over ZeRO stages, micro-batch sizes and knobs, with a fake runner
(the measurement is a known function of the config): memory pruning, the largest micro-batch
that fits first, halving on failure, the chosen config being the best measured, the files it
writes, resuming with overwrite false, and clear errors for bad input."""
import json
import os

import pytest

from deepspeed.autotuning.autotuner import AutotuningError, Autotuner
from deepspeed.config.errors import DeepSpeedConfigError
from deepspeed.launcher import runner as dsrun

from ._fake import FakeRunner, make_autotuner

PSI = 1000                                   # trainable parameters
ACT = 100                                    # activation bytes per sample
MODEL_INFO = {"num_params": PSI, "activation_mem_per_sample": ACT}


def _speed(cfg):
    """Throughput rises with the micro-batch size and the stage's knobs; stage 2 is fastest."""
    z = cfg["zero_optimization"]
    base = {0: 10, 1: 12, 2: 15, 3: 11}[z["stage"]]
    return base * cfg["train_micro_batch_size_per_gpu"] ** 0.5 + (1 if z.get("overlap_comm") else 0) \
        + (0.5 if z.get("reduce_bucket_size") == 5e8 else 0)


def _base(**at):
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": "all"},
            "autotuning": {"model_info": MODEL_INFO, "max_train_micro_batch_size_per_gpu": 64,
                           "num_tuning_micro_batch_sizes": 3, **at}}


def test_memory_pruning_largest_micro_batch_first_and_the_best_config_wins(tmp_path, capsys):
    fake = FakeRunner(_speed, fails=lambda cfg: "exit code 1: RuntimeError: out of memory"
                      if cfg["train_micro_batch_size_per_gpu"] > 20 else None)
    t = make_autotuner(str(tmp_path), _base(fast=True), fake)
    # 2 ranks, fp32 Adam: stage 0 needs 16*PSI = 16000 B of model states, stage 1 4+4+8/2 = 12 per param,
    # stage 2 4 + 12/2 = 10, stage 3 16/2 = 8
    assert [t.get_instantiation_memory_required_per_gpu(s) for s in range(4)] == [16000, 12000, 10000, 8000]
    t.gpu_mem = 14000                                       # stage 0 cannot fit even one sample
    t.tune()
    assert 0 in t.pruned and "needs" in t.pruned[0]
    assert not any(n.startswith("z0_") for n in fake.ran)
    # stage 1: (14000-12000)/100 = 20 fits -> 20 first; stage 2: 40 -> fails (>20) -> 20;
    # stage 3: min(60, 64) = 60 -> fails -> 30 fails -> 15
    assert fake.ran[:2] == ["z1_mbs20", "z1_mbs1"] and "z1_mbs10" in fake.ran
    z2 = [n for n in fake.ran if n.startswith("z2_")]
    assert z2[:2] == ["z2_mbs40", "z2_mbs20"]
    z3 = [n for n in fake.ran if n.startswith("z3_")]
    assert z3[:3] == ["z3_mbs60", "z3_mbs30", "z3_mbs15"]
    failed = [r["name"] for r in t.records if r["error"]]
    assert failed == ["z2_mbs40", "z3_mbs60", "z3_mbs30"]
    assert all("out of memory" in r["error"] for r in t.records if r["error"])
    # the chosen config is the best measured
    ok = [r for r in t.records if r["metric_val"] is not None]
    best = t.get_best_record()
    assert best["metric_val"] == max(r["metric_val"] for r in ok)
    assert best["name"] == "z2_mbs20"
    path = t.write_optimal_config()
    t.print_tuning_results()
    with open(path) as f:
        opt = json.load(f)
    assert "autotuning" not in opt and opt["zero_optimization"]["stage"] == 2
    assert opt["train_micro_batch_size_per_gpu"] == 20
    summary = (tmp_path / "autotuning_results" / "summary.txt").read_text()
    assert "z2_mbs20" in summary and "FAILED" in summary and "ZeRO stage 0 not tuned" in summary
    cmd = (tmp_path / "autotuning_results" / "cmd_optimal.txt").read_text()
    assert "train.py --deepspeed_config" in cmd and path in cmd
    out = capsys.readouterr().out
    assert "experiment 1 of at most" in out and "best so far" in out
    import re
    bounds = {int(m) for m in re.findall(r"of at most (\d+)", out)}
    assert len(bounds) == 1 and len(t.records) <= bounds.pop()          # the bound printed holds
    # one record per experiment, consistent with what the runner returned
    for r in t.records:
        rec = json.loads((tmp_path / "autotuning_results" / r["name"] / "result.json").read_text())
        assert rec["error"] == r["error"]
        if r["metric_val"] is not None:
            assert rec["results"]["throughput"] == pytest.approx(_speed(rec["ds_config"]))
        assert os.path.exists(tmp_path / "autotuning_exps" / f"{r['name']}.json")


def test_knob_tuning_after_the_micro_batch_size_and_tuner_types(tmp_path):
    for kind in ("gridsearch", "random", "model_based"):
        fake = FakeRunner(_speed)
        cfg = _base(fast=False, tuner_type=kind, tuner_num_trials=6, tuner_early_stopping=10,
                    max_train_micro_batch_size_per_gpu=8, num_tuning_micro_batch_sizes=2)
        cfg["zero_optimization"] = {"stage": 2}
        t = make_autotuner(str(tmp_path / kind), cfg, fake)
        t.tune()
        knob_runs = [n for n in fake.ran if n.startswith("z2_mbs8_")]
        assert len(knob_runs) == 6, (kind, fake.ran)                  # tuner_num_trials bounds the knob search
        assert fake.ran[:2] == ["z2_mbs8", "z2_mbs1"]
        best = t.get_best_record()
        assert best["metric_val"] == max(r["metric_val"] for r in t.records)
        if kind == "gridsearch":   # the grid's first 6 of 8 include overlap_comm on with rbs 5e8
            z = best["ds_config"]["zero_optimization"]
            assert z["overlap_comm"] is True and z["reduce_bucket_size"] == 5e8


def test_user_lists_in_zero_optimization_are_the_tuning_space(tmp_path):
    fake = FakeRunner(_speed)
    cfg = _base(fast=False, tuner_type="gridsearch", max_train_micro_batch_size_per_gpu=4,
                num_tuning_micro_batch_sizes=1)
    cfg["zero_optimization"] = {"stage": [1], "reduce_bucket_size": [1e6, 5e8, 2e6]}
    t = make_autotuner(str(tmp_path), cfg, fake)
    t.tune()
    knob = [r for r in t.records if r["space"] == "z1_knobs"]
    # allgather_bucket_size (default space: 2 values) x the user's 3 reduce_bucket_size values
    assert len(knob) == 6
    assert {r["ds_config"]["zero_optimization"]["reduce_bucket_size"] for r in knob} == {1e6, 5e8, 2e6}


def test_overwrite_false_keeps_and_reuses_results_overwrite_true_starts_over(tmp_path):
    fake = FakeRunner(_speed)
    cfg = _base(fast=True, max_train_micro_batch_size_per_gpu=4, num_tuning_micro_batch_sizes=2)
    cfg["zero_optimization"] = {"stage": 0}
    make_autotuner(str(tmp_path), cfg, fake).tune()
    assert fake.ran == ["z0_mbs4", "z0_mbs1"]
    again = FakeRunner(lambda c: pytest.fail("a recorded experiment ran again"))
    t = make_autotuner(str(tmp_path), cfg, again)
    t.tune()
    assert again.ran == [] and t.get_best_record()["name"] == "z0_mbs4"
    assert t.get_best_record()["metric_val"] == pytest.approx(_speed({"train_micro_batch_size_per_gpu": 4,
                                                                      "zero_optimization": {"stage": 0}}))
    cfg["autotuning"]["overwrite"] = True
    third = FakeRunner(_speed)
    make_autotuner(str(tmp_path), cfg, third).tune()
    assert third.ran == ["z0_mbs4", "z0_mbs1"]


def test_model_info_profile_run_feeds_the_memory_model(tmp_path):
    fake = FakeRunner(_speed, model_info={"num_params": 500, "trainable_num_params": 400,
                                          "activation_mem_per_gpu": 300, "train_micro_batch_size_per_gpu": 1})
    cfg = _base(fast=True, max_train_micro_batch_size_per_gpu=2, num_tuning_micro_batch_sizes=1)
    cfg["autotuning"].pop("model_info")
    cfg["zero_optimization"] = {"stage": 0}
    t = make_autotuner(str(tmp_path), cfg, fake)
    t.tune()
    assert fake.ran[0] == "profile_model_info"
    prof = json.loads((tmp_path / "autotuning_exps" / "profile_model_info.json").read_text())
    assert prof["ds_config"]["autotuning"]["model_info"] == {"profile": True}
    assert t.get_model_num_params() == 400 and t.get_activation_memory_per_gpu() == 300
    assert t.get_instantiation_memory_required_per_gpu(0) == 16 * 400


def test_failed_profile_run_is_a_clear_error(tmp_path):
    fake = FakeRunner(_speed)
    fake.model_info = None

    def runner(exp):
        return None, "exit code 1: ImportError: no module named foo"
    cfg = _base()
    cfg["autotuning"].pop("model_info")
    t = make_autotuner(str(tmp_path), cfg, runner)
    with pytest.raises(AutotuningError, match="profile run failed: exit code 1: ImportError"):
        t.tune()


@pytest.mark.parametrize("section,match", [
    ({"metric": "speed"}, r"autotuning\.metric.*'latency', 'throughput' or 'flops'"),
    ({"tuner_type": "bayes"}, r"autotuning\.tuner_type.*gridsearch"),
    ({"start_profile_step": 5, "end_profile_step": 2}, r"end_profile_step \(2\) must not be less"),
    ({"min_train_micro_batch_size_per_gpu": 8, "max_train_micro_batch_size_per_gpu": 4},
     "min_train_micro_batch_size_per_gpu must not exceed"),
    ({"num_tuning_micro_batch_sizes": 0}, r"autotuning\.num_tuning_micro_batch_sizes"),
    ({"tuner_num_trails": 3}, r"Unknown config key 'autotuning\.tuner_num_trails'.*tuner_num_trials"),
])
def test_bad_autotuning_values_are_clear_errors(tmp_path, section, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        make_autotuner(str(tmp_path), {"autotuning": section}, FakeRunner(_speed))


def test_no_micro_batch_size_satisfies_the_batch_limits(tmp_path):
    cfg = _base(max_train_batch_size=4, min_train_micro_batch_size_per_gpu=4)
    cfg["gradient_accumulation_steps"] = 2
    t = make_autotuner(str(tmp_path), cfg, FakeRunner(_speed))
    with pytest.raises(AutotuningError, match="no micro-batch size satisfies min_train_micro_batch_size_per_gpu=4 "
                                              "and max_train_batch_size=4"):
        t.tune()


def test_bad_stage_and_missing_config_file(tmp_path):
    cfg = _base()
    cfg["zero_optimization"] = {"stage": [1, 5]}
    t = make_autotuner(str(tmp_path), cfg, FakeRunner(_speed))
    with pytest.raises(DeepSpeedConfigError, match=r"zero_optimization\.stage must be 0-3"):
        t.tune()
    args = dsrun.parse_args(["--autotuning", "tune", "train.py", "--lr", "1"])
    with pytest.raises(AutotuningError, match="--deepspeed_config ds_config.json"):
        Autotuner(args, {"localhost": [0]})


def test_search_error_reports_the_exception_line(tmp_path):
    from deepspeed.autotuning.utils import search_error
    log = tmp_path / "stderr.log"
    log.write_text("[rank0]: Traceback (most recent call last):\n"
                   "[rank0]:     raise RuntimeError(f\"simulated out of memory: {mbs}\")\n"
                   "[rank0]: RuntimeError: simulated out of memory: 4\n"
                   "UserWarning: unrelated\n")
    assert search_error(str(log)) == "RuntimeError: simulated out of memory: 4"
    log.write_text("all good\n")
    assert search_error(str(log)) is None
