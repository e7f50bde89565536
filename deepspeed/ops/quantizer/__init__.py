"""``deepspeed.ops.quantizer``: block-wise int8/int4 quantization on PyTorch ops.

DeepSpeed exposes ``ds_quantizer`` here (a fake quantizer over CUDA kernels); ZeRO++
(qwZ weight all-gather, qgZ gradient reduce) uses the same block quantization. Ours is
vectorised PyTorch (CPU and GPU alike); see :mod:`.quantizer` for the formula and the
error bound."""
from .quantizer import (DEFAULT_BLOCK_SIZE, dequantize_blockwise, ds_quantizer, pack_int4, quantization_error_bound,
                        quantize_blockwise, unpack_int4)

__all__ = ["ds_quantizer", "quantize_blockwise", "dequantize_blockwise", "pack_int4", "unpack_int4",
           "quantization_error_bound", "DEFAULT_BLOCK_SIZE"]
