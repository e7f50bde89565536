"""DeepSpeed's engine accessors for config values, and ``engine.load_module_state_dict``
(one process). Expected values are the ones written in the config below, or DeepSpeed's
documented defaults."""
import pytest
import torch

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from tests.helpers.models import make_model


def _engine(cfg, seed=0):
    model = make_model(seed=seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


CFG = {
    "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "steps_per_print": 7,
    "wall_clock_breakdown": True, "gradient_clipping": 0.5, "prescale_gradients": True,
    "gradient_predivide_factor": 2.0, "communication_data_type": "fp32",
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "auto_cast": True},
    "data_types": {"grad_accum_dtype": "fp32"},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 1234, "allgather_bucket_size": 5678,
                          "contiguous_gradients": False, "reduce_scatter": False, "sub_group_size": 99,
                          "offload_optimizer": {"device": "cpu"}},
}


def test_config_accessors_read_the_config():
    e = _engine(CFG)
    assert e.get_batch_info() == (6, 3, 2)
    assert (e.steps_per_print(), e.wall_clock_breakdown(), e.memory_breakdown(), e.dump_state()) == (7, True, False, False)
    assert (e.gradient_clipping(), e.prescale_gradients(), e.postscale_gradients(), e.gradient_predivide_factor()) \
        == (0.5, True, False, 2.0)
    assert e.communication_data_type() == torch.float32 and not e.sparse_gradients_enabled()
    assert (e.fp16_enabled(), e.bfloat16_enabled(), e.amp_enabled(), e.fp16_auto_cast()) == (True, False, False, True)
    assert e.dynamic_loss_scale() and e.initial_dynamic_scale() == 1024.0
    assert e.get_data_types() == (torch.float16, torch.float32)
    assert (e.zero_optimization(), e.zero_optimization_stage()) == (True, 2)
    assert e.zero_optimization_partition_gradients() and not e.zero_optimization_partition_weights()
    assert (e.zero_reduce_bucket_size(), e.zero_allgather_bucket_size(), e.zero_sub_group_size()) == (1234, 5678, 99)
    # overlap_comm unset: on, as the stage-2 strategy really runs it
    assert (e.zero_contiguous_gradients(), e.zero_reduce_scatter(), e.zero_overlap_comm()) == (False, False, True)
    assert e.optimizer.overlap is True and e.optimizer.reduce_bucket_size == 1234
    assert e.zero_cpu_offload() and e.zero_offload_optimizer().device == "cpu" and e.zero_offload_param() is None
    assert (e.optimizer_name(), e.optimizer_params()) == ("adamw", {"lr": 0.01, "weight_decay": 0.1})
    assert (e.scheduler_name(), e.scheduler_params()) == ("WarmupLR", {"warmup_num_steps": 5})


def test_defaults_and_batch_setters():
    e = _engine({"train_batch_size": 4})
    assert e.get_batch_info() == (4, 4, 1)
    assert (e.zero_optimization(), e.zero_overlap_comm(), e.fp16_enabled(), e.dynamic_loss_scale()) \
        == (False, True, False, False)
    assert e.get_data_types() == (torch.float32, torch.float32) and e.communication_data_type() is None
    # reduce_bucket_size unset: the 4M-element buckets stage 0 really uses, not DeepSpeed's 5e8
    assert e.zero_reduce_bucket_size() == 2 ** 22
    assert (e.zero_max_live_parameters(), e.zero_max_reuse_distance(), e.zero_prefetch_bucket_size(),
            e.zero_param_persistence_threshold()) == (10**9, 10**9, 5 * 10**7, 10**5)   # documented defaults
    assert not e.zero_gather_16bit_weights_on_model_save() and e.zero_load_from_fp32_weights()
    e.set_train_micro_batch_size(2)
    assert e.get_batch_info() == (2, 2, 1)
    e.set_train_batch_size(6)
    assert e.get_batch_info() == (6, 2, 3)
    with pytest.raises(ValueError, match=r"multiple of train_micro_batch_size_per_gpu \(2\)"):
        e.set_train_batch_size(5)
    with pytest.raises(ValueError, match="positive integer"):
        e.set_train_micro_batch_size(0)


def test_load_module_state_dict_refreshes_masters():
    e = _engine({"train_batch_size": 2, "bf16": {"enabled": True},
                 "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    other = make_model(seed=7).state_dict()
    e.load_module_state_dict({"module": other, "global_steps": 3})   # DeepSpeed's checkpoint-dict form
    for n, p in e.module.named_parameters():
        assert torch.equal(p, other[n].to(p.dtype)), n
        assert torch.equal(safe_get_full_fp32_param(p), p.float()), n   # masters follow the loaded weights
    e.load_module_state_dict(make_model(seed=8).state_dict())          # a plain state dict works too
    assert torch.equal(e.module.state_dict()["layers.0.weight"],
                       make_model(seed=8).state_dict()["layers.0.weight"].bfloat16())
    with pytest.raises(TypeError, match="expected a state dict"):
        e.load_module_state_dict([1, 2])


def test_custom_load_fn_in_load_module_state_dict_and_load_checkpoint(tmp_path):
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    src = _engine(cfg, seed=3)
    src.save_checkpoint(str(tmp_path))
    calls = []

    def halve(src, dst):
        calls.append(sorted(src))
        dst.load_state_dict({k: v / 2 for k, v in src.items()})

    # (with load_optimizer_states=True the saved fp32 weights would be restored over it, as in
    # DeepSpeed with load_from_fp32_weights; custom_load_fn goes with module-only loads)
    for kw in ({"load_module_only": True}, {"load_optimizer_states": False}):
        e = _engine(cfg)
        e.load_checkpoint(str(tmp_path), custom_load_fn=halve, **kw)
        assert calls[-1] == sorted(src.module.state_dict())
        for n, p in e.module.named_parameters():
            assert torch.equal(p, src.module.state_dict()[n] / 2), (kw, n)
    e.load_module_state_dict({"module": src.module.state_dict()}, custom_load_fn=halve)
    assert len(calls) == 3


def test_custom_load_fn_refused_at_stage3():
    e = _engine({"train_batch_size": 2, "zero_optimization": {"stage": 3},
                 "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    with pytest.raises(ValueError, match="custom_load_fn cannot be used with zero_optimization.stage 3"):
        e.load_module_state_dict(make_model(seed=1).state_dict(), custom_load_fn=lambda src, dst: None)
