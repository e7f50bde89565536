"""Gating against hand-computed token assignments, the aux-loss formula, RTS, noise, the
MoE layer against a hand-rolled mixture, the optimizer helpers and the group layout.
Single process."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import TopKGate, top1gating, top2gating, topkgating
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import groups


def _assignments(combine):
    """{(token, expert): slot} of the non-zero entries of combine_weights [S, E, C]."""
    return {(s, e): c for s, e, c in combine.nonzero().tolist()}


# tokens 0,1,2,4 prefer expert 0; tokens 3,5 prefer expert 1
TOP1_LOGITS = torch.tensor([[2.0, 0.0], [1.0, 0.5], [3.0, 1.0], [0.0, 1.0], [0.7, 0.2], [-1.0, 2.0]])


def test_top1_capacity_drops_later_tokens():
    l_aux, combine, dispatch, counts = top1gating(TOP1_LOGITS, capacity_factor=1.0, min_capacity=0, use_rts=False)
    # capacity = ceil(6 tokens / 2 experts * 1.0) = 3: expert 0 keeps tokens 0,1,2 and drops token 4
    assert combine.shape == (6, 2, 3)
    assert _assignments(combine) == {(0, 0): 0, (1, 0): 1, (2, 0): 2, (3, 1): 0, (5, 1): 1}
    assert torch.equal(dispatch, combine > 0)
    assert counts.tolist() == [4, 2]       # routed before dropping, as DeepSpeed reports
    probs = F.softmax(TOP1_LOGITS, dim=1)
    for (s, e), c in _assignments(combine).items():
        assert combine[s, e, c].item() == pytest.approx(probs[s, e].item())   # top-1 weight: the gate probability


def test_top1_min_capacity_and_capacity_factor_and_no_drop():
    _, combine, _, _ = top1gating(TOP1_LOGITS, capacity_factor=1.0, min_capacity=4, use_rts=False)
    assert combine.shape[2] == 4 and _assignments(combine)[(4, 0)] == 3       # min_capacity 4 keeps token 4
    _, combine, _, _ = top1gating(TOP1_LOGITS, capacity_factor=0.5, min_capacity=0, use_rts=False)
    assert combine.shape[2] == 2                                              # ceil(6/2*0.5) = 2
    assert set(_assignments(combine)) == {(0, 0), (1, 0), (3, 1), (5, 1)}
    _, combine, _, _ = top1gating(TOP1_LOGITS, capacity_factor=0.5, min_capacity=0, drop_tokens=False)
    assert combine.shape[2] == 4                                              # the largest expert load
    assert set(_assignments(combine)) == {(0, 0), (1, 0), (2, 0), (4, 0), (3, 1), (5, 1)}


# first/second choice: t0 e0,e1; t1 e0,e2; t2 e1,e2; t3 e0,e1
TOP2_LOGITS = torch.tensor([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [0.0, 3.0, 2.0], [3.0, 2.0, 0.0]])


def test_top2_hand_computed():
    _, combine, _, counts = top2gating(TOP2_LOGITS, capacity_factor=0.5, min_capacity=0,
                                       top2_2nd_expert_sampling=False)
    # capacity = ceil(2 * 4 / 3 * 0.5) = 2. First choices placed first: e0 <- t0, t1 (t3 dropped),
    # e1 <- t2. Then second choices: e1 <- t0 (slot 1; t3 dropped), e2 <- t1, t2.
    assert combine.shape == (4, 3, 2)
    assert _assignments(combine) == {(0, 0): 0, (1, 0): 1, (2, 1): 0, (0, 1): 1, (1, 2): 0, (2, 2): 1}
    assert counts.tolist() == [3, 3, 2]
    p = F.softmax(TOP2_LOGITS, dim=1)
    for s, (a, b) in {0: (0, 1), 1: (0, 2), 2: (1, 2)}.items():   # weights renormalised over the kept pair
        assert combine[s, a].sum().item() == pytest.approx((p[s, a] / (p[s, a] + p[s, b])).item())
        assert combine[s, b].sum().item() == pytest.approx((p[s, b] / (p[s, a] + p[s, b])).item())
    assert combine[3].sum().item() == 0.0                         # token 3 lost both choices


def test_topk_general_matches_top2_and_k3():
    torch.manual_seed(0)
    logits = torch.randn(12, 4)
    _, c2, _, _ = top2gating(logits, 10.0, 0, top2_2nd_expert_sampling=False)
    _, ck, _, _ = topkgating(logits, 2, 10.0, 0)
    # nothing dropped: the same experts and weights per token (slots differ: top-2 places every first
    # choice before any second one, top-k follows token order, as DeepSpeed's)
    assert torch.allclose(c2.sum(dim=2), ck.sum(dim=2))
    _, c3, _, counts = topkgating(logits, 3, 10.0, 0)             # nothing dropped at a large factor
    top3 = torch.topk(logits, 3, dim=1).indices
    p = F.softmax(logits, dim=1)
    for s in range(12):
        chosen = set(top3[s].tolist())
        assert {e for e in range(4) if c3[s, e].sum() > 0} == chosen
        assert c3[s].sum().item() == pytest.approx(1.0)
        for e in chosen:
            assert c3[s, e].sum().item() == pytest.approx((p[s, e] / p[s, list(chosen)].sum()).item())
    assert c3.shape[2] == math.ceil(3 * 12 / 4 * 10.0)


def test_aux_loss_formula():
    torch.manual_seed(1)
    logits = torch.randn(16, 4)
    p = F.softmax(logits, dim=1)
    first = F.one_hot(p.argmax(1), 4).float()
    expected = 4 * (p.mean(0) * first.mean(0)).sum()              # Switch/GShard: E * sum_e me_e * ce_e
    l1, *_ = top1gating(logits, 1.0, 0, use_rts=False)
    l2, *_ = top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False)
    assert l1.item() == pytest.approx(expected.item(), rel=1e-6)
    assert l2.item() == pytest.approx(expected.item(), rel=1e-6)  # top-2: E^2 * mean_e == E * sum_e
    top3 = torch.zeros(16, 4).scatter_(1, torch.topk(logits, 3, 1).indices, 1.0)
    l3, *_ = topkgating(logits, 3, 1.0, 0)
    assert l3.item() == pytest.approx((16 / 3 * (p.mean(0) * top3.mean(0)).mean()).item(), rel=1e-6)
    # uniform routing and uniform probabilities give the minimum, 1
    lu, *_ = top1gating(torch.zeros(8, 4) + torch.eye(4).repeat(2, 1) * 1e-6, 1.0, 0, use_rts=False)
    assert lu.item() == pytest.approx(1.0, rel=1e-4)


def test_random_token_selection_keeps_a_seeded_random_subset():
    logits = torch.zeros(20, 2)
    logits[:, 0] = 1.0                                             # every token wants expert 0
    torch.manual_seed(3)
    _, a, _, _ = top1gating(logits, 1.0, 0, use_rts=True)
    torch.manual_seed(3)
    _, b, _, _ = top1gating(logits, 1.0, 0, use_rts=True)
    torch.manual_seed(4)
    _, c, _, _ = top1gating(logits, 1.0, 0, use_rts=True)
    kept = sorted(s for s, _ in _assignments(a))
    assert len(kept) == 10                                         # capacity ceil(20/2) = 10
    assert torch.equal(a, b)                                       # deterministic under a seed
    assert kept != sorted(s for s, _ in _assignments(c))           # and random across seeds
    assert kept != list(range(10))


def test_eval_capacity_factor_and_noise_policies():
    torch.manual_seed(0)
    gate = TopKGate(8, 4, k=1, capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=0, use_rts=False)
    x = torch.randn(16, 8)
    assert gate(x)[1].shape[2] == 4                               # train: ceil(16/4*1.0)
    gate.eval()
    assert gate(x)[1].shape[2] == 8                               # eval: ceil(16/4*2.0)
    for policy in ("Jitter", "RSample"):
        g = TopKGate(8, 4, k=1, noisy_gate_policy=policy, min_capacity=0, use_rts=False)
        torch.manual_seed(5)
        r1 = g(x)[1]
        torch.manual_seed(5)
        r2 = g(x)[1]
        assert torch.equal(r1, r2), policy
        g.eval()
        clean = TopKGate(8, 4, k=1, min_capacity=0, use_rts=False)
        clean.load_state_dict(g.state_dict())
        clean.eval()
        assert torch.equal(g(x)[1], clean(x)[1]), policy          # no noise at eval
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(8, 4, noisy_gate_policy="Gaussian")
    with pytest.raises(ValueError, match="k=5"):
        TopKGate(8, 4, k=5)
    with pytest.raises(ValueError, match="multiple of ep_size"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=3, ep_size=2)


@pytest.mark.parametrize("k,residual", [(1, False), (2, True)])
def test_moe_layer_equals_hand_rolled_mixture(k, residual):
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    moe = MoE(8, expert, num_experts=4, k=k, capacity_factor=1.0, min_capacity=0, use_rts=False,
              use_residual=residual, top2_2nd_expert_sampling=False)
    with torch.no_grad():
        for e in moe.deepspeed_moe.experts.deepspeed_experts:
            for p in e.parameters():
                p.normal_()
    x = torch.randn(2, 6, 8)
    out, l_aux, counts = moe(x)
    flat = x.reshape(-1, 8)
    _, combine, _, _ = moe.deepspeed_moe.gate(flat)
    ref = torch.zeros_like(flat)
    for s in range(flat.shape[0]):
        for e, ex in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            w = combine[s, e].sum()
            if w > 0:
                ref[s] += w * ex(flat[s:s + 1])[0]
    if residual:
        coef = F.softmax(moe.coefficient(flat), dim=-1)
        ref = ref * coef[:, :1] + moe.mlp(flat) * coef[:, 1:]
    assert torch.allclose(out.reshape(-1, 8), ref, atol=1e-5)
    out.sum().backward()
    assert moe.deepspeed_moe.gate.wg.weight.grad is not None and moe.deepspeed_moe.gate.wg.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in moe.parameters())     # incl. experts that got no token


def test_param_markers_and_optimizer_groups():
    moe = MoE(8, torch.nn.Linear(8, 8), num_experts=2, use_residual=True)
    expert_params = list(moe.deepspeed_moe.experts.parameters())
    assert all(is_moe_param(p) and p.group_name == "ep_size_1" for p in expert_params)
    assert not any(is_moe_param(p) for p in moe.mlp.parameters())
    groups_ = split_params_into_different_moe_groups_for_optimizer({"params": list(moe.parameters()), "lr": 0.1})
    assert len(groups_) == 2
    assert not groups_[0].get("moe") and groups_[0]["lr"] == 0.1
    assert groups_[1]["moe"] and groups_[1]["name"] == "ep_size_1" and groups_[1]["lr"] == 0.1
    assert {id(p) for p in groups_[1]["params"]} == {id(p) for p in expert_params}
    small = split_params_into_different_moe_groups_for_optimizer({"params": expert_params}, max_group_size=72)
    assert [sum(p.numel() for p in g["params"]) for g in small] == [72, 72]   # one expert (64 + 8) per group


def test_expert_parallel_rank_layout_matches_deepspeed_example():
    # DeepSpeed's documented example: 16 ranks, tensor-parallel 2, expert-parallel 4
    ep, edp = groups._get_expert_parallel_ranks(16, 2, 4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    ep, edp = groups._get_expert_parallel_ranks(4, 1, 2)
    assert ep == [[0, 1], [2, 3]] and edp == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="ep_size 3"):
        groups._get_expert_parallel_ranks(4, 1, 3)


def test_topk_drop_policies_and_sparse_routes():
    """DeepSpeed's topkgating over capacity: drop_policy 'probs' (default) keeps each expert's most
    probable routes, 'position' its first tokens; slots follow token order. sparse_routes=True gives
    the per-route form, and _sparse_encode/_sparse_decode reproduce the dense einsums."""
    from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode
    p0 = torch.tensor([0.6, 0.9, 0.7, 0.2])                  # P(expert 0) per token; tokens 0-2 pick expert 0
    logits = torch.stack([p0, 1 - p0], dim=1).log()          # softmax(logits) == these probabilities

    def kept(dispatch):
        return sorted(tuple(i) for i in dispatch.nonzero().tolist())
    # C = ceil(4 / 2 * 1 * 0.5) = 1
    assert kept(topkgating(logits, 1, 0.5, 0)[2]) == [(1, 0, 0), (3, 1, 0)]                     # 0.9 wins
    assert kept(topkgating(logits, 1, 0.5, 0, drop_policy="position")[2]) == [(0, 0, 0), (3, 1, 0)]
    # C = 2: tokens 1 and 2 kept (0.9, 0.7), in token order
    assert kept(topkgating(logits, 1, 1.0, 0)[2]) == [(1, 0, 0), (2, 0, 1), (3, 1, 0)]
    with pytest.raises(ValueError, match="drop_policy must be 'probs' or 'position'"):
        topkgating(logits, 1, 1.0, 0, drop_policy="random")
    # the per-route form against the dense tensors of the same routing (k = 1, 2, 3)
    torch.manual_seed(3)
    lg, x = torch.randn(16, 4), torch.randn(16, 8)
    for dense, sparse in [(top1gating(lg, 1.0, 0, use_rts=False), top1gating(lg, 1.0, 0, use_rts=False,
                                                                             sparse_routes=True)),
                          (top2gating(lg, 1.0, 0, top2_2nd_expert_sampling=False),
                           top2gating(lg, 1.0, 0, top2_2nd_expert_sampling=False, sparse_routes=True)),
                          (topkgating(lg, 3, 1.0, 0), topkgating(lg, 3, 1.0, 0, sparse_routes=True))]:
        combine, dispatch = dense[1], dense[2]
        cap, num_e, idx, loc, g = int(sparse[1]), sparse[2], sparse[3], sparse[4], sparse[5]
        assert num_e == 4 and cap == combine.shape[2] and idx.shape == loc.shape == g.shape == (idx.shape[0], 16)
        rebuilt = torch.zeros_like(combine)
        for e_row, c_row, g_row in zip(idx.tolist(), loc.tolist(), g.tolist()):
            for s_, (e_, c_, w_) in enumerate(zip(e_row, c_row, g_row)):
                if e_ >= 0:
                    rebuilt[s_, e_, c_] += w_
        assert torch.allclose(rebuilt, combine)
        slots = _route_slots(idx, loc, 4, cap)
        assert torch.allclose(_sparse_encode(x, slots, 4, cap), torch.einsum("sec,sm->ecm", dispatch.float(), x))
        y = torch.randn(4, cap, 8)
        assert torch.allclose(_sparse_decode(y.view(4 * cap, 8), slots, g, 16),
                              torch.einsum("sec,ecm->sm", combine, y), atol=1e-6)
