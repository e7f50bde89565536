"""Monitors: a short training run with TensorBoard, W&B (offline) and CSV on, read
back with each tool's own reader; client events; the missing-package hint; only
global rank 0 writes."""
import os
import time
import re

import pytest
import torch

import deepspeed
from deepspeed.monitor import MonitorMaster
from deepspeed.monitor.comet import CometMonitor
from tests.helpers.dist import run_distributed
from tests.helpers.models import make_model
from tests.monitor._readers import csv_series, tensorboard_scalars, wandb_history

MB, STEPS = 4, 3


def _config(out, gas=1, fp16=False, world_size=1):
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                        "warmup_num_steps": 4, "warmup_type": "linear"}},
           "steps_per_print": 100, "wall_clock_breakdown": True,
           "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb_job"},
           "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv_job"}}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _train(engine, steps, gas, seed=0):
    """Run ``steps`` optimizer steps; per step the mean micro-batch loss, the lr after the
    step and the sample count, computed here independently of the monitors."""
    g = torch.Generator().manual_seed(seed)
    expected = []
    for _ in range(steps):
        losses = []
        for _ in range(gas):
            x, y = torch.randn(MB, 8, generator=g), torch.randn(MB, 4, generator=g)
            if engine.config_obj.fp16_enabled:
                x, y = x.half(), y.half()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        expected.append((engine.global_samples, sum(losses) / gas, engine.get_lr()[0]))
    return expected


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_root"))
    (tmp_path / "wandb_root").mkdir()
    return tmp_path / "wandb_root"


def test_all_monitors_write_the_standard_events(tmp_path, wandb_offline):
    out = str(tmp_path / "logs")
    cfg = _config(out, gas=2)
    cfg["wandb"] = {"enabled": True, "project": "ds_test", "group": "g"}
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    assert engine.monitor.enabled and engine.monitor.tb_monitor and engine.monitor.wandb_monitor
    expected = _train(engine, STEPS, gas=2)
    engine.eval()
    engine(torch.randn(MB, 8))  # an evaluation forward: not timed, writes nothing
    engine.train()
    engine.monitor.write_events([("Client/my_metric", 7.5, engine.global_samples)])
    engine.monitor.close()

    samples = [s for s, _, _ in expected]
    assert samples == [8, 16, 24]  # MB * gas * world per step
    # TensorBoard, read by tensorboard's own EventAccumulator.
    tb = tensorboard_scalars(os.path.join(out, "tb_job"))
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/elapsed_time_ms_forward",
            "Train/Samples/elapsed_time_ms_backward", "Train/Samples/elapsed_time_ms_step",
            "Client/my_metric"} <= set(tb)
    assert "Train/Samples/loss_scale" not in tb  # fp32 run
    assert [s for s, _ in tb["Train/Samples/train_loss"]] == samples
    for (s, v), (_, loss, lr) in zip(tb["Train/Samples/train_loss"], expected):
        assert v == pytest.approx(loss, rel=1e-6)
    assert [v for _, v in tb["Train/Samples/lr"]] == pytest.approx([lr for _, _, lr in expected])
    assert expected[0][2] != expected[-1][2]  # warm-up: the lr really changes between steps
    assert all(v > 0 for _, v in tb["Train/Samples/elapsed_time_ms_forward"])
    assert tb["Client/my_metric"] == [(24, 7.5)]
    # W&B offline run, decoded with wandb's protobuf records.
    # wandb's writer process may still be flushing the log after finish() returns on a loaded box.
    deadline = time.monotonic() + 30
    while True:
        rows = [r for r in wandb_history(str(wandb_offline)) if "Train/Samples/train_loss" in r]
        if len(rows) >= len(samples) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [r["_step"] for r in rows] == samples
    assert [r["Train/Samples/train_loss"] for r in rows] == pytest.approx([l for _, l, _ in expected], rel=1e-6)
    lr_rows = [r for r in wandb_history(str(wandb_offline)) if "Train/Samples/lr" in r]
    assert [r["Train/Samples/lr"] for r in lr_rows] == pytest.approx([lr for _, _, lr in expected])
    # CSV: DeepSpeed's layout, one file per metric.
    header, series = csv_series(os.path.join(out, "csv_job", "Train_Samples_train_loss.csv"))
    assert header == ["step", "train_loss"]
    assert [s for s, _ in series] == samples
    assert [v for _, v in series] == pytest.approx([l for _, l, _ in expected], rel=1e-6)
    _, client = csv_series(os.path.join(out, "csv_job", "Client_my_metric.csv"))
    assert client == [(24, 7.5)]


def test_fp16_writes_loss_scale_and_loss_equals_engine_loss(tmp_path):
    out = str(tmp_path)
    cfg = dict(_config(out, fp16=True), wall_clock_breakdown=False)
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    expected = _train(engine, 2, gas=1)
    engine.monitor.close()
    tb = tensorboard_scalars(os.path.join(out, "tb_job"))
    assert set(tb) == {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale"}  # no timings
    assert tb["Train/Samples/loss_scale"] == [(4, 256.0), (8, 256.0)]
    assert [v for _, v in tb["Train/Samples/train_loss"]] == pytest.approx([l for _, l, _ in expected], rel=1e-3)


def test_monitor_master_from_config_and_bad_events(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig
    cfg = DeepSpeedConfig({"train_batch_size": 2, "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                                                  "job_name": "j"}})
    mon = MonitorMaster(cfg.monitor_config)  # the documented custom-monitor usage
    mon.write_events([("Time per step", 0.25, 2), ("Time per step", torch.tensor(0.5), 4)])
    assert csv_series(str(tmp_path / "j" / "Time_per_step.csv")) == (["step", "Time per step"], [(2, 0.25), (4, 0.5)])
    with pytest.raises(ValueError, match=r"\(name: str, value, step\) 3-tuple"):
        mon.write_events([("only_two", 1.0)])
    assert not MonitorMaster({"train_batch_size": 2}).enabled


def test_missing_comet_package_names_the_pip_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "comet_ml", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="pip install comet_ml"):
        CometMonitor({"comet": {"enabled": True, "project": "p"}})
    with pytest.raises(ImportError, match="pip install comet_ml"):
        deepspeed.initialize(model=make_model(), config={"train_batch_size": 2, "comet": {"enabled": True}})


def _two_ranks(rank, world_size, out):
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(out))
    _train(engine, 2, gas=1, seed=rank)
    engine.monitor.write_events([("Client/rank", float(rank), engine.global_samples)])
    engine.monitor.close()
    # The flops profiler under ZeRO-3 (sharing this process group): rank 0 profiles the
    # full model (partitioned parameters counted at their full size) and writes the file.
    model = make_model()
    cfg = {"train_micro_batch_size_per_gpu": MB, "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
           "zero_optimization": {"stage": 3}, "steps_per_print": 0,
           "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": os.path.join(out, f"flops{rank}.txt")}}
    z3, *_ = deepspeed.initialize(model=model, config=cfg)
    _train(z3, 2, gas=1, seed=rank)
    z3.destroy()
    return engine.monitor.backends != []


def test_only_global_rank_zero_writes(tmp_path):
    """Monitors, and the flops profile at ZeRO-3, are written by global rank 0 only."""
    out = str(tmp_path)
    has_backends = run_distributed(_two_ranks, world_size=2, args=(out,), timeout=180)
    assert has_backends == [True, False]
    assert not os.path.exists(os.path.join(out, "flops1.txt"))
    text = open(os.path.join(out, "flops0.txt")).read()
    # TinyMLP(8, 16, 4): 212 parameters; forward MACs = MB * (8*16 + 16*4); tanh: MB * 16 FLOPs
    assert re.search(r"params per GPU:\s+212\n", text)
    assert re.search(r"fwd MACs per GPU:\s+768 MACs\n", text)
    assert re.search(r"fwd flops per GPU:\s+1\.6 K\n", text)  # 2 * 768 + 64 = 1600
    tb_dir = os.path.join(out, "tb_job")
    assert len([f for f in os.listdir(tb_dir) if f.startswith("events.out.tfevents")]) == 1
    tb = tensorboard_scalars(tb_dir)
    assert tb["Client/rank"] == [(16, 0.0)]  # 2 ranks x MB per step
    assert [s for s, _ in tb["Train/Samples/train_loss"]] == [8, 16]
    _, rows = csv_series(os.path.join(out, "csv_job", "Client_rank.csv"))
    assert rows == [(16, 0.0)]


def test_comet_calls_with_a_stand_in_module(monkeypatch):
    """comet_ml is not installed here: a stand-in module records what CometMonitor asks of
    it (this checks our use of its API - start() with DeepSpeed's six keyword arguments, set_name,
    log_metric with the samples_log_interval throttle - not Comet itself)."""
    import sys
    import types
    calls = {}

    class Experiment:
        def __init__(self):
            self.logged = []

        def set_name(self, name):
            calls.setdefault("names", []).append(name)

        def log_metric(self, name, value, step=None):
            self.logged.append((name, value, step))

        def end(self):
            calls["ended"] = True

    fake = types.ModuleType("comet_ml")
    fake.start = lambda **kw: calls.setdefault("start", (kw, Experiment()))[1]
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    mon = CometMonitor({"comet": {"enabled": True, "project": "p", "workspace": "w", "samples_log_interval": 10,
                                  "experiment_name": "exp", "online": False}})
    kw, exp = calls["start"]
    assert kw == {"api_key": None, "project": "p", "workspace": "w", "experiment_key": None, "mode": None,
                  "online": False}
    assert calls["names"] == ["exp"]
    mon.write_events([("loss", 1.0, 4), ("loss", 0.9, 8), ("loss", 0.8, 14), ("lr", 0.1, 8), ("loss", 0.7, 24)])
    assert exp.logged == [("loss", 1.0, 4), ("loss", 0.8, 14), ("lr", 0.1, 8), ("loss", 0.7, 24)]
    mon.close()
    assert calls["ended"]
