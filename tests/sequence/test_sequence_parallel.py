"""DeepSpeed-Ulysses: DistributedAttention, the loss helper, and training through the engine
with sequence parallelism composed with data parallelism and ZeRO, against plain PyTorch on
the full sequences."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist import run_distributed
from tests.sequence import _models as M

LR = 1e-2
STEPS = 2


def _check_attention(rank, ws, group):
    """DistributedAttention on sequence shards == full attention (output, input and weight grads)."""
    from deepspeed.sequence.layer import DistributedAttention
    torch.manual_seed(0)
    b, s, h, d = 2, 8, 4, 3
    x = torch.randn(b, s, 5)
    w = torch.randn(5, 3 * h * d)
    # reference: full sequence, one process
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    q, k, v = (xr @ wr).view(b, s, 3, h, d).unbind(2)
    ref = M.causal_sdpa(q, k, v)
    gout = torch.randn_like(ref)
    (ref * gout).sum().backward()
    # sequence parallel: this rank's tokens, [b, s/P, h, d] (batch_dim_idx=0)
    n = s // ws
    sl = slice(rank * n, (rank + 1) * n)
    xs, ws_ = x[:, sl].clone().requires_grad_(), w.clone().requires_grad_()
    q, k, v = (xs @ ws_).view(b, n, 3, h, d).unbind(2)
    attn = DistributedAttention(M.causal_sdpa, group, scatter_idx=2, gather_idx=1)
    out = attn(q, k, v, 0)
    (out * gout[:, sl]).sum().backward()
    wgrad = ws_.grad.clone()
    torch.distributed.all_reduce(wgrad, group=group)   # each rank holds its tokens' share
    res = {"out": (out - ref[:, sl]).abs().max().item(), "xgrad": (xs.grad - xr.grad[:, sl]).abs().max().item(),
           "wgrad": (wgrad - wr.grad).abs().max().item()}
    # [s, b, h, d] layout (Megatron's): gather_idx=0 / batch_dim_idx=1
    attn_sb = DistributedAttention(lambda q, k, v: M.causal_sdpa(q.transpose(0, 1), k.transpose(0, 1),
                                                                 v.transpose(0, 1)).transpose(0, 1), group)
    qs, ks, vs = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    res["out_sbhd"] = (attn_sb(qs, ks, vs, 1).transpose(0, 1) - out).abs().max().item()
    res["out_sbhd_gather_idx"] = (attn_sb(qs, ks, vs).transpose(0, 1) - out).abs().max().item()
    try:  # 3 heads on 2 ranks
        attn(torch.randn(b, n, 3, d), torch.randn(b, n, 3, d), torch.randn(b, n, 3, d), 0)
        res["uneven"] = None
    except ValueError as err:
        res["uneven"] = str(err)
    return res


def _check_cross_entropy(rank, ws, group):
    from deepspeed.sequence.cross_entropy import vocab_sequence_parallel_cross_entropy
    torch.manual_seed(1)
    s, b, v = 8, 2, 11
    logits = torch.randn(s, b, v)
    tgt = torch.randint(0, v, (s, b))
    tgt[3, 1] = -100
    lr_ = logits.clone().requires_grad_()
    ref = F.cross_entropy(lr_.reshape(-1, v), tgt.reshape(-1), reduction="none", ignore_index=-100).view(s, b)
    ref.sum().backward()
    n = s // ws
    ls = logits[rank * n:(rank + 1) * n].clone().requires_grad_()
    got = vocab_sequence_parallel_cross_entropy(ls, tgt[rank * n:(rank + 1) * n], group)
    got.sum().backward()
    return {"loss": (got - ref).abs().max().item(),
            "grad": (ls.grad - lr_.grad[rank * n:(rank + 1) * n]).abs().max().item()}


def _train(rank, ws, sp, stage, data, seed=7, save_dir=None):
    """Train TinyAttnLM through deepspeed.initialize with sequence_parallel_size=sp; returns the
    full parameters after each step (rank 0), plus what the groups report."""
    import deepspeed
    from deepspeed.utils import groups
    dp = ws // sp
    cfg = {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": sp, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": LR}},
           "steps_per_print": 1000}
    torch.manual_seed(seed)
    model = M.TinyAttnLM(sp_group=None)
    # the SP groups are made by initialize; the attention needs the group, so build the engine first
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    group = groups._get_sequence_parallel_group()
    from deepspeed.sequence.layer import DistributedAttention
    model.attn = DistributedAttention(M.causal_sdpa, group, 2, 1)
    info = {"sp_ws": groups._get_sequence_parallel_world_size(), "sp_rank": groups._get_sequence_parallel_rank(),
            "dp_ws": groups._get_data_parallel_world_size(), "dp_rank": groups._get_data_parallel_rank(),
            "sdp_ws": groups._get_sequence_data_parallel_world_size(),
            "engine_sp_group_is_group": engine.get_sequence_parallel_group() is group,
            "engine_dp_ws": engine.dp_world_size, "train_batch_size": engine.train_batch_size(),
            "dp_ranks": torch.distributed.get_process_group_ranks(groups._get_data_parallel_group()),
            "sp_ranks": torch.distributed.get_process_group_ranks(group)}
    sp_rank, dp_rank = info["sp_rank"], info["dp_rank"]
    snaps, losses = [], []
    for ids, tgt in data:
        mb = slice(dp_rank * 2, dp_rank * 2 + 2)    # this data-parallel rank's micro-batch
        loss = M.sp_loss(engine, ids[mb], tgt[mb], sp_rank, sp, group)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        sd = engine.module_state_dict()
        snaps.append({k: v.detach().clone() for k, v in sd.items()} if rank == 0 else None)
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="sp")
    return {"info": info, "snaps": snaps, "losses": losses}


def _world_body(rank, ws, ckpt_dir):
    from deepspeed.utils import groups
    out = {}
    data = M.batches(STEPS, batch=2 * 1)
    out["train0"] = _train(rank, ws, 2, 0, data)
    group = groups._get_sequence_parallel_group()
    out["attention"] = _check_attention(rank, ws, group)
    out["cross_entropy"] = _check_cross_entropy(rank, ws, group)
    out["train3"] = _train(rank, ws, 2, 3, data, save_dir=ckpt_dir)
    import deepspeed
    eng, *_ = deepspeed.initialize(model=M.TinyAttnLM(), mesh_param=(1, 2),
                                   config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam"}})
    out["mesh"] = (eng.sequence_parallel_size, eng.dp_world_size, eng.seq_dp_world_size, eng.train_batch_size())
    return out


def _resume_body(rank, ws, ckpt_dir, data):
    """Load the sequence-parallel (sp=2, ZeRO-3) checkpoint in one process (sp=1) and train on."""
    import deepspeed
    torch.manual_seed(99)
    model = M.TinyAttnLM()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "Adam", "params": {"lr": LR}}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    engine.load_checkpoint(ckpt_dir, tag="sp")
    loaded = {k: v.detach().clone() for k, v in engine.module_state_dict().items()}
    ids, tgt = data[-1]
    engine.backward(M.full_loss(engine, ids, tgt))
    engine.step()
    return {"loaded": loaded, "next": {k: v.detach().clone() for k, v in engine.module_state_dict().items()}}


def combined_body(rank, ws, ckpt_dir):
    """One spawned world of 2 for every fast check in tests/sequence (conftest's sp2_world)."""
    from tests.sequence.test_ulysses_sp_hf import _hf_body, check_tiled_under_zero
    out = _world_body(rank, ws, ckpt_dir)
    out["tiled_zero"] = check_tiled_under_zero(rank, ws)   # plain data parallelism after the SP engines
    out["hf"] = _hf_body(rank, ws)   # replaces Transformers' sdpa in this process: last
    return out


def test_distributed_attention_matches_full_attention(sp2_world):
    res, _ = sp2_world
    for r in res:
        a = r["attention"]
        assert a["out"] < 1e-5 and a["xgrad"] < 1e-5 and a["wgrad"] < 1e-5, a
        assert a["out_sbhd"] < 1e-6 and a["out_sbhd_gather_idx"] < 1e-6, a
        assert a["uneven"] is not None and "3 heads" in a["uneven"] and "sequence-parallel world size 2" in a["uneven"]


def test_vocab_sequence_parallel_cross_entropy(sp2_world):
    res, _ = sp2_world
    for r in res:
        assert r["cross_entropy"]["loss"] < 1e-5 and r["cross_entropy"]["grad"] < 1e-6, r["cross_entropy"]


@pytest.mark.parametrize("stage", [0, 3])
def test_sp2_training_equals_plain_pytorch(sp2_world, stage):
    res, _ = sp2_world
    data = M.batches(STEPS, batch=2)
    ref = M.reference_params(data, LR, seed=7)
    run = res[0][f"train{stage}"]
    for step, (got, want) in enumerate(zip(run["snaps"], ref)):
        for k in want:
            assert torch.allclose(got[k].float(), want[k], atol=2e-6, rtol=1e-5), (stage, step, k)
    # both sequence ranks saw the same (full-sequence) loss
    assert res[0][f"train{stage}"]["losses"] == pytest.approx(res[1][f"train{stage}"]["losses"], abs=1e-6)
    info = [r[f"train{stage}"]["info"] for r in res]
    assert [i["sp_rank"] for i in info] == [0, 1]
    assert all(r["mesh"] == (2, 1, 2, 2) for r in res)   # mesh_param=(dp=1, sp=2)
    for i in info:
        assert i["sp_ws"] == 2 and i["dp_ws"] == 1 and i["sdp_ws"] == 2 and i["engine_dp_ws"] == 1
        assert i["engine_sp_group_is_group"] and i["train_batch_size"] == 2 and i["sp_ranks"] == [0, 1]


@pytest.mark.slow
def test_checkpoint_reloads_at_another_sequence_parallel_degree(sp2_world):
    res, ckpt = sp2_world
    data = M.batches(STEPS + 1, batch=2)
    ref = M.reference_params(data, LR, seed=7)
    out = run_distributed(_resume_body, world_size=1, args=(ckpt, data), timeout=120)[0]
    import glob
    import os
    states = sorted(glob.glob(os.path.join(ckpt, "sp", "*mp_rank_00_model_states.pt")))[0]   # ZeRO-3: zero_pp_rank_0_...
    # DeepSpeed writes the sequence-data-parallel size here (sp 2 x dp 1), not dp alone
    assert torch.load(states, weights_only=False, map_location="cpu")["dp_world_size"] == 2
    for k in ref[STEPS - 1]:
        assert torch.equal(out["loaded"][k].float(), res[0]["train3"]["snaps"][-1][k].float()), k
        assert torch.allclose(out["next"][k].float(), ref[STEPS][k], atol=2e-6, rtol=1e-5), k


def test_config_key_validation():
    from deepspeed.config import DeepSpeedConfig
    from deepspeed.config.errors import DeepSpeedConfigError
    with pytest.raises(DeepSpeedConfigError, match="sequence_parallel_size"):
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 0}, world_size=1)
    from deepspeed.utils.groups import _get_sequence_parallel_ranks
    assert _get_sequence_parallel_ranks(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [0, 1, 2, 3])
    with pytest.raises(ValueError, match="must divide the world size 4"):
        _get_sequence_parallel_ranks(4, 3)
    from deepspeed.runtime.sequence_parallel.engine_groups import resolve_sequence_parallel_mpu
    with pytest.raises(DeepSpeedConfigError, match="data_parallel_size 2 x sequence_parallel_size 2 = 4 must equal "
                                                   "the world size 1"):
        resolve_sequence_parallel_mpu(None, {"data_parallel_size": 2, "sequence_parallel_size": 2})
    with pytest.raises(ValueError, match="mesh_param must be"):
        resolve_sequence_parallel_mpu(None, {}, mesh_param=3)
    with pytest.raises(ValueError, match="mesh_param .* has sequence_parallel_size 1"):
        resolve_sequence_parallel_mpu(None, {"sequence_parallel_size": 2}, mesh_param=(2, 1))


def _dp2_body(rank, ws, stage):
    data = M.batches(STEPS, batch=4)
    return _train(rank, ws, 2, stage, data)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sp2_x_dp2_training_equals_plain_pytorch(stage):
    res = run_distributed(_dp2_body, world_size=4, args=(stage,), timeout=300)
    data = M.batches(STEPS, batch=4)
    ref = M.reference_params(data, LR, seed=7)
    for step, (got, want) in enumerate(zip(res[0]["snaps"], ref)):
        for k in want:
            assert torch.allclose(got[k].float(), want[k], atol=2e-6, rtol=1e-5), (stage, step, k)
    info = [r["info"] for r in res]
    assert [i["sp_ranks"] for i in info] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [i["dp_ranks"] for i in info] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(i["dp_ws"] == 2 and i["sdp_ws"] == 4 and i["train_batch_size"] == 4 for i in info)


def _sp4_body(rank, ws):
    import torch.distributed as dist
    return {"attention": _check_attention(rank, ws, dist.group.WORLD),
            "cross_entropy": _check_cross_entropy(rank, ws, dist.group.WORLD)}


@pytest.mark.slow
def test_distributed_attention_at_sp4_matches_full_attention():
    for r in run_distributed(_sp4_body, world_size=4, timeout=240):
        a = r["attention"]
        assert a["out"] < 1e-5 and a["xgrad"] < 1e-5 and a["wgrad"] < 1e-5, a
        assert a["out_sbhd"] < 1e-6 and "sequence-parallel world size 4" in a["uneven"]
        assert r["cross_entropy"]["loss"] < 1e-5 and r["cross_entropy"]["grad"] < 1e-6
