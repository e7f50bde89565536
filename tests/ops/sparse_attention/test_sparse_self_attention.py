"""SparseSelfAttention against dense attention with the equivalent element mask (plain
SDPA on [H, L, L] masks): outputs and gradients, every mask mode, both kernel paths."""
import random

import pytest
import torch
import torch.nn.functional as F

import deepspeed.ops.sparse_attention.block_sparse as bs
from deepspeed.ops.sparse_attention import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                                            FixedSparsityConfig, LocalSlidingWindowSparsityConfig, SparseSelfAttention,
                                            VariableSparsityConfig)
from deepspeed.ops.sparse_attention.sparse_self_attention import layout_to_element_mask

H, L, D, BLK = 4, 128, 16, 16


def configs():
    return [
        FixedSparsityConfig(H, BLK, different_layout_per_head=True, num_different_global_patterns=2),
        FixedSparsityConfig(H, BLK, attention="unidirectional"),
        VariableSparsityConfig(H, BLK, num_random_blocks=1, local_window_blocks=[1, 2], global_block_indices=[3],
                               horizontal_global_attention=True),
        BigBirdSparsityConfig(H, BLK, different_layout_per_head=True, num_random_blocks=2),
        BSLongformerSparsityConfig(H, BLK, global_block_indices=[0, 5]),
        LocalSlidingWindowSparsityConfig(H, BLK),
        DenseSparsityConfig(H, BLK),
    ]


def dense_reference(q, k, v, layout, bias):
    allowed = layout_to_element_mask(layout, BLK)  # [H, L, L]
    m = torch.where(allowed, 0.0, float("-inf")).to(q.dtype)[None] + bias.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def run_case(cfg, dtype, kp_mode="add", am_mode="mul", masks=True, batch=2):
    random.seed(11)
    att = SparseSelfAttention(cfg, key_padding_mask_mode=kp_mode, attn_mask_mode=am_mode, max_seq_length=256)
    g = torch.Generator().manual_seed(5)
    # drawn in fp32 (fp64) and rounded: torch.randn(dtype=bf16) draws other numbers than the fp32
    # draw on some torch versions (2.11), which would compare bf16 against other inputs
    draw = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (torch.randn(batch, H, L, D, generator=g, dtype=draw).to(dtype).requires_grad_() for _ in range(3))
    kp = am = None
    bias = torch.zeros(batch, 1, L, L, dtype=torch.float64)
    if masks:
        if kp_mode == "add":
            kp = torch.zeros(batch, 1, 1, L)  # BERT's extended mask shape
            kp[1, ..., -7:] = -10000.0
            bias = bias + kp.double()
        else:
            kp = torch.ones(batch, L)
            kp[1, -7:] = 0
            bias = bias + torch.where(kp == 0, float("-inf"), 0.0).double()[:, None, None, :]
        keep = torch.rand(L, L, generator=g) > 0.15
        keep.fill_diagonal_(True)  # no fully masked row
        if am_mode == "mul":
            am = keep.float()
            bias = bias + torch.where(keep, 0.0, float("-inf")).double()
        else:
            am = torch.where(keep, 0.0, -1e4)
            bias = bias + am.double()
    out = att(q, k, v, key_padding_mask=kp, attn_mask=am)
    ref = dense_reference(q, k, v, att.get_layout(L), bias)
    grad = torch.randn(out.shape, generator=g, dtype=draw).to(dtype)
    gs = torch.autograd.grad(out, (q, k, v), grad)
    gr = torch.autograd.grad(ref, (q, k, v), grad)
    return out, ref, gs, gr


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu-kernel", "op-by-op"])
def test_matches_dense_with_element_mask_fp32(fused, monkeypatch):
    monkeypatch.setattr(bs, "FUSED_CPU", fused)
    for cfg in configs():
        out, ref, gs, gr = run_case(cfg, torch.float32)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5, msg=lambda m: f"{cfg}: {m}")
        for a, b in zip(gs, gr):
            torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5, msg=lambda m: f"{cfg}: {m}")


def test_matches_dense_fp64_and_mask_modes():
    for cfg in configs()[:4]:
        for kp_mode, am_mode in (("add", "mul"), ("mul", "add")):
            out, ref, gs, gr = run_case(cfg, torch.float64, kp_mode, am_mode)
            torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
            for a, b in zip(gs, gr):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_bf16_within_stated_tolerance():
    # bf16 (8-bit mantissa): outputs and gradients within 2e-2 of the fp32 dense reference.
    cfg = BigBirdSparsityConfig(H, BLK, num_random_blocks=1)
    out, ref, gs, gr = run_case(cfg, torch.bfloat16, masks=False)
    out32, ref32, gs32, gr32 = run_case(cfg, torch.float32, masks=False)
    torch.testing.assert_close(out.float(), ref32, atol=2e-2, rtol=2e-2)
    for a, b in zip(gs, gr32):
        torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2)


def test_rpe_and_transposed_key():
    random.seed(0)
    cfg = FixedSparsityConfig(H, BLK)
    att = SparseSelfAttention(cfg, max_seq_length=L)
    q, k, v = (torch.randn(1, H, L, D, dtype=torch.float64) for _ in range(3))
    rpe = torch.randn(H, L, L, dtype=torch.float64)
    out = att(q, k.transpose(-1, -2), v, rpe=rpe)  # keys may come as [B, H, D, L]
    allowed = layout_to_element_mask(att.get_layout(L), BLK)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(allowed, 0.0, float("-inf")).double() + rpe)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    with pytest.raises(NotImplementedError, match="rpe"):
        att(q, k, v, rpe=rpe.requires_grad_())


def test_shorter_sequences_use_a_slice_of_the_master_layout():
    random.seed(1)
    cfg = BigBirdSparsityConfig(H, BLK, num_random_blocks=1)
    att = SparseSelfAttention(cfg, max_seq_length=256)
    assert torch.equal(att.get_layout(64), att.master_layout[:, :4, :4])
    q, k, v = (torch.randn(1, H, 64, D, dtype=torch.float64) for _ in range(3))
    allowed = layout_to_element_mask(att.get_layout(64), BLK)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(allowed, 0.0, float("-inf")).double())
    torch.testing.assert_close(att(q, k, v), ref, atol=1e-12, rtol=1e-12)


def test_bad_inputs_are_named():
    att = SparseSelfAttention(FixedSparsityConfig(H, BLK), max_seq_length=128)
    x = torch.randn(1, H, 100, D)
    with pytest.raises(ValueError, match="divisible by the block size"):
        att(x, x, x)
    x = torch.randn(1, H, 256, D)
    with pytest.raises(ValueError, match="max_seq_length"):
        att(x, x, x)
    x = torch.randn(1, 2, 64, D)
    with pytest.raises(ValueError, match="num_heads=4"):
        att(x, x, x)
    with pytest.raises(NotImplementedError, match="self-attention"):
        att(torch.randn(1, H, 64, D), torch.randn(1, H, 64, D), torch.randn(1, H, 64, 8))
    with pytest.raises(ValueError, match="key_padding_mask_mode"):
        SparseSelfAttention(FixedSparsityConfig(H, BLK), key_padding_mask_mode="sub")


def saved_bytes(fn):
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_memory_follows_blocks_not_sequence_squared():
    # Saved for backward: q, k, v, output and the row log-sum-exp -- O(L*D), as flash attention;
    # the dense masked math path keeps the L x L probabilities.
    random.seed(0)
    b, seq = 1, 512
    att = SparseSelfAttention(BigBirdSparsityConfig(H, BLK), max_seq_length=seq)
    q, k, v = (torch.randn(b, H, seq, D, requires_grad=True) for _ in range(3))
    sparse = saved_bytes(lambda: att(q, k, v))
    assert sparse == 4 * b * H * seq * D * 4 + b * H * seq * 4
    plan = att.get_plan(H, seq)
    assert plan.nnz_blocks < 0.3 * H * (seq // BLK) ** 2
    # work: every gathered (query rows x key blocks) tile stays within the non-zero blocks plus padding
    assert plan.padded_blocks <= 1.3 * plan.nnz_blocks
