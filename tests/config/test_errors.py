"""Every class of config error has a test on its message: the key path, the bad
value and what would be valid must all be in it."""
import json
import os

import pytest

from deepspeed.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.config.ds_config import load_config_source

BASE = {"train_batch_size": 8}


def _err(config, world_size=1) -> str:
    with pytest.raises(DeepSpeedConfigError) as info:
        DeepSpeedConfig(config, world_size=world_size)
    return str(info.value)


def _with(**sections):
    return {**BASE, **sections}


# ---------------------------------------------------------------- unknown keys


def test_unknown_top_level_key_suggests_the_close_one():
    msg = _err({"train_batch_sise": 8})
    assert "Unknown config key 'train_batch_sise'" in msg
    assert "Did you mean 'train_batch_size'" in msg


@pytest.mark.parametrize("section,typo,right", [
    ("zero_optimization", "stgae", "stage"),
    ("fp16", "loss_scale_windw", "loss_scale_window"),
    ("tensorboard", "job_nme", "job_name"),
    ("flops_profiler", "profile_stpe", "profile_step"),
    ("autotuning", "tuner_tpye", "tuner_type"),
])
def test_unknown_nested_key_names_its_path_and_suggests(section, typo, right):
    msg = _err(_with(**{section: {typo: 1}}))
    assert f"Unknown config key '{section}.{typo}'" in msg
    assert f"Did you mean '{right}'" in msg


def test_unknown_key_inside_a_named_group_still_suggests():
    cfg = _with(compression_training={"weight_quantization": {"different_groups": {"wq1": {"parmas": {}}}}})
    msg = _err(cfg)
    assert "'compression_training.weight_quantization.different_groups.wq1.parmas'" in msg
    assert "Did you mean 'params'" in msg


def test_unknown_key_without_a_close_match_lists_the_valid_ones():
    msg = _err(_with(bf16={"zzz": True}))
    assert "Unknown config key 'bf16.zzz'" in msg
    assert "Valid keys here:" in msg and "enabled" in msg


# ---------------------------------------------------------------- wrong type / range / enum


@pytest.mark.parametrize("config,path,value,allowed", [
    ({"train_batch_size": "eight"}, "train_batch_size", "'eight'", "valid integer"),
    (_with(fp16={"enabled": "maybe"}), "fp16.enabled", "'maybe'", "valid boolean"),
    (_with(tensorboard={"output_path": 5}), "tensorboard.output_path", "5", "valid string"),
    (_with(comms_logger={"prof_ops": "all_reduce"}), "comms_logger.prof_ops", "'all_reduce'", "valid list"),
])
def test_wrong_type_names_path_value_and_expected_type(config, path, value, allowed):
    msg = _err(config)
    assert f"Invalid value for '{path}': {value}" in msg
    assert allowed in msg


@pytest.mark.parametrize("config,path,value,bound", [
    (_with(gradient_clipping=-1.0), "gradient_clipping", "-1.0", "greater than or equal to 0"),
    (_with(fp16={"initial_scale_power": 100}), "fp16.initial_scale_power", "100", "less than or equal to 64"),
    ({"train_batch_size": 0}, "train_batch_size", "0", "greater than or equal to 1"),
    (_with(flops_profiler={"profile_step": 0}), "flops_profiler.profile_step", "0", "greater than or equal to 1"),
    (_with(progressive_layer_drop={"theta": 1.5}), "progressive_layer_drop.theta", "1.5", "less than or equal to 1"),
    (_with(zero_optimization={"offload_optimizer": {"device": "cpu", "ratio": 2}}),
     "zero_optimization.offload_optimizer.ratio", "2", "less than or equal to 1"),
])
def test_out_of_range_value_names_the_bound(config, path, value, bound):
    msg = _err(config)
    assert f"Invalid value for '{path}': {value}" in msg
    assert bound in msg


def test_zero_stage_5_is_refused_with_the_allowed_range():
    msg = _err(_with(zero_optimization={"stage": 5}))
    assert "Invalid value for 'zero_optimization.stage': 5" in msg
    assert "less than or equal to 3" in msg


@pytest.mark.parametrize("which", ["offload_optimizer", "offload_param"])
def test_offload_device_gpu_lists_the_valid_devices(which):
    msg = _err(_with(zero_optimization={"stage": 3, which: {"device": "gpu"}}))
    assert f"Invalid value for 'zero_optimization.{which}.device': 'gpu'" in msg
    assert "'none', 'cpu' or 'nvme'" in msg


@pytest.mark.parametrize("config,path,allowed", [
    (_with(sparse_attention={"mode": "sparse"}), "sparse_attention.mode",
     "'dense', 'fixed', 'variable', 'bigbird' or 'bslongformer'"),
    (_with(autotuning={"metric": "speed"}), "autotuning.metric", "'latency', 'throughput' or 'flops'"),
    (_with(checkpoint={"tag_validation": "Maybe"}), "checkpoint.tag_validation", "'Warn'"),
    (_with(data_types={"grad_accum_dtype": "fp8"}), "data_types.grad_accum_dtype", "'fp32', 'fp16' or 'bf16'"),
    (_with(comet={"mode": "append"}), "comet.mode", "'get', 'create' or 'get_or_create'"),
])
def test_bad_enum_value_lists_the_choices(config, path, allowed):
    msg = _err(config)
    assert f"Invalid value for '{path}'" in msg
    assert allowed in msg


# ---------------------------------------------------------------- batch sizes


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_all_three_inconsistent_shows_the_product(ws):
    tb, mb, ga = 7, 2, 3
    msg = _err({"train_batch_size": tb, "train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": ga},
               world_size=ws)
    assert f"train_batch_size ({tb})" in msg
    assert f"train_micro_batch_size_per_gpu ({mb}) * gradient_accumulation_steps ({ga}) " \
           f"* data-parallel world size ({ws}) = {mb * ga * ws}" in msg


def test_batch_and_micro_not_divisible_shows_the_quotient():
    msg = _err({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert "train_batch_size (10) is not divisible by train_micro_batch_size_per_gpu (4)" in msg
    assert "= 8" in msg and "would be 1.25" in msg


def test_batch_and_accumulation_not_divisible_shows_the_quotient():
    msg = _err({"train_batch_size": 10, "gradient_accumulation_steps": 3}, world_size=1)
    assert "train_batch_size (10) is not divisible by gradient_accumulation_steps (3)" in msg
    assert f"would be {10 / 3:g}" in msg


def test_batch_alone_not_divisible_by_world_size():
    msg = _err({"train_batch_size": 6}, world_size=4)
    assert "train_batch_size (6) is not divisible by the data-parallel world size (4)" in msg


@pytest.mark.parametrize("config", [{}, {"gradient_accumulation_steps": 4}])
def test_missing_batch_size_says_which_keys_to_set(config):
    msg = _err(config)
    assert "train_batch_size or train_micro_batch_size_per_gpu" in msg


# ---------------------------------------------------------------- cross-section rules


def test_fp16_and_bf16_together():
    msg = _err(_with(fp16={"enabled": True}, bf16={"enabled": True}))
    assert "fp16.enabled and bf16.enabled are both true" in msg


def test_amp_enabled_points_to_the_alternatives():
    msg = _err(_with(amp={"enabled": True, "opt_level": "O1"}))
    assert "amp.enabled" in msg and "torch_autocast" in msg


def test_torch_autocast_with_fp16():
    msg = _err(_with(torch_autocast={"enabled": True}, fp16={"enabled": True}))
    assert "torch_autocast.enabled cannot be combined with fp16.enabled" in msg


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_without_stage_3_is_ignored(stage):
    # DeepSpeed parses offload_param at any stage and only stage 3 reads it (issue 12;
    # tests/behaviours/test_deepspeed_behaviours.py checks the warning).
    cfg = DeepSpeedConfig(_with(zero_optimization={"stage": stage, "offload_param": {"device": "cpu"}}), world_size=1)
    assert cfg.zero_optimization_stage == stage


def test_offload_optimizer_with_stage_0():
    msg = _err(_with(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}))
    assert "offload_optimizer requires zero_optimization.stage 1, 2 or 3, got stage 0" in msg


def test_offload_param_to_nvme_needs_a_writable_nvme_path(tmp_path):
    # offload_param.device 'nvme' is built (swap_tensor/partitioned_param_swapper.py); a bad
    # nvme_path is refused at parse time, naming the key.
    key = "zero_optimization.offload_param.nvme_path"
    msg = _err(_with(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}))
    assert key in msg and "required" in msg
    missing = tmp_path / "absent"
    msg = _err(_with(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(missing)}}))
    assert key in msg and "not an existing directory" in msg
    if os.geteuid() != 0:   # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        msg = _err(_with(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(ro)}}))
        assert key in msg and "not writable" in msg
    ok = DeepSpeedConfig(_with(zero_optimization={"stage": 3, "offload_param": {"device": "nvme",
                                                                                 "nvme_path": str(tmp_path)}}),
                         world_size=1)
    assert ok.zero_config.offload_param.device == "nvme"


# ---------------------------------------------------------------- files and sources


def test_config_file_not_found(tmp_path):
    path = tmp_path / "nope.json"
    msg = _err(str(path))
    assert f"'{path}' does not exist" in msg


def test_invalid_json_and_hjson_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train_batch_size": 8,, ]')
    msg = _err(str(path))
    assert str(path) in msg and "neither valid JSON nor hjson" in msg


def test_hjson_file_with_comments_is_accepted(tmp_path):
    path = tmp_path / "ds.hjson"
    path.write_text("""{
      // batch: two of three given, the third is inferred
      train_micro_batch_size_per_gpu: 2
      gradient_accumulation_steps: 3  # trailing comment
      /* block comment */
      fp16: {enabled: true, loss_scale_window: 100}
    }""")
    cfg = DeepSpeedConfig(str(path), world_size=2)
    assert cfg.train_batch_size == 2 * 3 * 2
    assert cfg.fp16.enabled and cfg.fp16.loss_scale_window == 100


def test_plain_json_file_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 12, "gradient_clipping": 0.5}))
    cfg = DeepSpeedConfig(path, world_size=3)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 1)
    assert cfg.gradient_clipping == 0.5


@pytest.mark.parametrize("source", [42, [1, 2], 3.5])
def test_config_that_is_not_a_dict_or_path(source):
    msg = _err(source)
    assert "must be a dict or a path" in msg and type(source).__name__ in msg


def test_config_file_holding_a_list_is_not_a_dict(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2, 3]")
    msg = _err(str(path))
    assert "must be a JSON object (dict), got list" in msg


def test_section_that_is_not_a_dict():
    msg = _err(_with(fp16=True))
    assert "Invalid value for 'fp16': True" in msg


def test_load_config_source_copies_dicts():
    src = {"train_batch_size": 8, "fp16": {"enabled": False}}
    loaded = load_config_source(src)
    loaded["fp16"]["enabled"] = True
    assert src["fp16"]["enabled"] is False
