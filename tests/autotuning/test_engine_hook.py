"""Inside an experiment: the engine measures the profiling window, writes the metric file
and stops at DeepSpeed's exit point; the model-info run counts parameters and activation
bytes. Checked against hand-computed values on a known MLP."""
import json

import pytest
import torch

import deepspeed

D_IN, D_H, D_OUT = 32, 64, 4


def _engine(at, mbs=2, gas=1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, D_H), torch.nn.ReLU(), torch.nn.Linear(D_H, D_OUT))
    cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "autotuning": {"enabled": True, **at}}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _train(engine, steps, mbs):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(mbs, D_IN, generator=g)
            y = torch.randint(0, D_OUT, (mbs, ), generator=g)
            engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
            engine.step()


def test_metric_file_is_written_after_the_window_and_the_run_stops(tmp_path):
    path = tmp_path / "metrics.json"
    mbs, gas = 3, 2
    eng = _engine({"start_profile_step": 1, "end_profile_step": 3, "metric_path": str(path), "metric": "flops"},
                  mbs=mbs, gas=gas)
    with pytest.raises(SystemExit) as stop:
        _train(eng, 10, mbs)
    assert stop.value.code == 0
    assert eng.global_steps == 4                                  # steps 0..3 ran, DeepSpeed's end+1 exit point
    m = json.loads(path.read_text())
    times = m["step_times_s"]
    assert len(times) == 3                                        # steps 1, 2, 3
    mean_s = sum(times) / 3
    assert m["latency"] == pytest.approx(mean_s * 1000)
    assert m["throughput"] == pytest.approx(mbs * gas / mean_s)   # train_batch_size = 3 * 2 * 1 rank
    # forward FLOPs of one micro-batch: two matmuls, 2*m*k*n each; x3 for forward + backward, x gas
    fwd = 2 * mbs * (D_IN * D_H + D_H * D_OUT)
    assert m["flops"] == pytest.approx(3 * fwd * gas / mean_s) and m["FLOPS_per_gpu"] == m["flops"]
    assert (m["train_batch_size"], m["gradient_accumulation_steps"]) == (6, 2)


def test_model_info_run_counts_parameters_and_activation_bytes(tmp_path):
    path = tmp_path / "model_info.json"
    mbs = 3
    eng = _engine({"model_info": {"profile": True}, "model_info_path": str(path)}, mbs=mbs)
    with pytest.raises(SystemExit):
        _train(eng, 2, mbs)
    assert eng.global_steps == 0                                 # stopped before the first backward
    info = json.loads(path.read_text())
    n = D_IN * D_H + D_H + D_H * D_OUT + D_OUT
    assert info["num_params"] == info["trainable_num_params"] == n
    # saved for backward: the input x (first matmul), ReLU's output (also the second matmul's
    # input: one storage), log_softmax's output, the int64 targets and nll_loss's total_weight
    expected = 4 * mbs * D_IN + 4 * mbs * D_H + 4 * mbs * D_OUT + 8 * mbs + 4
    assert info["activation_mem_per_gpu"] == expected
    assert info["activation_mem_per_sample"] == pytest.approx(expected / mbs)


def test_disabled_autotuning_does_not_stop_training(tmp_path):
    eng = _engine({"enabled": False, "start_profile_step": 0, "end_profile_step": 1, "metric_path": str(tmp_path / "m.json")})
    _train(eng, 4, 2)
    assert eng.global_steps == 4 and not (tmp_path / "m.json").exists()
