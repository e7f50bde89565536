"""LR schedules: values at chosen iterations equal hand computations from the documented formulas.

Convention (DeepSpeed's): ``last_batch_iteration`` starts at -1; the value set at
construction is the one for -1; the n-th ``step()`` sets the value for n - 1.
"""
import io
import math

import pytest
import torch

from deepspeed.config.errors import DeepSpeedConfigError
from deepspeed.runtime.lr_schedules import (VALID_LR_SCHEDULES, LRRangeTest, OneCycle, WarmupCosineLR,
                                            WarmupDecayLR, WarmupLR, build_lr_scheduler, get_torch_optimizer,
                                            validate_scheduler_config)


def adam(lr=0.1, groups=1):
    return torch.optim.Adam([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)], lr=lr)


def trace(sched, last_iteration):
    """{iteration: lr of group 0} for iterations -1 .. last_iteration, by stepping."""
    out = {-1: sched.optimizer.param_groups[0]["lr"]}
    for it in range(last_iteration + 1):
        sched.step()
        assert sched.last_batch_iteration == it
        out[it] = sched.optimizer.param_groups[0]["lr"]
        assert sched.get_last_lr()[0] == out[it]
    return out


def check(values, expected):
    for it, want in expected.items():
        assert values[it] == pytest.approx(want, rel=1e-12, abs=1e-15), f"iteration {it}"


def test_valid_schedules_list():
    assert VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


# ------------------------------------------------------------------ WarmupLR / WarmupDecayLR

def test_warmup_lr_log():
    s = WarmupLR(adam(), warmup_min_lr=0.01, warmup_max_lr=0.11, warmup_num_steps=4, warmup_type="log")
    # lr = 0.01 + 0.1 * log(it + 1) / log(4)
    check(trace(s, 10), {-1: 0.01, 0: 0.01, 1: 0.06, 2: 0.01 + 0.1 * 0.7924812503605781, 3: 0.11, 4: 0.11,
                         10: 0.11})


def test_warmup_lr_linear():
    s = WarmupLR(adam(), warmup_min_lr=0.01, warmup_max_lr=0.11, warmup_num_steps=4, warmup_type="linear")
    check(trace(s, 6), {-1: 0.01, 0: 0.01, 1: 0.035, 2: 0.06, 3: 0.085, 4: 0.11, 6: 0.11})


def test_warmup_length_one_is_two_and_zero_is_none():
    s = WarmupLR(adam(), warmup_min_lr=0.0, warmup_max_lr=0.2, warmup_num_steps=1, warmup_type="linear")
    check(trace(s, 3), {0: 0.0, 1: 0.1, 2: 0.2})
    s = WarmupLR(adam(), warmup_min_lr=0.0, warmup_max_lr=0.2, warmup_num_steps=0)
    check(trace(s, 2), {-1: 0.2, 0: 0.2, 2: 0.2})


def test_warmup_max_lr_none_uses_optimizer_lr_and_lists_are_per_group():
    s = WarmupLR(adam(lr=0.3), warmup_max_lr=None, warmup_num_steps=2, warmup_type="linear")
    check(trace(s, 3), {1: 0.15, 2: 0.3})
    s = WarmupLR(adam(groups=2), warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.21], warmup_num_steps=4,
                 warmup_type="linear")
    for _ in range(3):
        s.step()
    assert s.get_last_lr() == pytest.approx([0.05, 0.11])  # it = 2: half way for both groups


def test_warmup_decay_lr_linear():
    s = WarmupDecayLR(adam(), total_num_steps=12, warmup_min_lr=0.0, warmup_max_lr=0.08, warmup_num_steps=4,
                      warmup_type="linear")
    # warm-up it/4, then (12 - it) / (12 - 4)
    check(trace(s, 15), {2: 0.04, 3: 0.06, 4: 0.08, 6: 0.06, 8: 0.04, 11: 0.01, 12: 0.0, 15: 0.0})


def test_warmup_decay_lr_log():
    s = WarmupDecayLR(adam(), total_num_steps=12, warmup_max_lr=0.08, warmup_num_steps=4)
    check(trace(s, 10), {0: 0.0, 1: 0.04, 2: 0.08 * math.log(3) / math.log(4), 4: 0.08, 10: 0.02})


# ------------------------------------------------------------------ WarmupCosineLR

def test_warmup_cosine_lr_linear():
    s = WarmupCosineLR(adam(lr=0.1), total_num_steps=10, warmup_min_ratio=0.2, warmup_num_steps=4,
                       cos_min_ratio=0.1, warmup_type="linear")
    # warm-up ratio 0.2 + 0.8 * it/4; then 0.1 + 0.9 * (1 + cos(pi * (it - 3) / 6)) / 2
    check(trace(s, 15), {-1: 0.02, 0: 0.02, 2: 0.06, 3: 0.08, 4: 0.1 * (0.1 + 0.9 * (1 + math.sqrt(3) / 2) / 2),
                         6: 0.055, 9: 0.01, 15: 0.01})


def test_warmup_cosine_lr_log_and_base_lr_per_group():
    opt = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": 0.1},
                           {"params": [torch.zeros(1, requires_grad=True)], "lr": 0.4}], lr=1.0)
    s = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=4)
    s.step()
    s.step()  # it = 1: log(2)/log(4) = 0.5
    assert s.get_last_lr() == pytest.approx([0.05, 0.2])


# ------------------------------------------------------------------ LRRangeTest

def test_lr_range_test_continuous():
    s = LRRangeTest(adam(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=2.0)
    # 0.01 * (1 + 2 * (it + 1) / 4)
    check(trace(s, 6), {-1: 0.01, 0: 0.015, 3: 0.03, 6: 0.045})


def test_lr_range_test_staircase():
    s = LRRangeTest(adam(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=2.0,
                    lr_range_test_staircase=True)
    check(trace(s, 7), {-1: 0.01, 0: 0.01, 2: 0.01, 3: 0.03, 6: 0.03, 7: 0.05})


def test_lr_range_test_tutorial_example():
    """The LRRT tutorial: min 1e-4, rate 5, size 200 reaches ~0.005 after 2000 steps."""
    s = LRRangeTest(adam(), lr_range_test_min_lr=1e-4, lr_range_test_step_size=200, lr_range_test_step_rate=5)
    s.step(1999)
    assert s.get_last_lr()[0] == pytest.approx(1e-4 * 51)


# ------------------------------------------------------------------ OneCycle

def one_cycle(opt=None, **kw):
    args = dict(cycle_min_lr=0.01, cycle_max_lr=0.05, cycle_first_step_size=4, cycle_min_mom=0.85,
                cycle_max_mom=0.95)
    args.update(kw)
    return OneCycle(opt or adam(), **args)


def test_one_cycle_lr_and_momentum():
    s = one_cycle(decay_step_size=2, decay_lr_rate=0.5, decay_mom_rate=0.02)
    lrs, moms = {-1: s.get_last_lr()[0]}, {-1: s.optimizer.param_groups[0]["betas"]}
    for it in range(10):
        s.step()
        lrs[it], moms[it] = s.get_last_lr()[0], s.optimizer.param_groups[0]["betas"]
    check(lrs, {-1: 0.01, 0: 0.02, 1: 0.03, 3: 0.05, 4: 0.04, 6: 0.02, 7: 0.01,
                8: 0.01 / 1.25, 9: 0.01 / 1.5})
    check({k: v[0] for k, v in moms.items()},
          # -1: DeepSpeed 0.19 starts at cycle_min_mom, the first step() moves onto the cycle
          {-1: 0.85, 0: 0.925, 1: 0.9, 3: 0.85, 4: 0.875, 7: 0.95, 8: 0.95 * 1.01, 9: 0.95 * 1.02})
    assert all(v[1] == 0.999 for v in moms.values())  # beta2 untouched


def test_one_cycle_asymmetric_and_no_decay():
    s = one_cycle(cycle_second_step_size=2)
    check(trace(s, 20), {3: 0.05, 4: 0.03, 5: 0.01, 20: 0.01})


def test_one_cycle_staircase():
    s = one_cycle(cycle_first_stair_count=2)
    check(trace(s, 7), {0: 0.01, 1: 0.03, 2: 0.03, 3: 0.05, 4: 0.03, 5: 0.03, 6: 0.01})


def test_one_cycle_sgd_momentum_and_optimizers_without_momentum():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.5)
    s = one_cycle(opt)
    s.step()
    s.step()
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.9)
    opt = torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], lr=0.1)
    s = one_cycle(opt)
    s.step()
    assert s.cycle_momentum is False and s.get_mom() is None and s.get_last_lr() == [pytest.approx(0.02)]
    opt = adam()
    one_cycle(opt, cycle_momentum=False).step()
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)


# ------------------------------------------------------------------ stepping, state

def test_explicit_iteration_and_both_names():
    s = WarmupLR(adam(), warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    s.step(2)
    assert s.last_batch_iteration == 2 and s.get_last_lr() == [pytest.approx(0.05)]
    r = LRRangeTest(adam(), lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=2.0)
    r.step(batch_iteration=3)
    assert r.get_last_lr() == [pytest.approx(0.03)]
    with pytest.raises(TypeError, match="not both"):
        r.step(1, batch_iteration=2)


SCHEDULES = {
    "LRRangeTest": lambda o: LRRangeTest(o, lr_range_test_min_lr=0.01, lr_range_test_step_size=3,
                                         lr_range_test_staircase=True),
    "OneCycle": lambda o: one_cycle(o, decay_step_size=2, decay_lr_rate=0.1, decay_mom_rate=0.01),
    "WarmupLR": lambda o: WarmupLR(o, warmup_num_steps=5),
    "WarmupDecayLR": lambda o: WarmupDecayLR(o, total_num_steps=12, warmup_num_steps=3, warmup_type="linear"),
    "WarmupCosineLR": lambda o: WarmupCosineLR(o, total_num_steps=12, warmup_num_steps=3, warmup_min_ratio=0.1),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_state_dict_round_trip(name):
    make = SCHEDULES[name]
    live = make(adam(lr=0.2))
    for _ in range(7):
        live.step()
    buf = io.BytesIO()
    torch.save(live.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    opt = adam(lr=0.2)
    resumed = make(opt)
    resumed.load_state_dict(state)
    assert resumed.last_batch_iteration == live.last_batch_iteration == 6
    assert resumed.get_last_lr() == live.get_last_lr() and opt.param_groups[0]["lr"] == live.get_last_lr()[0]
    for _ in range(8):
        live.step()
        resumed.step()
        assert resumed.get_last_lr() == live.get_last_lr()
        assert opt.param_groups[0]["betas"] == live.optimizer.param_groups[0]["betas"]


def test_load_state_dict_rejects_garbage():
    s = WarmupLR(adam())
    with pytest.raises(ValueError, match="'last_batch_iteration'"):
        s.load_state_dict({"step": 3})


def test_schedule_accepts_wrapped_optimizers():
    inner = adam()

    class Wrapper:
        optimizer = inner

    WarmupLR(Wrapper(), warmup_min_lr=0.05, warmup_max_lr=0.1)
    assert inner.param_groups[0]["lr"] == 0.05
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        get_torch_optimizer(object())


# ------------------------------------------------------------------ config

def test_build_from_config_case_insensitive_and_torch_by_name():
    opt = adam()
    s = build_lr_scheduler("warmuplr", {"warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"}, opt)
    assert isinstance(s, WarmupLR)
    s = build_lr_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, opt)
    assert isinstance(s, torch.optim.lr_scheduler.StepLR)
    assert validate_scheduler_config("onecycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}) == "OneCycle"


@pytest.mark.parametrize("type_name, params, fragments", [
    ("WarmupLRR", {}, ["scheduler.type 'WarmupLRR' is not a known LR schedule", "Did you mean 'WarmupLR'"]),
    ("WarmupLR", {"warmup_max": 0.1}, ["scheduler.params.warmup_max is not a parameter of scheduler 'WarmupLR'",
                                        "Did you mean 'warmup_max_lr'"]),
    ("WarmupLR", {"warmup_type": "cosine"}, ["scheduler.params.warmup_type = 'cosine'", "'log' or 'linear'"]),
    ("WarmupLR", {"warmup_num_steps": -5}, ["scheduler.params.warmup_num_steps = -5", "non-negative integer"]),
    ("WarmupLR", {"warmup_max_lr": "auto"}, ["scheduler.params.warmup_max_lr = 'auto'"]),
    ("WarmupDecayLR", {"warmup_max_lr": 0.1}, ["scheduler.params.total_num_steps is required"]),
    ("WarmupCosineLR", {"total_num_steps": 0}, ["scheduler.params.total_num_steps = 0", "positive integer"]),
    ("OneCycle", {"cycle_max_lr": 0.1}, ["scheduler.params.cycle_min_lr is required"]),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_min_mom": 0.95, "cycle_max_mom": 0.9},
     ["scheduler.params.cycle_min_mom (0.95) must not exceed"]),
    ("LRRangeTest", {"lr_range_test_step_size": 0}, ["scheduler.params.lr_range_test_step_size = 0",
                                                      "positive number"]),
    ("LRRangeTest", {"lr_range_test_staircase": "yes"}, ["lr_range_test_staircase = 'yes'", "true or false"]),
    ("StepLR", {"step": 2}, ["scheduler.params.step is not a parameter of torch.optim.lr_scheduler.StepLR"]),
    ("StepLR", {}, ["scheduler 'StepLR' rejected scheduler.params", "step_size"]),
    ("WarmupLR", [1, 2], ["scheduler.params must be a dictionary"]),
    ("ReduceLROnPlateau", {}, ["needs a metric at every step"]),
])
def test_config_errors_name_the_key(type_name, params, fragments):
    with pytest.raises(DeepSpeedConfigError) as exc:
        validate_scheduler_config(type_name, params)
    for fragment in fragments:
        assert fragment in str(exc.value)


def test_per_group_list_length_mismatch_and_direct_construction_errors():
    with pytest.raises(DeepSpeedConfigError, match=r"warmup_max_lr \(WarmupLR\) has 3 values .* 2 parameter"):
        build_lr_scheduler("WarmupLR", {"warmup_max_lr": [0.1, 0.2, 0.3]}, adam(groups=2))
    with pytest.raises(DeepSpeedConfigError, match="scheduler.params.warmup_type = 'exp'"):
        WarmupLR(adam(), warmup_type="exp")


def test_no_warmup_decay_and_cosine_start_at_the_peak():
    s = WarmupDecayLR(adam(), total_num_steps=4, warmup_max_lr=0.08, warmup_num_steps=0)
    check(trace(s, 4), {-1: 0.08, 0: 0.08, 2: 0.04, 4: 0.0})
    s = WarmupCosineLR(adam(lr=0.1), total_num_steps=4, warmup_num_steps=0, cos_min_ratio=0.0)
    check(trace(s, 3), {-1: 0.1, 1: 0.05, 3: 0.0})


def test_deepspeed_019_defaults_warmup_inherits_group_lrs_and_one_cycle_zero_second_half():
    # WarmupLR without warmup_max_lr warms each group up to its own lr (DeepSpeed 0.19);
    # WarmupDecayLR keeps 0.001
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}])
    s = WarmupLR(opt, warmup_num_steps=10)
    assert s.max_lrs == [0.1, 0.2]
    s.step(10)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2])
    assert WarmupDecayLR(adam(), total_num_steps=20).max_lrs == [0.001]
    # OneCycle with cycle_second_step_size 0: the cycle rises over the first half and ends there
    s = OneCycle(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), cycle_min_lr=0.001,
                 cycle_max_lr=0.1, cycle_first_step_size=100, cycle_second_step_size=0, cycle_momentum=False)
    assert s.step_ratio == 1.0 and s.get_lr() == [pytest.approx(0.001)]
    s.step()
    assert s.get_lr() == [pytest.approx(0.001 + 0.099 * 1 / 100)]   # iteration 0: k = 1


def test_one_cycle_per_group_momentum_lists():
    """DeepSpeed 0.19: cycle_min_mom / cycle_max_mom may be one value per parameter group; each group's
    betas[0] runs from its own max down to its own min at the peak (hand-computed) and back."""
    import torch
    from deepspeed.runtime.lr_schedules import OneCycle
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([{"params": [a]}, {"params": [b]}], lr=0.1, betas=(0.9, 0.99))
    sched = OneCycle(opt, cycle_min_lr=[0.001, 0.002], cycle_max_lr=0.01, cycle_min_mom=[0.8, 0.85],
                     cycle_max_mom=[0.9, 0.95], cycle_first_step_size=4)
    # DeepSpeed 0.19 starts each group at its own cycle_min_mom
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.85, 0.99)]
    sched.step(1)   # scale = (1 + 1) / 4 = 0.5
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.85, 0.9])
    sched.step(3)   # the peak
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.8, 0.85])
    assert sched.get_lr() == pytest.approx([0.01, 0.01])
    with pytest.raises(ValueError, match="cycle_max_mom"):
        OneCycle(opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_max_mom=[0.9, 0.95, 0.99])
    with pytest.raises(ValueError, match="must not exceed"):
        OneCycle(opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_min_mom=[0.8, 0.96], cycle_max_mom=0.95)
