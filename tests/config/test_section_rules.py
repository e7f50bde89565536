"""The documented constraints inside the feature sections: each bad config is
refused at parse time with a message naming the key and the rule."""
import pytest

from deepspeed.config import DeepSpeedConfig, DeepSpeedConfigError

BASE = {"train_batch_size": 8}


def _model(**sections):
    return DeepSpeedConfig({**BASE, **sections}, world_size=1, check_features=False).model


def _err(**sections) -> str:
    with pytest.raises(DeepSpeedConfigError) as info:
        _model(**sections)
    return str(info.value)


# ---------------------------------------------------------------- sparse attention modes


@pytest.mark.parametrize("mode,expected_keys", [
    ("dense", {"block", "different_layout_per_head"}),
    ("fixed", {"block", "different_layout_per_head", "num_local_blocks", "num_global_blocks", "attention",
               "horizontal_global_attention", "num_different_global_patterns"}),
    ("variable", {"block", "different_layout_per_head", "num_random_blocks", "local_window_blocks",
                  "global_block_indices", "global_block_end_indices", "attention", "horizontal_global_attention"}),
    ("bigbird", {"block", "different_layout_per_head", "num_random_blocks", "num_sliding_window_blocks",
                 "num_global_blocks"}),
    ("bslongformer", {"block", "different_layout_per_head", "num_sliding_window_blocks", "global_block_indices",
                      "global_block_end_indices"}),
])
def test_sparse_attention_mode_reads_its_documented_keys(mode, expected_keys):
    sa = _model(sparse_attention={"mode": mode, "block": 32}).sparse_attention
    params = sa.mode_params()
    assert set(params) == expected_keys
    assert params["block"] == 32


def test_sparse_attention_reference_example_is_valid():
    example = {"mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 4,
               "num_global_blocks": 1, "attention": "bidirectional", "horizontal_global_attention": False,
               "num_different_global_patterns": 4, "num_random_blocks": 0, "local_window_blocks": [4],
               "global_block_indices": [0], "global_block_end_indices": None, "num_sliding_window_blocks": 3}
    sa = _model(sparse_attention=example).sparse_attention
    assert sa.num_different_global_patterns == 4 and sa.mode_params()["num_local_blocks"] == 4


@pytest.mark.parametrize("section,fragment", [
    ({"mode": "fixed", "attention": "unidirectional", "horizontal_global_attention": True},
     "horizontal_global_attention is only valid with attention 'bidirectional'"),
    ({"mode": "fixed", "num_local_blocks": 4, "num_global_blocks": 3},
     "num_local_blocks (4) must be divisible by num_global_blocks (3)"),
    ({"mode": "fixed", "num_different_global_patterns": 2},
     "num_different_global_patterns > 1 needs different_layout_per_head true"),
    ({"mode": "fixed", "different_layout_per_head": True, "num_local_blocks": 4, "num_global_blocks": 2,
      "num_different_global_patterns": 3}, "cannot exceed num_local_blocks // num_global_blocks = 2"),
    ({"mode": "variable", "global_block_indices": [0, 4], "global_block_end_indices": [2]},
     "global_block_end_indices (1 entries) must have as many entries as global_block_indices (2)"),
    ({"mode": "bslongformer", "global_block_indices": [3], "global_block_end_indices": [3]},
     "each global window must end after it starts"),
    ({"mode": "variable", "local_window_blocks": []}, "local_window_blocks must not be empty"),
    ({"mode": "fixed", "attention": "sideways"}, "'unidirectional' or 'bidirectional'"),
])
def test_sparse_attention_mode_rules(section, fragment):
    msg = _err(sparse_attention=section)
    assert "sparse_attention" in msg and fragment in msg


def test_unidirectional_fixed_without_horizontal_is_fine():
    sa = _model(sparse_attention={"mode": "fixed", "attention": "unidirectional"}).sparse_attention
    assert sa.attention == "unidirectional"


# ---------------------------------------------------------------- compression


@pytest.mark.parametrize("section,fragment", [
    ({"weight_quantization": {"different_groups": {"g": {"params": {"start_bits": 4, "target_bits": 8}}}}},
     "target_bits (8) must be <= start_bits (4)"),
    ({"activation_quantization": {"different_groups": {"g": {"params": {"bits": 2}}}}},
     "greater than or equal to 4"),
    ({"sparse_pruning": {"shared_parameters": {"block_pattern": "4by1"}}}, "'NxM' or 'N:M'"),
    ({"sparse_pruning": {"shared_parameters": {"enabled": True, "method": "snip_momentum",
                                               "schedule_offset": 30}}},
     "needs schedule_offset_end (0) greater than schedule_offset (30)"),
    ({"head_pruning": {"shared_parameters": {"enabled": True}}}, "num_heads is required"),
    ({"head_pruning": {"shared_parameters": {"method": "l1"}}}, "'topk'"),
    ({"row_pruning": {"different_groups": {"rp1": {"params": {"dense_ratio": 0}}}}}, "greater than 0"),
    ({"layer_reduction": {"enabled": True, "keep_number_layer": 3, "teacher_layer": [1, 2]}},
     "teacher_layer has 2 entries but keep_number_layer is 3"),
    ({"weight_quantization": {"shared_parameters": {"rounding": "up"}}}, "'nearest' or 'stochastic'"),
])
def test_compression_rules(section, fragment):
    msg = _err(compression_training=section)
    assert "compression_training." in msg and fragment in msg


def test_compression_enabled_flag_reflects_techniques():
    off = _model(compression_training={"row_pruning": {"shared_parameters": {"enabled": False}}})
    on = _model(compression_training={"row_pruning": {"shared_parameters": {"enabled": True}}})
    assert off.compression_training.enabled is False and off.compression_training.enabling_keys() == []
    assert on.compression_training.enabled is True


# ---------------------------------------------------------------- data efficiency / curriculum


@pytest.mark.parametrize("section,fragment", [
    ({"enabled": True, "min_difficulty": 8}, "curriculum_learning needs 'max_difficulty', 'schedule_type'"),
    ({"enabled": True, "min_difficulty": 64, "max_difficulty": 8, "schedule_type": "fixed_linear"},
     "min_difficulty (64) must not exceed max_difficulty (8)"),
    ({"enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_root",
      "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}, "needs 'root_degree'"),
    ({"enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_discrete",
      "schedule_config": {"difficulty": [8, 16, 64], "max_step": [10, 20, 30]}},
     "'difficulty' needs exactly one more entry than 'max_step'"),
    ({"schedule_type": "exponential"}, "'fixed_linear', 'fixed_root', 'fixed_discrete' or 'custom'"),
])
def test_legacy_curriculum_rules(section, fragment):
    msg = _err(curriculum_learning=section)
    assert "curriculum_learning" in msg and fragment in msg


def test_legacy_curriculum_discrete_schedule_accepted_when_lengths_match():
    cl = _model(curriculum_learning={"enabled": True, "min_difficulty": 8, "max_difficulty": 64,
                                     "schedule_type": "fixed_discrete",
                                     "schedule_config": {"difficulty": [8, 16, 64], "max_step": [10, 20]}})
    assert cl.curriculum_learning.schedule_config.max_step == [10, 20]


def test_disabled_legacy_curriculum_needs_nothing_else():
    assert _model(curriculum_learning={"enabled": False}).curriculum_learning.enabled is False


def _random_ltd(**over):
    ltd = {"enabled": True, "total_layer_num": 4, "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
           "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
           "random_ltd_schedule": {"min_value": 16, "max_value": 64,
                                   "schedule_config": {"require_steps": 100, "seq_per_step": 8}}}
    ltd.update(over)
    return {"data_routing": {"enabled": True, "random_ltd": ltd}}


def test_random_ltd_complete_config_parses():
    de = _model(data_efficiency=_random_ltd()).data_efficiency
    assert de.data_routing.random_ltd.random_ltd_layer_id == [1, 2]


@pytest.mark.parametrize("over,fragment", [
    ({"random_ltd_layer_id": [1]}, "random_ltd_layer_id has 1 entries but random_ltd_layer_num is 2"),
    ({"random_ltd_layer_id": [1, 4]}, "entries [4] are outside 0..3"),
    ({"model_type": "seq2seq"}, "'decoder' or 'encoder'"),
    ({"model_mask_name": None}, "needs 'model_mask_name'"),
    ({"random_ltd_schedule": {"min_value": 128, "max_value": 64,
                              "schedule_config": {"require_steps": 1, "seq_per_step": 8}}},
     "min_value (128) must not exceed max_value (64)"),
])
def test_random_ltd_rules(over, fragment):
    msg = _err(data_efficiency=_random_ltd(**over))
    assert "data_efficiency.data_routing.random_ltd" in msg and fragment in msg


def test_data_sampling_curriculum_needs_metrics():
    msg = _err(data_efficiency={"data_sampling": {"curriculum_learning": {"enabled": True,
                                                                           "data_cluster_path": "/tmp"}}})
    assert "needs at least one entry in 'curriculum_metrics'" in msg


def test_data_sampling_metric_difficulty_type_enum():
    msg = _err(data_efficiency={"data_sampling": {"curriculum_learning": {
        "curriculum_metrics": {"seqlen": {"difficulty_type": "absolute"}}}}})
    assert "curriculum_metrics.seqlen.difficulty_type" in msg and "'value' or 'percentile'" in msg


# ---------------------------------------------------------------- others


@pytest.mark.parametrize("section,key,fragment", [
    ("elasticity", {"min_gpus": 8, "max_gpus": 4}, "min_gpus (8) must not exceed max_gpus (4)"),
    ("elasticity", {"version": 0.3}, "version must be 0.1 or 0.2"),
    ("elasticity", {"micro_batch_sizes": [2, 0]}, "non-empty list of positive integers"),
    ("autotuning", {"start_profile_step": 6, "end_profile_step": 5},
     "end_profile_step (5) must not be less than start_profile_step (6)"),
    ("autotuning", {"tuner_type": "bayes"}, "'gridsearch', 'random' or 'model_based'"),
    ("comet", {"experiment_key": "0c4a1c4a90664f2a8084e600b19a9d7"}, "32 to 50 alphanumeric characters"),
    ("quantize_training", {"quantize_bits": {"start_bits": 8, "target_bits": 16}},
     "target_bits (16) must be <= start_bits (8)"),
    ("eigenvalue", {"max_iter": 0}, "greater than or equal to 1"),
    ("hybrid_engine", {"inference_tp_size": 0}, "greater than or equal to 1"),
    ("nebula", {"num_of_version_in_retention": 0}, "greater than or equal to 1"),
    ("flops_profiler", {"module_depth": -2}, "greater than or equal to -1"),
])
def test_other_section_rules(section, key, fragment):
    msg = _err(**{section: key})
    assert section in msg and fragment in msg


def test_autotuning_metric_spelled_as_in_the_reference():
    assert _model(autotuning={"metric": "FLOPS"}).autotuning.metric == "flops"


@pytest.mark.parametrize("spelling", ["quantize-algo", "quantize_algo"])
def test_quantize_algo_both_spellings(spelling):
    qt = _model(quantize_training={spelling: {"q_type": "asymmetric", "rounding": "stochastic"}}).quantize_training
    assert (qt.quantize_algo.q_type, qt.quantize_algo.rounding) == ("asymmetric", "stochastic")
