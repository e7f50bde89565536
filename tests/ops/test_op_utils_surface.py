"""Small DeepSpeed helpers its own tests import: the utils op's cast_to_byte_tensor, OpBuilder.
installed_rocm_version(), deepspeed.sequence.layer's rotary embedding, sharded_moe.TUTEL_INSTALLED."""
import math

import pytest
import torch


def test_cast_to_byte_tensor_views_the_bytes():
    from deepspeed.ops.op_builder import UtilsBuilder
    ops = UtilsBuilder().load()
    t = torch.tensor([1.0, -2.0], dtype=torch.float32)
    b = ops.cast_to_byte_tensor(t)
    assert b.dtype == torch.uint8 and b.numel() == 8 and b.data_ptr() == t.data_ptr()
    assert bytes(b.tolist()) == t.numpy().tobytes()   # the same bytes, in place
    b[3] ^= 0x80                                      # flip the sign bit of element 0 (little endian)
    assert t[0].item() == -1.0
    outs = ops.cast_to_byte_tensor([torch.zeros(3, dtype=torch.half), torch.zeros(2, dtype=torch.int64)])
    assert [o.numel() for o in outs] == [6, 16]
    with pytest.raises(ValueError, match="contiguous"):
        ops.cast_to_byte_tensor(torch.zeros(4, 4).t())


def test_installed_rocm_version_without_rocm():
    from deepspeed.ops.op_builder.builder import OpBuilder
    want = (0, 0) if not getattr(torch.version, "hip", None) else tuple(int(x) for x in torch.version.hip.split(".")[:2])
    assert OpBuilder.installed_rocm_version() == want


def test_rotary_embedding_rotates_feature_pairs():
    from deepspeed.sequence.layer import _rotate_half, apply_rotary_pos_emb
    assert _rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-3.0, -4.0, 1.0, 2.0]
    # one position, angle a on pair (x0, x2) and b on pair (x1, x3); the 5th feature passes through
    a, b = 0.3, 1.1
    cos = torch.tensor([math.cos(a), math.cos(b), math.cos(a), math.cos(b)])
    sin = torch.tensor([math.sin(a), math.sin(b), math.sin(a), math.sin(b)])
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    out = apply_rotary_pos_emb(x, cos, sin)[0]
    want = [1 * math.cos(a) - 3 * math.sin(a), 2 * math.cos(b) - 4 * math.sin(b),
            3 * math.cos(a) + 1 * math.sin(a), 4 * math.cos(b) + 2 * math.sin(b), 5.0]
    assert torch.allclose(out, torch.tensor(want), atol=1e-6)
    with pytest.raises(ValueError, match="even"):
        apply_rotary_pos_emb(x, cos[:3], sin[:3])


def test_tutel_flag():
    from deepspeed.moe import sharded_moe
    assert sharded_moe.TUTEL_INSTALLED is False
