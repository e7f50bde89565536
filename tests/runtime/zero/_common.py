"""Shared pieces of the ZeRO 1/2 tests: a tiny model with two parameter groups and a
frozen parameter, the engine loop, and the plain-PyTorch reference on the same global batches."""
from __future__ import annotations

import torch

from tests.helpers.models import global_batches, make_model, micro_slice

HIDDEN = 16


def make_net(seed=0):
    """3-layer MLP (8->16->16->4, 484 parameters); ``layers.0.bias`` is frozen."""
    m = make_model(seed=seed, hidden=HIDDEN, layers=3)
    m.layers[0].bias.requires_grad_(False)
    return m


def param_groups(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias") and p.requires_grad]
    return [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0, "lr": 0.02}]


def make_optimizer(name, groups):
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=0.01)
    raise ValueError(name)


def ds_config(stage, gas, mb, dtype="fp32", clip=0.5, bucket=60, **zero):
    cfg = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "steps_per_print": 0, "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                                       "allgather_bucket_size": bucket, **zero}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def build_engine(cfg, opt_name="sgd", seed=0, **kw):
    import deepspeed
    model = make_net(seed)
    groups = param_groups(model)
    if "optimizer" in cfg:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg, **kw)
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg,
                                          optimizer=lambda gs: make_optimizer(opt_name, gs), **kw)
    return engine


def run_steps(engine, rank, world_size, batches, dtype="fp32"):
    gas = engine.gradient_accumulation_steps()
    mb = engine.train_micro_batch_size_per_gpu()
    for batch in batches:
        for m in range(gas):
            x, y = micro_slice(batch, rank, world_size, m, mb)
            if dtype == "bf16":
                x, y = x.bfloat16(), y.bfloat16()
            elif dtype == "fp16":
                x, y = x.half(), y.half()
            engine.backward(engine(x, y))
            engine.step()


def full_fp32(engine):
    """Every trainable parameter's full fp32 master (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if p.requires_grad}


def full_state(engine, key):
    from deepspeed.utils import safe_get_full_optimizer_state
    return {n: safe_get_full_optimizer_state(p, key) for n, p in engine.module.named_parameters() if p.requires_grad}


def reference(n_steps, global_batch, opt_name="sgd", clip=0.5, first=0):
    """Plain PyTorch, fp32, one step per global batch; returns {name: param}."""
    model = make_net(0)
    opt = make_optimizer(opt_name, param_groups(model))
    trainable = [p for p in model.parameters() if p.requires_grad]
    for x, y in global_batches(first + n_steps, global_batch)[:first + n_steps]:
        opt.zero_grad()
        model(x, y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, opt, model
