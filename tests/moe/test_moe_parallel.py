"""MoE with expert parallelism through the engine equals the same model computed in one
process without any parallelism (tests/moe/_model.py: reference_run), at ep 1/2/4, world
sizes 2 and 4 (incl. ep 2 x dp 2), ZeRO 0/1/2; clipping by the true global norm; the
zero-token case; fp16 overflow in one expert on one rank skips the step everywhere;
checkpoints saved at ep2 x dp2 continue identically at ep4 and ep1; zero_to_fp32."""
from __future__ import annotations

import os

import torch

from tests.helpers.dist import run_distributed

MB, STEPS, LR = 2, 3, 0.1


def _engine(model, stage, world, extra=None, opt="sgd", lr=LR):
    import deepspeed
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}}
    cfg.update(extra or {})
    # Adam eps 1e-4: the key bias of attention has a zero gradient up to rounding, which a
    # tiny eps would blow up into lr-sized updates that depend on summation order
    optim = (torch.optim.SGD(model.parameters(), lr=lr) if opt == "sgd"
             else torch.optim.Adam(model.parameters(), lr=lr, eps=1e-4))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=cfg)
    return engine


def _train(engine, data, rank, steps):
    """Each optimizer step: ``gas`` micro-steps, rank r taking shards r, r+world, ..."""
    norms = []
    gas, world = engine.gradient_accumulation_steps(), engine.dp_world_size
    for idx, lab in data[:steps]:
        for i in range(gas):
            loss = engine(idx[i * world + rank], lab[i * world + rank])
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


def _close(a, b, atol, what):
    assert set(a) == set(b), f"{what}: names differ {set(a) ^ set(b)}"
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=1e-4), \
            f"{what}: {k} differs by {(a[k] - b[k]).abs().max().item():.3g}"


PARITY_CASES_4 = [
    # name, model kwargs, ep, zero stage, extra config
    ("top1_ep1_dp4", dict(k=1), 1, 0, {}),
    ("top1_ep2_dp2", dict(k=1), 2, 0, {}),
    ("top1_ep4", dict(k=1), 4, 0, {}),
    ("top2_residual_ep2_dp2", dict(k=2, use_residual=True), 2, 0, {}),
    ("top2_drop_cf05_ep4", dict(k=2, capacity_factor=0.5), 4, 0, {}),
    ("top1_nodrop_ep4", dict(k=1, drop_tokens=False), 4, 0, {}),
    ("top1_residual_zero1_ep2_dp2", dict(k=1, use_residual=True), 2, 1, {}),
    ("top2_zero2_ep2_dp2", dict(k=2), 2, 2, {}),
    ("zero_tokens_ep2_dp2", dict(k=1, drop_tokens=False, zero_gate=True), 2, 0, {}),
    ("zero_tokens_zero2_ep4_clip", dict(k=1, zero_gate=True), 4, 2, {"gradient_clipping": 0.05}),
    ("clip_ep2_dp2", dict(k=2), 2, 0, {"gradient_clipping": 0.05}),
]


def _parity_body(rank, world, cases):
    from tests.moe._model import TinyMoEGPT, batches, gather_global_state, reference_run
    out = {}
    for name, kw, ep, stage, extra in cases:
        data = batches(STEPS, world * extra.get("gradient_accumulation_steps", 1), MB, seed=len(name))
        clip = extra.get("gradient_clipping", 0.0)
        _, ref, ref_norms = reference_run(kw, data, LR, STEPS, opt="sgd", clip=clip)
        engine = _engine(TinyMoEGPT(ep_size=ep, **kw), stage, world, {**extra, "gradient_clipping": clip})
        norms = _train(engine, data, rank, STEPS)
        got = gather_global_state(engine.module)
        tol = 3e-2 if "bf16" in extra else 1e-2 if "fp16" in extra else 2e-5   # 16-bit parameters
        _close(got, ref, tol, name)
        if clip:
            for a, b in zip(norms, ref_norms):
                assert abs(a - b) < 1e-4 * max(1.0, b), f"{name}: global norm {a} vs reference {b}"
        out[name] = True
    return out


def _world2_body(rank, world, cases):
    import time
    from tests.moe._model import TinyMoEGPT, batches
    parity = _parity_body(rank, world, cases)
    # engine.optimizer of an MoE model at ZeRO-2: one optimizer face over dense + expert
    # groups (LR schedule reaches both), state_dict round trip
    import deepspeed
    m = TinyMoEGPT(ep_size=2, k=1)
    eng, opt, _, sched = deepspeed.initialize(model=m, model_parameters=m.parameters(), config={
        "train_micro_batch_size_per_gpu": MB, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}}})
    _train(eng, batches(2, world, MB, seed=9), rank, 2)
    lrs = eng.get_lr()
    params = [p.detach().clone() for p in m.parameters()]
    import torch.distributed as dist
    every = [None] * world
    dist.all_gather_object(every, opt.state_dict())
    opt.load_state_dict(every)
    assert len(lrs) == 2 and lrs[0] == lrs[1] == sched.get_last_lr()[0] > 0, (lrs, sched.get_last_lr())
    assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
    # a rank failing between dispatch and combine: the other rank's all-to-all fails with
    # an error naming the collective (after the process-group timeout), it does not hang
    import datetime
    import torch.distributed as dist
    model = TinyMoEGPT(ep_size=2, k=1, drop_tokens=False)
    # a short timeout on this layer's expert-parallel group only (the rest keeps the default,
    # so a slow rank on a loaded host cannot fail the parity cases above)
    model.moe.deepspeed_moe._set_ep_group(dist.new_group([0, 1], timeout=datetime.timedelta(seconds=PG_TIMEOUT)))
    if rank == 1:
        def boom(*_):
            raise RuntimeError("expert exploded on rank 1")
        model.moe.deepspeed_moe.experts.deepspeed_experts[0].register_forward_pre_hook(boom)
    idx, lab = batches(1, world, MB, seed=2)[0]
    try:
        model(idx[rank], lab[rank])
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    if rank == 1:
        time.sleep(PG_TIMEOUT + 3)   # stay in the group until rank 0 has timed out
    return parity, err


PG_TIMEOUT = 3


def test_moe_world2():
    cases = [("top1_ep2", dict(k=1), 2, 0, {}),
             ("top2_residual_nodrop_zero2_ep2", dict(k=2, use_residual=True, drop_tokens=False), 2, 2, {}),
             ("top1_ep1_dp2_zero1", dict(k=1), 1, 1, {}),
             ("top2_bf16_zero1_ep2", dict(k=2), 2, 1, {"bf16": {"enabled": True}}),
             ("top1_gas2_zero2_ep2", dict(k=1), 2, 2, {"gradient_accumulation_steps": 2}),
             ("top1_fp16_zero2_ep2", dict(k=1), 2, 2, {"fp16": {"enabled": True, "initial_scale_power": 8}}),
             ("top1_gas2_ep2", dict(k=1, use_residual=True), 2, 0, {"gradient_accumulation_steps": 2})]
    res = run_distributed(_world2_body, world_size=2, args=(cases,), timeout=300)
    assert all(len(r[0]) == len(cases) for r in res)
    assert "expert exploded" in res[1][1]
    assert res[0][1].startswith("MoEAllToAllError") and "all-to-all (combine" in res[0][1], res[0][1]


def _overflow_body(rank, world):
    from tests.moe._model import TinyMoEGPT, batches
    data = batches(3, world, MB, seed=5)
    model = TinyMoEGPT(ep_size=2, k=1, drop_tokens=False)
    engine = _engine(model, 2, world, {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}})
    _train(engine, data, rank, 1)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    scale = engine.loss_scale
    victim = engine.module.moe.deepspeed_moe.experts.deepspeed_experts[0].fc1.weight
    h = victim.register_hook(lambda g: g * float("inf")) if rank == 3 else None  # one expert, one rank
    _train(engine, data[1:], rank, 1)
    if h is not None:
        h.remove()
    same = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    return engine.skipped_steps, same, engine.loss_scale < scale


def _ckpt_body(rank, world, path):
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from tests.moe._model import TinyMoEGPT, batches, gather_global_state
    kw = dict(k=2, use_residual=True)
    data = batches(4, world, MB, seed=11)
    eng = _engine(TinyMoEGPT(ep_size=2, **kw), 2, world, opt="adam", lr=0.01)   # ep 2 x dp 2, ZeRO-2
    _train(eng, data, rank, 2)
    eng.save_checkpoint(path, tag="t")
    saved = gather_global_state(eng.module)
    _train(eng, data[2:], rank, 2)
    expected = gather_global_state(eng.module)
    files = sorted(os.listdir(os.path.join(path, "t")))
    if rank == 0:
        cons = get_fp32_state_dict_from_zero_checkpoint(path, tag="t")
        _close({k: cons[k] for k in saved}, saved, 1e-6, "zero_to_fp32")
    results = {}
    for ep, stage in ((4, 2), (1, 0), (4, 0)):
        eng2 = _engine(TinyMoEGPT(ep_size=ep, seed=123, **kw), stage, world, opt="adam", lr=0.01)
        eng2.load_checkpoint(path, tag="t")
        _close(gather_global_state(eng2.module), saved, 1e-6, f"loaded at ep{ep} stage {stage}")
        _train(eng2, data[2:], rank, 2)
        _close(gather_global_state(eng2.module), expected, 2e-5, f"continued at ep{ep} stage {stage}")
        results[(ep, stage)] = eng2.global_steps
    dist.barrier()
    return files, results


def _world4_body(rank, world, path):
    # one spawned group for every world-4 case (process start-up dominates on CPU)
    parity = _parity_body(rank, world, PARITY_CASES_4)
    return parity, _overflow_body(rank, world), _ckpt_body(rank, world, path), _mpu_body(rank, world)


class _MPU:
    """Megatron-style mpu: tensor-parallel pairs [0,1] [2,3], data-parallel [0,2] [1,3]."""

    def __init__(self, rank):
        import torch.distributed as dist
        tp = [dist.new_group(r) for r in ([0, 1], [2, 3])]
        dp = [dist.new_group(r) for r in ([0, 2], [1, 3])]
        self.tp, self.dp, self.rank = tp[rank // 2], dp[rank % 2], rank

    def get_model_parallel_group(self):
        return self.tp

    def get_model_parallel_world_size(self):
        return 2

    def get_model_parallel_rank(self):
        return self.rank % 2

    def get_data_parallel_group(self):
        return self.dp

    def get_data_parallel_world_size(self):
        return 2

    def get_data_parallel_rank(self):
        return self.rank // 2


def _mpu_body(rank, world):
    """Expert groups composed with an mpu (tp 2 x dp 2, ep 2): expert-parallel groups are the
    data-parallel groups [0,2] [1,3]; an ep-2 MoE forward over them equals the same model
    in one process on each rank's tokens."""
    from deepspeed.utils import groups
    from tests.moe._model import TinyMoEGPT, batches
    groups._reset_expert_groups()
    mpu = _MPU(rank)
    groups._create_expert_data_and_model_parallel(2, mpu)
    ranks = (groups.get_expert_parallel_ranks("ep_size_2"), groups.get_expert_data_parallel_ranks("ep_size_2"))
    model = TinyMoEGPT(ep_size=2, k=2)
    ref = TinyMoEGPT(ep_size=1, k=2)
    idx, lab = batches(1, 2, MB, seed=21)[0]
    shard = rank // 2                                   # data-parallel rank picks the shard
    loss = model(idx[shard], lab[shard])
    assert torch.allclose(loss, ref(idx[shard], lab[shard]), atol=1e-6), (loss, ref(idx[shard], lab[shard]))
    return ranks


def test_moe_world4(tmp_path):
    res = run_distributed(_world4_body, world_size=4, args=(str(tmp_path),), timeout=500)
    # same parameters as the single-process model, every case
    assert all(len(r[0]) == len(PARITY_CASES_4) for r in res)
    # fp16 overflow in one expert on one rank: every rank skipped that step, kept its
    # parameters and lowered the loss scale
    assert all(r[1] == (1, True, True) for r in res), [r[1] for r in res]
    # expert groups follow the mpu's data-parallel groups
    assert [r[3] for r in res] == [([0, 2], [0]), ([1, 3], [1]), ([0, 2], [2]), ([1, 3], [3])]
    files, steps = res[0][2]
    assert all(v == 4 for v in steps.values())
    # DeepSpeed's layout: dense file + one file per global expert (4 experts, 1 layer)
    assert "mp_rank_00_model_states.pt" in files
    assert [f for f in files if f.startswith("layer_0_expert_")] == [
        f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)]
    dense = torch.load(os.path.join(tmp_path, "t", "mp_rank_00_model_states.pt"), weights_only=True)["module"]
    assert not any("deepspeed_experts" in k for k in dense)
