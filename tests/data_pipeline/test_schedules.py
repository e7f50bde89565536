"""Schedules against their documented formulas, computed by hand."""
import math

import pytest

from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
from deepspeed.runtime.progressive_layer_drop import ProgressiveLayerDrop


def _sched(stype, **sc):
    return CurriculumScheduler({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": stype,
                                "schedule_config": sc})


def test_fixed_linear_by_hand():
    # d(s) = floor(s/100 * 56 + 8), rounded down to a multiple of 8, capped at 64
    s = _sched("fixed_linear", total_curriculum_step=100, difficulty_step=8)
    expected = {0: 8, 1: 8, 14: 8,   # 14*0.56+8 = 15.84 -> 15 -> 8
                15: 16,              # 16.4 -> 16
                50: 32,              # 36 -> 32
                90: 56,              # 58.4 -> 58 -> 56
                100: 64, 250: 64}
    assert {k: s.get_difficulty(k) for k in expected} == expected


def test_fixed_root_by_hand():
    # d(s) = floor(sqrt(s/100) * 56 + 8), multiple of 8
    s = _sched("fixed_root", total_curriculum_step=100, difficulty_step=8, root_degree=2)
    expected = {1: 8,     # 0.1*56+8 = 13.6 -> 8
                4: 16,    # 0.2*56+8 = 19.2 -> 16
                25: 32,   # 0.5*56+8 = 36 -> 32
                49: 40,   # 0.7*56+8 = 47.2 -> 40
                81: 56,   # 0.9*56+8 = 58.4 -> 56
                100: 64}
    assert {k: s.get_difficulty(k) for k in expected} == expected
    # root_degree 3 at step 8 of 64: (1/8)^(1/3) = 0.5 -> 36 -> 32
    s3 = _sched("fixed_root", total_curriculum_step=64, difficulty_step=8, root_degree=3)
    assert s3.get_difficulty(8) == 32


def test_fixed_discrete_by_hand():
    s = _sched("fixed_discrete", difficulty=[8, 16, 64], max_step=[5, 10])
    assert [s.get_difficulty(k) for k in (1, 5, 6, 10, 11, 1000)] == [8, 8, 16, 16, 64, 64]


def test_custom_and_latch_at_max():
    s = _sched("custom")
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        s.update_difficulty(1)
    s.set_custom_get_difficulty(lambda step: 8 * step)
    assert [s.update_difficulty(k) for k in (1, 2, 8)] == [8, 16, 64]
    assert s.update_difficulty(3) == 64  # once at max_difficulty the schedule is no longer asked


@pytest.mark.parametrize("cfg,match", [
    ({"min_difficulty": 64, "max_difficulty": 8, "schedule_type": "fixed_linear",
      "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}, "min_difficulty"),
    ({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_root",
      "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}, "root_degree"),
    ({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_discrete",
      "schedule_config": {"difficulty": [8, 16], "max_step": [5, 10]}}, "one more entry"),
    ({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "cosine"}, "schedule_type"),
])
def test_bad_schedules_name_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        CurriculumScheduler(cfg)


def test_random_ltd_fixed_linear_and_token_count_by_hand():
    cfg = {"total_layer_num": 4, "random_ltd_layer_num": 2, "global_batch_size": 3,
           "random_ltd_schedule": {"min_value": 10, "max_value": 32, "schedule_type": "fixed_linear",
                                   "schedule_config": {"require_steps": 8, "seq_per_step": 4}}}
    s = RandomLTDScheduler(cfg)
    # v(s) = floor(s/8 * 22 + 10) rounded down to a multiple of 4, capped at 32
    expected = {0: 8, 1: 12, 2: 12, 3: 16, 4: 20, 5: 20, 6: 24, 7: 28, 8: 32, 9: 32, 20: 32}
    assert {k: s.get_value(k) for k in expected} == expected
    total = 0
    for step in range(10):
        s.update_seq(step)
        s.update_seq(step)  # a second micro-batch of the same step counts once
        total += 3 * (expected[step] * 2 + 32 * 2)  # global batch x (kept x LTD layers + full x others)
    assert s.state["consumed_layer_tokens"] == total
    assert s.get_current_seq() == 32
    with pytest.raises(ValueError, match="min_value"):
        RandomLTDScheduler(dict(cfg, random_ltd_schedule=dict(cfg["random_ltd_schedule"], min_value=64)))


def test_pld_theta_follows_the_paper():
    pld = ProgressiveLayerDrop(theta=0.5, gamma=0.01)
    assert pld.get_theta() == 1.0 and pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
    for t in (0, 1, 10, 100, 1000):
        pld.update_state(t)
        assert pld.get_theta() == pytest.approx((1 - 0.5) * math.exp(-0.01 * t) + 0.5, rel=1e-12)
    assert pld.get_theta() == pytest.approx(0.5 + 0.5 * math.exp(-10))
    with pytest.raises(ValueError, match="theta"):
        ProgressiveLayerDrop(theta=-0.1)
    # theta 0 (DeepSpeed accepts it): the keep probability decays towards 0
    zero = ProgressiveLayerDrop(theta=0.0, gamma=0.01)
    zero.update_state(100)
    assert zero.get_theta() == pytest.approx(math.exp(-1.0), rel=1e-12)
