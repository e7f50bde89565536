"""The documented classes (deepspeed.config.Config, BatchConfig, FP16Config,
TrainingConfig) behave as the API reference says, and batch sizes resolve by
train_batch_size = micro * accumulation * world_size for every pair given."""
import itertools

import pytest

import deepspeed.config as ds_config
from deepspeed.config import (BatchConfig, Config, DeepSpeedConfig, DeepSpeedConfigError, FP16Config,
                              TrainingConfig)
from deepspeed.config.sections import FP16Section
from tests.helpers.dist import run_distributed

KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
WORLD_SIZES = (1, 2, 4)
MICRO, ACC = 3, 2  # the true values each pair is drawn from


def _truth(ws):
    return {"train_batch_size": MICRO * ACC * ws, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACC}


# ---------------------------------------------------------------- Config struct


def test_config_attribute_and_item_access():
    c = Config(verbose=True)
    assert c.verbose is True and c["verbose"] is True
    c["depth"] = 3
    assert c.depth == 3 and "depth" in c and "width" not in c
    with pytest.raises(KeyError):
        c["width"]
    with pytest.raises(AttributeError):
        c.width


def test_config_from_dict():
    c = Config.from_dict({"verbose": True, "name": "run"})
    assert c.verbose is True and c["name"] == "run"
    assert c.to_dict() == {"verbose": True, "name": "run"}
    assert c == Config(verbose=True, name="run") and c != Config(verbose=False, name="run")


@pytest.mark.parametrize("bad", [[("verbose", True)], "verbose", 3])
def test_from_dict_refuses_non_dicts(bad):
    with pytest.raises(DeepSpeedConfigError, match="must be built from a dict"):
        Config.from_dict(bad)


def test_config_keys_cannot_shadow_methods():
    with pytest.raises(DeepSpeedConfigError, match="resolve is a method or property name"):
        Config(resolve=True)


def test_plain_config_is_valid_and_resolve_returns_self():
    c = Config(verbose=True)
    assert c.resolve() is c and c.is_valid() is True


def test_subclass_groups_declared_fields_and_free_form_subclass_accepts_any():
    class Logging(Config):
        verbose = False
        path = None

    class Anything(Config):
        pass

    log = Logging(path="/tmp/x")
    assert (log.verbose, log["path"]) == (False, "/tmp/x")
    with pytest.raises(DeepSpeedConfigError, match="Did you mean 'verbose'"):
        Logging(verbos=True)
    assert Anything(depth=2).depth == 2


def test_subclass_unknown_key_suggests_the_field():
    with pytest.raises(DeepSpeedConfigError) as info:
        BatchConfig(train_batch_sise=8)
    assert "Unknown BatchConfig key 'train_batch_sise'" in str(info.value)
    assert "'train_batch_size'" in str(info.value)
    with pytest.raises(DeepSpeedConfigError, match="Unknown FP16Config key 'enable'"):
        FP16Config.from_dict({"enable": True})


def test_documented_defaults_are_none():
    b, f, t = BatchConfig(), FP16Config(), TrainingConfig()
    assert all(getattr(b, k) is None for k in KEYS)
    assert f.enabled is None and f.clip is None
    assert t.batch is None and t.fp16 is None


def test_fp16config_covers_every_fp16_section_key():
    assert set(FP16Section.model_fields) <= set(FP16Config._fields)


# ---------------------------------------------------------------- batch resolution


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("pair", list(itertools.combinations(KEYS, 2)))
def test_every_pair_gives_the_third(pair, ws):
    truth = _truth(ws)
    given = {k: truth[k] for k in pair}
    b = BatchConfig(**given).resolve(world_size=ws)
    assert {k: getattr(b, k) for k in KEYS} == truth
    assert b.train_batch_size == b.train_micro_batch_size_per_gpu * b.gradient_accumulation_steps * ws
    assert b.is_valid() and b.invalid_reason is None
    cfg = DeepSpeedConfig(given, world_size=ws)  # the engine's path agrees
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
        tuple(truth[k] for k in KEYS)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_all_three_consistent_is_valid_and_inconsistent_is_not(ws):
    truth = _truth(ws)
    assert BatchConfig(**truth).is_valid(world_size=ws)
    bad = BatchConfig(**{**truth, "train_batch_size": truth["train_batch_size"] + 1})
    assert bad.is_valid(world_size=ws) is False
    assert f"= {MICRO * ACC * ws}" in bad.invalid_reason
    with pytest.raises(DeepSpeedConfigError, match="Batch sizes are inconsistent"):
        bad.resolve(world_size=ws)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_single_value_completes_with_one_accumulation_step(ws):
    b = BatchConfig(train_micro_batch_size_per_gpu=MICRO).resolve(world_size=ws)
    assert (b.train_batch_size, b.gradient_accumulation_steps) == (MICRO * ws, 1)


def test_world_size_defaults_to_one_without_torch_distributed(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    b = BatchConfig(train_batch_size=12, train_micro_batch_size_per_gpu=4).resolve()
    assert b.gradient_accumulation_steps == 12 // 4


def test_resolve_keeps_its_world_size_for_is_valid():
    b = BatchConfig(train_batch_size=16, gradient_accumulation_steps=2).resolve(world_size=4)
    assert b.train_micro_batch_size_per_gpu == 16 // (2 * 4)
    assert b.is_valid()


def _resolve_under_torch_distributed(rank, world_size):
    b = BatchConfig(train_batch_size=24, train_micro_batch_size_per_gpu=3)
    b.resolve()
    return b.gradient_accumulation_steps


def test_world_size_comes_from_torch_distributed_when_initialised():
    results = run_distributed(_resolve_under_torch_distributed, world_size=2, timeout=120)
    assert results == [24 // (3 * 2)] * 2


@pytest.mark.parametrize("given,fragment", [
    ({}, "train_batch_size or train_micro_batch_size_per_gpu"),
    ({"gradient_accumulation_steps": 2}, "train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_batch_size": "8", "gradient_accumulation_steps": 2}, "train_batch_size must be a positive integer"),
    ({"train_batch_size": 8, "gradient_accumulation_steps": True}, "gradient_accumulation_steps must be a positive"),
    ({"train_micro_batch_size_per_gpu": 0, "gradient_accumulation_steps": 1}, "must be a positive integer, got 0"),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 3}, "not divisible by gradient_accumulation_steps"),
])
def test_batch_config_invalid(given, fragment):
    b = BatchConfig(**given)
    assert b.is_valid(world_size=1) is False
    assert fragment in b.invalid_reason


def test_validate_without_resolve_reports_missing_keys():
    with pytest.raises(DeepSpeedConfigError, match="gradient_accumulation_steps not set"):
        BatchConfig(train_batch_size=8, train_micro_batch_size_per_gpu=8).validate()


# ---------------------------------------------------------------- FP16Config


def test_fp16_resolve_fills_documented_defaults():
    f = FP16Config(enabled=True).resolve()
    d = FP16Section()
    assert f.clip == 0.0 and f.enabled is True
    assert (f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale) == \
        (d.loss_scale, d.initial_scale_power, d.loss_scale_window, d.hysteresis, d.min_loss_scale)


def test_fp16_given_values_survive_resolve():
    f = FP16Config(enabled=True, clip=1.0, loss_scale=128.0, hysteresis=4).resolve()
    assert (f.clip, f.loss_scale, f.hysteresis) == (1.0, 128.0, 4)


@pytest.mark.parametrize("given,fragment", [
    ({"clip": -1}, "FP16Config.clip must be a number >= 0"),
    ({"clip": "big"}, "FP16Config.clip must be a number >= 0"),
    ({"loss_scale": -1}, "Invalid value for 'FP16Config.loss_scale': -1"),
    ({"enabled": "sometimes"}, "Invalid value for 'FP16Config.enabled'"),
    ({"initial_scale_power": 99}, "less than or equal to 64"),
])
def test_fp16_invalid(given, fragment):
    f = FP16Config(**given)
    assert f.is_valid() is False and fragment in f.invalid_reason


# ---------------------------------------------------------------- TrainingConfig


def test_training_config_from_dict_builds_nested_configs():
    t = TrainingConfig.from_dict({"batch": {"train_batch_size": 16, "gradient_accumulation_steps": 2},
                                  "fp16": {"enabled": True, "clip": 1.0}})
    assert isinstance(t.batch, BatchConfig) and isinstance(t.fp16, FP16Config)
    assert t["batch"]["train_batch_size"] == 16 and t.fp16.clip == 1.0
    assert t.is_valid(world_size=2)
    assert t.batch.train_micro_batch_size_per_gpu == 16 // (2 * 2)


def test_training_config_keyword_dicts_become_sub_configs():
    t = TrainingConfig(batch={"train_micro_batch_size_per_gpu": 2})
    assert isinstance(t.batch, BatchConfig)
    t.fp16 = {"enabled": False}
    assert isinstance(t.fp16, FP16Config)


def test_training_config_invalid_when_a_sub_config_is():
    t = TrainingConfig.from_dict({"batch": {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2},
                                  "fp16": {"enabled": True}})
    assert t.is_valid(world_size=1) is False and "not divisible" in t.invalid_reason
    t2 = TrainingConfig.from_dict({"batch": {"train_batch_size": 8}, "fp16": {"clip": -2}})
    assert t2.is_valid() is False and "FP16Config.clip" in t2.invalid_reason


def test_training_config_needs_a_batch():
    t = TrainingConfig(fp16=FP16Config(enabled=True))
    assert t.is_valid() is False and "TrainingConfig.batch is required" in t.invalid_reason


def test_training_config_wrong_sub_config_type():
    t = TrainingConfig(batch=8)
    assert t.is_valid() is False and "TrainingConfig.batch must be a BatchConfig" in t.invalid_reason
    with pytest.raises(DeepSpeedConfigError, match="Unknown TrainingConfig key 'fp32'"):
        TrainingConfig(fp32={})


def test_training_config_round_trips_to_a_deepspeed_config():
    t = TrainingConfig.from_dict({"batch": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
                                  "fp16": {"enabled": True, "clip": 0.5, "loss_scale_window": 200}})
    assert t.is_valid(world_size=2)
    cfg = DeepSpeedConfig(t.to_ds_config(), world_size=2)
    assert cfg.train_batch_size == 2 * 3 * 2 == t.batch.train_batch_size
    assert cfg.fp16.enabled and cfg.fp16.loss_scale_window == 200 and cfg.gradient_clipping == 0.5


def test_to_dict_is_nested_plain_dicts():
    t = TrainingConfig(batch=BatchConfig(train_batch_size=4))
    assert t.to_dict() == {"batch": {"train_batch_size": 4, "train_micro_batch_size_per_gpu": None,
                                     "gradient_accumulation_steps": None}, "fp16": None}


def test_exported_where_documented():
    assert ds_config.Config is Config and ds_config.TrainingConfig is TrainingConfig
    assert issubclass(BatchConfig, Config) and issubclass(FP16Config, Config) and issubclass(TrainingConfig, Config)
    from deepspeed.runtime.config import DeepSpeedConfig as RC, DeepSpeedConfigError as RE, DeepSpeedConfigModel
    assert RC is DeepSpeedConfig and RE is DeepSpeedConfigError
    assert DeepSpeedConfigModel is ds_config.DeepSpeedConfigModel
