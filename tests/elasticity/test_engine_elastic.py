"""The engine trains with the elastic batch sizes at world size 1 and 2.

Config: max_train_batch_size 24, micro_batch_sizes [2, 3], v0.1 -> batch 24 (see
test_compute_elastic_config.py's worked example); micro batch = the largest listed
one dividing 24 / world_size: 3 at both sizes; gradient accumulation = 24 / (3 * ws):
8 at world size 1, 4 at world size 2. One optimizer step over one 24-sample batch must
equal plain PyTorch SGD on the same 24 samples.
"""
import json

import pytest
import torch

import deepspeed
from deepspeed.config import DeepSpeedConfig
from deepspeed.elasticity import ElasticityConfigError, ElasticityIncompatibleWorldSize
from tests.helpers.dist import run_distributed
from tests.helpers.models import global_batches, make_model, micro_slice, reference_train

ELASTIC = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 3], "version": 0.1}


def _config(**top):
    return {"elasticity": dict(ELASTIC), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **top}


def _train_one_step(rank, world_size):
    engine, *_ = deepspeed.initialize(model=make_model(seed=0), config=_config())
    sizes = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
             engine.gradient_accumulation_steps())
    batch = global_batches(1, 24)[0]
    for micro in range(sizes[2]):
        x, y = micro_slice(batch, rank, world_size, micro, sizes[1])
        engine.backward(engine(x, y))
        engine.step()
    ref = make_model(seed=0)
    reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [batch])
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    return sizes, engine.global_steps


def test_engine_world_size_1():
    assert _train_one_step(0, 1) == ((24, 3, 8), 1)


def test_engine_world_size_2():
    assert run_distributed(_train_one_step, world_size=2, timeout=120) == [((24, 3, 4), 1)] * 2


def test_config_rules(monkeypatch):
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG", raising=False)
    cfg = DeepSpeedConfig(_config(), world_size=4)       # 24 / 4 = 6 -> micro 3, gas 2
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (24, 3, 2)
    assert cfg.to_dict()["gradient_accumulation_steps"] == 2
    with pytest.raises(ElasticityIncompatibleWorldSize, match="World size \\(5\\)"):
        DeepSpeedConfig(_config(), world_size=5)
    # Batch keys outside the section: refused, or overridden with ignore_non_elastic_batch_info.
    with pytest.raises(ElasticityConfigError, match="ignore_non_elastic_batch_info"):
        DeepSpeedConfig(_config(train_batch_size=2), world_size=2)
    over = _config(train_batch_size=2, gradient_accumulation_steps=1)
    over["elasticity"]["ignore_non_elastic_batch_info"] = True
    cfg = DeepSpeedConfig(over, world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (24, 3, 4)
    # The scheduler's copy of the section must match the runtime's.
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(dict(ELASTIC, max_train_batch_size=27)))
    with pytest.raises(ElasticityConfigError, match="max_train_batch_size.*27.*24"):
        DeepSpeedConfig(_config(), world_size=2)
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps(ELASTIC))
    assert DeepSpeedConfig(_config(), world_size=2).train_batch_size == 24
    # Disabled: the section is parsed, batch sizes come from the usual keys.
    off = {"elasticity": dict(ELASTIC, enabled=False), "train_batch_size": 8}
    monkeypatch.delenv("DEEPSPEED_ELASTICITY_CONFIG")
    assert DeepSpeedConfig(off, world_size=2).train_micro_batch_size_per_gpu == 4


def test_resume_with_other_accumulation_keeps_boundaries(tmp_path):
    """What an elastic restart does at a new world size: the checkpoint was written with one
    gradient-accumulation count (here 1: micro 8), training resumes with another (2: micro 4),
    same global batch. The resumed step must accumulate both micro-batches before updating,
    like plain PyTorch on the global batch (DeepSpeed does not carry micro_steps over)."""
    cfg = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0}
    batches = global_batches(4, 8)
    engine, *_ = deepspeed.initialize(model=make_model(seed=0), config=dict(cfg, train_micro_batch_size_per_gpu=8))
    for b in batches[:3]:               # an odd number of micro steps: misaligned for 2 if carried over
        engine.backward(engine(*b))
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    engine, *_ = deepspeed.initialize(model=make_model(seed=0), config=dict(cfg, train_micro_batch_size_per_gpu=4))
    engine.load_checkpoint(str(tmp_path))
    for micro in range(2):
        x, y = micro_slice(batches[3], 0, 1, micro, 4)
        engine.backward(engine(x, y))
        engine.step()
    ref = make_model(seed=0)
    reference_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches)
    assert engine.global_steps == 4
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
