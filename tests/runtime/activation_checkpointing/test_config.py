"""configure(): config section as defaults, explicit arguments win, bad input is named."""
from __future__ import annotations

import json

import pytest

import deepspeed.checkpointing as ckpt
from deepspeed.config import DeepSpeedConfig
from deepspeed.config.errors import DeepSpeedConfigError
from deepspeed.runtime.activation_checkpointing import settings

SECTION = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
           "number_checkpoints": 12, "synchronize_checkpoint_boundary": True, "profile": True}
ALL_ON = settings.CheckpointSettings(True, True, 12, True, True, True)


@pytest.mark.parametrize("source", ["dict", "path", "DeepSpeedConfig"])
def test_config_section_is_read_from_every_source(tmp_path, source):
    raw = {"train_batch_size": 4, "activation_checkpointing": SECTION}
    if source == "path":
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(raw))
        cfg = str(path)
    elif source == "DeepSpeedConfig":
        cfg = DeepSpeedConfig(raw, world_size=1)
    else:
        cfg = raw
    ckpt.configure(None, deepspeed_config=cfg)
    assert settings.current() == ALL_ON


def test_batch_size_keys_not_needed():
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"profile": True}})
    assert settings.current().profile and not settings.current().partition_activations


def test_explicit_arguments_override_config():
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": SECTION}, partition_activations=True,
                   contiguous_checkpointing=False, num_checkpoints=3, checkpoint_in_cpu=False,
                   synchronize=False, profile=False)
    assert settings.current() == settings.CheckpointSettings(True, False, 3, False, False, False)


def test_defaults_without_config():
    ckpt.configure(None)
    assert settings.current() == settings.CheckpointSettings()


def test_reconfigure_replaces_settings():
    ckpt.configure(None, profile=True)
    ckpt.configure(None, synchronize=True)
    assert not settings.current().profile and settings.current().synchronize


def test_contiguous_without_num_checkpoints():
    with pytest.raises(DeepSpeedConfigError, match="num_checkpoints") as err:
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)
    assert "number_checkpoints" in str(err.value)
    with pytest.raises(DeepSpeedConfigError, match="number_checkpoints"):
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {
            "partition_activations": True, "contiguous_memory_optimization": True}})
    assert not ckpt.is_configured()  # a failed configure leaves nothing half-applied


def test_contiguous_without_partition():
    with pytest.raises(DeepSpeedConfigError, match="partition_activations"):
        ckpt.configure(None, contiguous_checkpointing=True, num_checkpoints=4)


@pytest.mark.parametrize("kwargs, needle", [
    ({"num_checkpoints": 0}, "num_checkpoints"),
    ({"num_checkpoints": "4"}, "num_checkpoints"),
    ({"partition_activations": "yes"}, "partition_activations"),
    ({"profile": 1}, "profile"),
])
def test_bad_arguments_are_named(kwargs, needle):
    with pytest.raises(DeepSpeedConfigError, match=needle):
        ckpt.configure(None, **kwargs)


def test_bad_config_values_are_named():
    with pytest.raises(DeepSpeedConfigError, match="number_checkpoints"):
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"number_checkpoints": 0}})
    with pytest.raises(DeepSpeedConfigError, match="partition_activation"):
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activation": True}})


def test_missing_config_file_is_named(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(DeepSpeedConfigError, match="nope.json"):
        ckpt.configure(None, deepspeed_config=str(missing))


def test_mpu_without_model_parallel_methods():
    class HalfMpu:
        def get_model_parallel_rank(self):
            return 0

    with pytest.raises(DeepSpeedConfigError, match="get_model_parallel_group"):
        ckpt.configure(HalfMpu())
