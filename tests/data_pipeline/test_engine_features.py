"""The techniques through the engine: forward keywords, schedules, checkpoints, bad input,
and a small GPT that learns with every feature on at ZeRO stages 0-2."""
import copy
import csv
import math
import os

import pytest
import torch

import deepspeed
from deepspeed.config import DeepSpeedConfigError
from deepspeed.runtime.data_pipeline.data_routing import convert_to_random_ltd

from .tiny_gpt import Block, TinyGPT, counting_batches

BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4, "max_difficulty": 16,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 2}}
PLD = {"enabled": True, "theta": 0.5, "gamma": 0.1}
LTD = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
    "enabled": True, "total_layer_num": 3, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
    "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
    "random_ltd_schedule": {"min_value": 6, "max_value": 15, "schedule_type": "fixed_linear",
                            "schedule_config": {"require_steps": 8, "seq_per_step": 3}}}}}
EIGEN = {"enabled": True, "layer_name": "layers", "layer_num": 3, "max_iter": 5, "tol": 1e-2}


def _engine(seed=0, stage=0, **sections):
    torch.manual_seed(seed)
    cfg = copy.deepcopy(dict(BASE, zero_optimization={"stage": stage}, **sections))
    engine, *_ = deepspeed.initialize(model=TinyGPT(), config=cfg)
    return engine


def _fixed_linear(step, lo=4, hi=16, total=6, q=2):
    d = math.floor(step / total * (hi - lo) + lo)
    return min(hi, d - d % q)


def test_engine_passes_curriculum_seqlen_and_pld_theta():
    e = _engine(curriculum_learning=CURRICULUM, progressive_layer_drop=PLD)
    batches = counting_batches(8, 4)
    theta = lambda t: 0.5 * math.exp(-0.1 * t) + 0.5  # noqa: E731
    for k in range(8):
        e.backward(e(batches[k]))
        e.step()
        call = e.module.calls[-1]
        assert call["curriculum_seqlen"] == _fixed_linear(k + 1)  # step k+1's difficulty, before its forward
        assert call["progressive_layer_drop"] is True
        assert call["pld_theta"] == pytest.approx(1.0 if k == 0 else theta(k - 1))  # updated at each boundary
        assert e.get_pld_theta() == pytest.approx(theta(k))
    e.eval()
    e(batches[0])
    assert e.module.calls[-1] == {"curriculum_seqlen": None, "progressive_layer_drop": False, "pld_theta": 1.0,
                                  "seq": 16}


def test_custom_legacy_schedule():
    e = _engine(curriculum_learning=dict(CURRICULUM, schedule_type="custom", schedule_config={}))
    e.set_custom_curriculum_learning_schedule(lambda step: 2 + 2 * step)
    for k in range(3):
        e.backward(e(counting_batches(1, 4, seed=k)[0]))
        e.step()
    assert [c["curriculum_seqlen"] for c in e.module.calls] == [4, 6, 8]
    off = _engine()
    with pytest.raises(ValueError, match="schedule_type 'custom'"):
        off.set_custom_curriculum_learning_schedule(lambda s: 4)


def test_checkpoint_resume_restores_scheduler_state_exactly(tmp_path):
    # gamma small: theta stays near 1, so no layer is dropped (a parameter skipped by a dropped layer
    # keeps a smaller Adam step count, which the optimizer-state resume does not restore per parameter)
    pld = dict(PLD, gamma=1e-4)
    sections = dict(curriculum_learning=CURRICULUM, progressive_layer_drop=pld, data_efficiency=LTD)
    a = _engine(**sections)
    convert_to_random_ltd(a, Block)
    batches = counting_batches(8, 4)
    for k in range(3):
        a.backward(a(batches[k]))
        a.step()
    a.save_checkpoint(str(tmp_path), tag="t", client_state={"mine": 7})
    b = _engine(seed=5, **sections)
    convert_to_random_ltd(b, Block)
    _, client_state = b.load_checkpoint(str(tmp_path), tag="t")
    assert client_state == {"mine": 7}  # the features' entries are not handed back as client state
    assert b.curriculum_scheduler_legacy.state_dict() == a.curriculum_scheduler_legacy.state_dict()
    assert b.get_pld_theta() == a.get_pld_theta() != 1.0
    assert b.random_ltd_scheduler.state_dict() == a.random_ltd_scheduler.state_dict()
    assert b.random_ltd_scheduler.state_dict()["consumed_layer_tokens"] > 0
    for e in (a, b):
        torch.manual_seed(11)
        e.backward(e(batches[3]))
        e.step()
    assert {k: v for k, v in b.module.calls[-1].items()} == a.module.calls[-1]
    assert b.random_ltd_scheduler.state_dict() == a.random_ltd_scheduler.state_dict()
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(p, q)


def test_bad_input_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="eigenvalue.layer_name 'bert.encoder.layer'"):
        _engine(eigenvalue=dict(EIGEN, layer_name="bert.encoder.layer"))
    with pytest.raises(DeepSpeedConfigError, match="min_difficulty"):
        _engine(curriculum_learning=dict(CURRICULUM, min_difficulty=32))
    metric = {"index_to_sample_path": str(tmp_path / "missing"), "index_to_metric_path": str(tmp_path / "m"),
              "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 1,
              "max_difficulty": 4, "schedule_type": "fixed_linear",
              "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 1}}
    de = {"enabled": True, "data_sampling": {"enabled": True, "curriculum_learning": {
        "enabled": True, "data_cluster_path": str(tmp_path), "curriculum_metrics": {"seqlen": metric}}}}
    with pytest.raises(FileNotFoundError, match="curriculum_metrics.seqlen.index_to_sample_path"):
        _engine(data_efficiency=de)
    e = _engine(data_efficiency=LTD)
    with pytest.raises(ValueError, match="random_ltd_layer_id"):
        e.random_ltd_initialize()  # no layer converted


def _train(e, steps, seed=1):
    batches = counting_batches(steps, 4, seed=seed)
    losses = []
    for k in range(steps):
        loss = e(batches[k])
        e.backward(loss)
        e.step()
        losses.append(loss.item())
    return losses


# stage 0 in make test; stages 1 and 2 in make test-all (the two-rank sampling test trains at stage 2)
@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_small_gpt_learns_with_every_feature_on(stage, tmp_path):
    mon = {"enabled": True, "output_path": str(tmp_path), "job_name": "ev"}
    e = _engine(stage=stage, curriculum_learning=CURRICULUM, progressive_layer_drop=PLD, data_efficiency=LTD,
                eigenvalue=dict(EIGEN, gas_boundary_resolution=5), csv_monitor=mon)
    convert_to_random_ltd(e, Block)
    losses = _train(e, 25)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.6 * first, (stage, losses)
    assert e.random_ltd_scheduler.get_current_seq() == 15 and e.get_pld_theta() < 0.6
    assert len(e.eigenvalue.last_eigenvalues) == 3 and e.block_eigenvalue
    with open(os.path.join(tmp_path, "ev", "Train_Eigenvalues_ModelBlockParam_0.csv")) as f:
        rows = list(csv.reader(f))
    assert [int(r[0]) for r in rows[1:]] == [20, 40, 60, 80, 100]  # every 5th step, at global_samples
    assert all(0.0 < float(r[1]) <= 1.0 for r in rows[1:])


@pytest.mark.slow
def test_small_gpt_learns_at_stage3_and_eigenvalue_is_refused_there():
    with pytest.raises(ValueError, match="eigenvalue: not available with zero_optimization.stage 3"):
        _engine(stage=3, eigenvalue=EIGEN)
    e = _engine(stage=3, curriculum_learning=CURRICULUM, progressive_layer_drop=PLD, data_efficiency=LTD)
    convert_to_random_ltd(e, Block)
    losses = _train(e, 25)
    assert sum(losses[-3:]) < 0.6 * sum(losses[:3]), losses
    assert e.random_ltd_scheduler.get_current_seq() == 15
