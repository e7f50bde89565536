"""Block-wise quantization against a NumPy computation and the documented bound."""
import numpy as np
import pytest
import torch

from deepspeed.ops.quantizer import (dequantize_blockwise, ds_quantizer, pack_int4, quantize_blockwise,
                                     unpack_int4)


def _numpy_reference(x: np.ndarray, block: int, bits: int):
    qmax = 2 ** (bits - 1) - 1
    flat = x.reshape(-1).astype(np.float64)
    nb = -(-flat.size // block)
    padded = np.zeros(nb * block)
    padded[:flat.size] = flat
    blocks = padded.reshape(nb, block)
    absmax = np.abs(blocks).max(axis=1)
    scales = absmax / qmax
    codes = np.clip(np.round(blocks / np.where(scales > 0, scales, 1.0)[:, None]), -qmax, qmax)
    return codes, scales


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(1000, 64), (1024, 256), (7, 16), (300, 300)])
def test_blockwise_matches_numpy_and_bound(bits, numel, block):
    g = torch.Generator().manual_seed(numel + bits)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)   # blocks of very different ranges
    if numel > block:
        x[:block] = 0                                                     # an all-zero block too
    codes, scales = quantize_blockwise(x, block_size=block, bits=bits)
    ref_codes, ref_scales = _numpy_reference(x.numpy(), block, bits)
    assert codes.dtype == torch.int8 and codes.shape == ref_codes.shape
    np.testing.assert_allclose(scales.numpy(), ref_scales, rtol=1e-6)
    # codes agree except where x/scale sits within float error of a .5 tie
    assert (codes.numpy() != ref_codes).mean() < 1e-3
    deq = dequantize_blockwise(codes, scales, numel)
    assert deq.shape == (numel,)
    per_elem_scale = scales.repeat_interleave(block)[:numel]
    err = (x - deq).abs()
    assert bool((err <= per_elem_scale / 2 * (1 + 1e-5) + 1e-12).all())
    assert int(codes.abs().max()) <= 2 ** (bits - 1) - 1
    if numel % block:   # padding quantizes to zero
        assert int(codes.reshape(-1)[numel:].abs().max()) == 0


def test_zero_block_and_dtype_round_trip():
    x = torch.zeros(10, dtype=torch.bfloat16)
    codes, scales = quantize_blockwise(x, block_size=4)
    assert torch.equal(scales, torch.zeros(3)) and int(codes.abs().sum()) == 0
    assert torch.equal(dequantize_blockwise(codes, scales, 10), torch.zeros(10))
    y = torch.tensor([1.0, -2.0, 0.5, 4.0], dtype=torch.bfloat16)
    c, s = quantize_blockwise(y, block_size=4)
    assert float(s[0]) == pytest.approx(4.0 / 127)
    assert dequantize_blockwise(c, s, 4, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_int4_pack_round_trip():
    codes = torch.arange(-7, 8, dtype=torch.int8).repeat(2)[:30]
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 15
    assert torch.equal(unpack_int4(packed), codes)
    # low nibble first: (1, -1) -> 0x01 | 0xF0
    assert int(pack_int4(torch.tensor([1, -1], dtype=torch.int8))[0]) == 0xF1
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(3, dtype=torch.int8))


def test_ds_quantizer_symmetric_asymmetric_and_errors():
    x = torch.tensor([[-1.0, 0.25, 0.5, 1.0], [0.0, 2.0, 3.0, 4.0]])
    out = ds_quantizer(x.clone(), groups=2, bit_num=8)
    step = torch.tensor([[1 / 127], [4 / 127]])
    np.testing.assert_allclose(out.numpy(), (torch.round(x / step) * step).numpy(), rtol=1e-6)
    # asymmetric: group 2 spans [0, 4] in 255 steps; min and max are exact
    a = ds_quantizer(x.clone(), groups=2, bit_num=8, asym=True)
    assert float(a[1, 0]) == 0.0 and float(a[1, 3]) == pytest.approx(4.0)
    assert float((a - x).abs().max()) <= 4 / 255 / 2 + 1e-6
    # in place, like DeepSpeed's kernel
    t = x.clone()
    assert ds_quantizer(t, groups=1, bit_num=4) is t
    # stochastic rounding is unbiased: the mean of many roundings approaches x
    v = torch.full((20000,), 0.3)
    v[0] = 1.0
    sr = ds_quantizer(v.clone(), groups=1, bit_num=4, sr=True)
    assert abs(float(sr[1:].mean()) - 0.3) < 0.01
    with pytest.raises(ValueError, match="groups"):
        ds_quantizer(torch.zeros(10), groups=3)
    with pytest.raises(ValueError, match="bits"):
        quantize_blockwise(torch.zeros(4), bits=3)
