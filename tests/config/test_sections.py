"""The sections whose features are not built (and aio/pipeline) are parsed into
typed models with the reference's keys and defaults, validated, and, when switched
on, refused with an error naming the feature and the key."""
import copy
import pathlib
import typing

import pytest
from pydantic import BaseModel

from deepspeed.config import DeepSpeedConfig, DeepSpeedConfigError, DeepSpeedConfigModel, FeatureNotAvailableError
from deepspeed.config.feature_sections import ACCEPTED_SECTIONS, UNBUILT_FEATURES, unbuilt_sections_markdown

BASE = {"train_batch_size": 8}

# The reference's own examples, one per section (with the feature switched off).
REFERENCE_EXAMPLES = {
    "tensorboard": {"enabled": False, "output_path": "output/ds_logs/", "job_name": "train_bert"},
    "wandb": {"enabled": False, "team": "my_team", "group": "my_group", "project": "my_project"},
    "comet": {"enabled": False, "workspace": "my_workspace", "project": "my_project", "samples_log_interval": 50,
              "experiment_name": "llama-fine-tuning", "experiment_key": "0c4a1c4a90664f2a8084e600b19a9d7a",
              "online": False, "mode": "get"},
    "csv_monitor": {"enabled": False, "output_path": "output/ds_logs/", "job_name": "train_bert"},
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1,
                       "detailed": True, "output_file": None},
    "comms_logger": {"enabled": False, "verbose": False, "prof_all": False, "debug": False,
                     "prof_ops": ["all_reduce", "all_gather"]},
    "autotuning": {"enabled": False, "results_dir": "autotuning_results", "exps_dir": "autotuning_exps",
                   "overwrite": False, "metric": "throughput", "start_profile_step": 3, "end_profile_step": 5,
                   "fast": True, "max_train_batch_size": None, "mp_size": 1, "num_tuning_micro_batch_sizes": 3,
                   "tuner_type": "model_based", "tuner_early_stopping": 5, "tuner_num_trials": 50,
                   "arg_mappings": None},
    "elasticity": {"enabled": False, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1,
                   "max_gpus": 10000, "min_time": 20, "prefer_large_batch": True, "version": 0.2,
                   "ignore_non_elastic_batch_info": False, "num_gpus_per_node": 8, "model_parallel_size": 2},
    "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen", "min_difficulty": 8,
                            "max_difficulty": 1024, "schedule_type": "fixed_linear",
                            "schedule_config": {"total_curriculum_step": 40000, "difficulty_step": 8}},
    "data_efficiency": {
        "enabled": False, "seed": 1234,
        "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": 24, "random_ltd_layer_num": 22,
            "random_ltd_layer_id": list(range(1, 23)), "model_mask_name": "attention_mask",
            "model_type": "decoder", "hidden_state_order": "seq_batch_dim",
            "random_ltd_schedule": {"min_value": 128, "max_value": 2048, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 200000, "seq_per_step": 16}}}},
        "data_sampling": {"enabled": True, "num_epochs": 1, "num_workers": 0, "curriculum_learning": {
            "enabled": True, "data_cluster_path": "/path/to/data_clusters", "curriculum_metrics": {
                "vocabularyrarity": {
                    "index_to_sample_path": "/path/to/index_to_sample", "index_to_metric_path": "/path/to/i2m",
                    "difficulty_type": "percentile", "clustering_type": "schedule_based", "min_difficulty": 1,
                    "max_difficulty": 100, "schedule_type": "fixed_root",
                    "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 1,
                                        "root_degree": 2}}}}}},
    "compression_training": {
        "layer_reduction": {"enabled": False, "keep_number_layer": 5, "module_name_prefix": "bert.encoder.layer",
                            "teacher_layer": [2, 4, 6, 8, 10],
                            "other_module_name": ["bert.pooler", "bert.embeddings", "classifier"]},
        "weight_quantization": {
            "shared_parameters": {"enabled": False, "quantizer_kernel": False, "schedule_offset": 0,
                                  "quantize_groups": 1, "quantize_verbose": False, "quantization_type": "symmetric",
                                  "rounding": "nearest", "quantize_weight_in_forward": False,
                                  "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001}},
            "different_groups": {
                "wq1": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 50},
                        "modules": ["attention.self", "intermediate"]},
                "wq2": {"params": {"start_bits": 4, "target_bits": 4, "quantization_period": 50},
                        "modules": ["attention.output"]}}},
        "activation_quantization": {
            "shared_parameters": {"enabled": False, "quantization_type": "asymmetric",
                                  "range_calibration": "dynamic", "schedule_offset": 50},
            "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["attention.output"]}}},
        "sparse_pruning": {
            "shared_parameters": {"enabled": False, "schedule_offset": 30, "schedule_offset_end": 90,
                                  "schedule_offset_stride": 15, "method": "snip_momentum", "block_pattern": "4x1",
                                  "dense_ratio": 0.4, "excluded_modules": ["classifier", "pooler"]},
            "different_groups": {}},
        "row_pruning": {
            "shared_parameters": {"enabled": False, "schedule_offset": 20, "method": "topk"},
            "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["intermediate.dense"],
                                         "related_modules": [["layer.\\w+.output.dense"]]}}},
        "head_pruning": {
            "shared_parameters": {"enabled": False, "schedule_offset": 10, "method": "topk", "num_heads": 12},
            "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.output.dense"],
                                         "related_modules": [["self.query", "self.key", "self.value"]]}}},
        "channel_pruning": {
            "shared_parameters": {"enabled": False, "schedule_offset": 0, "method": "topk"},
            "different_groups": {"cp1": {"params": {"dense_ratio": 0.5}, "modules": ["layer....conv1"],
                                         "related_modules": [["layer....conv2", "layer....bn1"]]}}}},
    "progressive_layer_drop": {"enabled": False, "theta": 0.5, "gamma": 0.001},
    "eigenvalue": {"enabled": False, "verbose": True, "max_iter": 50, "tol": 1e-2, "stability": 0,
                   "gas_boundary_resolution": 1, "layer_name": "bert.encoder.layer", "layer_num": 24},
    "quantize_training": {"enabled": False, "quantize_verbose": True, "quantizer_kernel": True,
                          "quantize-algo": {"q_type": "symmetric"},
                          "quantize_bits": {"start_bits": 16, "target_bits": 8},
                          "quantize_schedule": {"quantize_period": 400, "schedule_offset": 0},
                          "quantize_groups": 8},
    "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                      "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
    "nebula": {"enabled": False, "persistent_storage_path": "/tmp/nebula", "persistent_time_interval": 100,
               "num_of_version_in_retention": 2, "enable_nebula_load": True, "load_path": "/tmp/nebula"},
    "weight_quantization": {"enabled": False, "post_init_quant": {"fc": {"num_bits": 4, "group_size": 64}}},
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True},
    "pipeline": {"stages": "auto", "partition": "best", "seed_layers": False, "activation_checkpoint_interval": 0},
}

# The smallest config that switches each unbuilt feature on, and the key the error must name.
ENABLING = {
    "tensorboard": ({"enabled": True}, "tensorboard.enabled"),
    "wandb": ({"enabled": True}, "wandb.enabled"),
    "comet": ({"enabled": True}, "comet.enabled"),
    "csv_monitor": ({"enabled": True}, "csv_monitor.enabled"),
    "flops_profiler": ({"enabled": True}, "flops_profiler.enabled"),
    "comms_logger": ({"enabled": True}, "comms_logger.enabled"),
    "sparse_attention": ({"mode": "fixed"}, "sparse_attention"),
    "compression_training": ({"row_pruning": {"shared_parameters": {"enabled": True}}},
                             "compression_training.row_pruning.shared_parameters.enabled"),
    "elasticity": ({"enabled": True}, "elasticity.enabled"),
    "autotuning": ({"enabled": True}, "autotuning.enabled"),
    "data_efficiency": ({"enabled": True}, "data_efficiency.enabled"),
    "curriculum_learning": ({"enabled": True, "min_difficulty": 8, "max_difficulty": 64,
                             "schedule_type": "fixed_linear",
                             "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8}},
                            "curriculum_learning.enabled"),
    "progressive_layer_drop": ({"enabled": True}, "progressive_layer_drop.enabled"),
    "eigenvalue": ({"enabled": True}, "eigenvalue.enabled"),
    "quantize_training": ({"enabled": True}, "quantize_training.enabled"),
    "hybrid_engine": ({"enabled": True}, "hybrid_engine.enabled"),
    "nebula": ({"enabled": True}, "nebula.enabled"),
    "weight_quantization": ({}, "weight_quantization.enabled"),  # on by default once present, as in DeepSpeed
}


def _cfg(**sections):
    return DeepSpeedConfig({**BASE, **copy.deepcopy(sections)}, world_size=1)


def _err(**sections) -> str:
    with pytest.raises(DeepSpeedConfigError) as info:
        _cfg(**sections)
    return str(info.value)


# ---------------------------------------------------------------- coverage of the model


def test_every_section_has_a_typed_model():
    fields = DeepSpeedConfigModel.model_fields
    for key in list(UNBUILT_FEATURES) + list(ACCEPTED_SECTIONS):
        args = typing.get_args(fields[key].annotation)
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        assert models, f"{key} is not parsed into a typed model"


def test_examples_and_enablers_cover_every_section():
    # Built features leave UNBUILT_FEATURES; their examples stay as parsing checks.
    assert set(UNBUILT_FEATURES) <= set(ENABLING)
    assert set(REFERENCE_EXAMPLES) >= set(UNBUILT_FEATURES) - {"sparse_attention"} | set(ACCEPTED_SECTIONS)


def _assert_kept(given, parsed, path):
    """Every value the example gives is found, unchanged, at the same path of the parsed model."""
    aliases = {"quantize-algo": "quantize_algo"}
    if isinstance(given, dict) and isinstance(parsed, dict):
        for k, v in given.items():
            _assert_kept(v, parsed[aliases.get(k, k)], f"{path}.{k}")
    else:
        assert parsed == given, path


@pytest.mark.parametrize("key", sorted(REFERENCE_EXAMPLES))
def test_reference_example_parses_and_keeps_its_values(key):
    example = REFERENCE_EXAMPLES[key]
    section = getattr(_cfg(**{key: example}).model, key)
    _assert_kept(example, section.model_dump(by_alias=False), key)


def test_absent_sections_stay_none_and_cost_nothing():
    model = _cfg().model
    for key in list(UNBUILT_FEATURES) + list(ACCEPTED_SECTIONS):
        assert getattr(model, key) is None


def test_documented_defaults():
    m = _cfg(tensorboard={}, wandb={}, comet={}, csv_monitor={}, flops_profiler={}, comms_logger={},
             autotuning={}, aio={}, pipeline={}, elasticity={}, progressive_layer_drop={}).model
    assert (m.tensorboard.enabled, m.tensorboard.output_path, m.tensorboard.job_name) == \
        (False, None, "DeepSpeedJobName")
    assert (m.wandb.team, m.wandb.group, m.wandb.project) == (None, None, "deepspeed")
    assert (m.comet.samples_log_interval, m.comet.mode, m.comet.online) == (100, None, None)
    assert m.csv_monitor.job_name == "DeepSpeedJobName"
    fp = m.flops_profiler
    assert (fp.profile_step, fp.module_depth, fp.top_modules, fp.detailed, fp.output_file) == (1, -1, 1, True, None)
    cl = m.comms_logger
    assert (cl.verbose, cl.prof_all, cl.debug, cl.prof_ops) == (False, True, False, [])
    at = m.autotuning
    assert (at.metric, at.start_profile_step, at.end_profile_step, at.fast, at.tuner_type, at.tuner_early_stopping,
            at.tuner_num_trials, at.num_tuning_micro_batch_sizes, at.mp_size) == \
        ("throughput", 3, 5, True, "model_based", 5, 50, 3, 1)
    aio = m.aio
    assert (aio.block_size, aio.queue_depth, aio.thread_count, aio.single_submit, aio.overlap_events) == \
        (1048576, 8, 1, False, True)
    assert (m.pipeline.stages, m.pipeline.partition, m.pipeline.activation_checkpoint_interval) == ("auto", "best", 0)
    el = m.elasticity
    assert (el.max_train_batch_size, el.micro_batch_sizes, el.min_gpus, el.max_gpus, el.version) == \
        (2000, [2, 4, 6], 1, 10000, 0.2)
    assert (m.progressive_layer_drop.theta, m.progressive_layer_drop.gamma) == (1.0, 0.001)


# ---------------------------------------------------------------- unbuilt features


@pytest.mark.parametrize("key", sorted(UNBUILT_FEATURES))
def test_enabling_an_unbuilt_feature_names_feature_and_key(key):
    section, enabling_key = ENABLING[key]
    with pytest.raises(FeatureNotAvailableError) as info:
        _cfg(**{key: section})
    msg = str(info.value)
    assert f"'{enabling_key}'" in msg
    assert UNBUILT_FEATURES[key] in msg
    assert "not available in this version" in msg
    assert info.value.key == enabling_key and info.value.feature == UNBUILT_FEATURES[key]


@pytest.mark.parametrize("key", sorted(set(UNBUILT_FEATURES) - {"sparse_attention"}))
def test_unbuilt_feature_switched_off_is_accepted(key):
    section = dict(ENABLING[key][0])
    if key == "compression_training":
        section = {"row_pruning": {"shared_parameters": {"enabled": False}}}
    else:
        section["enabled"] = False
    assert getattr(_cfg(**{key: section}).model, key) is not None


def test_check_features_false_parses_without_refusing():
    cfg = DeepSpeedConfig({**BASE, "flops_profiler": {"enabled": True, "top_modules": 3}}, world_size=1,
                          check_features=False)
    assert cfg.model.flops_profiler.top_modules == 3


@pytest.mark.parametrize("technique,shared", [
    ("weight_quantization", {"enabled": True}),
    ("activation_quantization", {"enabled": True}),
    ("sparse_pruning", {"enabled": True}),
    ("head_pruning", {"enabled": True, "num_heads": 8}),
    ("channel_pruning", {"enabled": True}),
])
def test_each_compression_technique_names_its_own_flag(technique, shared):
    # compression is built (docs/compression.md): accepted, and the section says which flag turned it on
    section = _cfg(compression_training={technique: {"shared_parameters": shared}}).model.compression_training
    assert section.enabled and section.enabling_keys() == [f"{technique}.shared_parameters.enabled"]


def test_layer_reduction_names_its_flag():
    section = _cfg(compression_training={"layer_reduction": {"enabled": True, "keep_number_layer": 2}}
                   ).model.compression_training
    assert section.enabling_keys() == ["layer_reduction.enabled"]


@pytest.mark.parametrize("key", ACCEPTED_SECTIONS)
def test_aio_and_pipeline_are_accepted(key):
    section = REFERENCE_EXAMPLES[key]
    assert getattr(_cfg(**{key: section}).model, key) is not None


def test_aio_newer_parallelism_name():
    assert _cfg(aio={"intra_op_parallelism": 4}).model.aio.parallelism == 4
    assert _cfg(aio={"thread_count": 2}).model.aio.parallelism == 2


@pytest.mark.parametrize("stages,ok", [("auto", True), (4, True), (0, False), ("two", False), (True, False)])
def test_pipeline_stages(stages, ok):
    if ok:
        assert _cfg(pipeline={"stages": stages}).model.pipeline.stages == stages
    else:
        assert "pipeline.stages must be 'auto' or a positive integer" in _err(pipeline={"stages": stages})


def test_pipeline_partition_methods():
    assert _cfg(pipeline={"partition": "type:transformer"}).model.pipeline.partition == "type:transformer"
    assert "'best', 'parameters', 'uniform' or 'type:<regex>'" in _err(pipeline={"partition": "greedy"})


def test_docs_list_the_unbuilt_sections():
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert unbuilt_sections_markdown() in doc
