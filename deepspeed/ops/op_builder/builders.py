"""Every op builder DeepSpeed ships, one table row each: DeepSpeed's class and op name,
the module implementing the op here (``None``: not built, with the reason)."""
from __future__ import annotations

from .builder import OpBuilder

# class name, NAME, module here, feature words, DeepSpeed's absolute_name, why absent
_TABLE = [
    ("CPUAdamBuilder", "cpu_adam", "deepspeed.ops.op_builder.cpu_adam_op", "DeepSpeedCPUAdam",
     "deepspeed.ops.adam.cpu_adam_op", ""),
    ("FusedAdamBuilder", "fused_adam", "deepspeed.ops.adam.fused_adam", "FusedAdam",
     "deepspeed.ops.adam.fused_adam_op", ""),
    ("CPUAdagradBuilder", "cpu_adagrad", "deepspeed.ops.adagrad.cpu_adagrad", "DeepSpeedCPUAdagrad",
     "deepspeed.ops.adagrad.cpu_adagrad_op", ""),
    ("CPULionBuilder", "cpu_lion", "deepspeed.ops.lion.lion", "DeepSpeedCPULion",
     "deepspeed.ops.lion.cpu_lion_op", ""),
    ("FusedLionBuilder", "fused_lion", "deepspeed.ops.lion.lion", "FusedLion",
     "deepspeed.ops.lion.fused_lion_op", ""),
    ("FusedLambBuilder", "fused_lamb", "deepspeed.ops.lamb.fused_lamb", "FusedLamb",
     "deepspeed.ops.lamb.fused_lamb_op", ""),
    ("UtilsBuilder", "utils", "deepspeed.ops.op_builder.flatten_op", "tensor flatten/unflatten utilities",
     "deepspeed.ops.utils_op", ""),
    ("PinMemoryBuilder", "pin_memory", "deepspeed.ops.op_builder.pin_memory_op",
     "page-locked host memory (posix_memalign + mlock; DS_PIN_MEMORY_BACKEND=native)",
     "deepspeed.ops.pin_memory.pin_memory_op", ""),
    ("AsyncIOBuilder", "async_io", "deepspeed.ops.aio", "asynchronous tensor-file I/O (deepspeed.ops.aio)",
     "deepspeed.ops.aio.async_io_op", ""),
    ("GDSBuilder", "gds", None, "GPUDirect Storage",
     "deepspeed.ops.gds.gds_op", "GPUDirect Storage needs NVIDIA's cuFile library and a GDS-capable "
     "filesystem; this version has no GDS path (use AsyncIOBuilder's aio_handle)"),
    ("TransformerBuilder", "transformer", "deepspeed.ops.transformer",
     "the transformer layer kernel (deepspeed.ops.transformer)", "deepspeed.ops.transformer.transformer_op", ""),
    ("StochasticTransformerBuilder", "stochastic_transformer", "deepspeed.ops.transformer",
     "the stochastic transformer layer (deepspeed.ops.transformer)",
     "deepspeed.ops.transformer.stochastic_transformer_op", ""),
    ("SparseAttnBuilder", "sparse_attn", "deepspeed.ops.sparse_attention",
     "block-sparse attention (deepspeed.ops.sparse_attention)", "deepspeed.ops.sparse_attention.sparse_attn_op", ""),
    ("InferenceBuilder", "transformer_inference", None, "DeepSpeed-Inference kernels",
     "deepspeed.ops.transformer.inference.transformer_inference_op",
     "DeepSpeed-Inference (kernel injection) is not part of this training-focused version"),
    ("SpatialInferenceBuilder", "spatial_inference", None, "spatial (diffusers) inference kernels",
     "deepspeed.ops.spatial.spatial_inference_op", "DeepSpeed-Inference is not part of this version"),
    ("QuantizerBuilder", "quantizer", None, "the quantizer kernels",
     "deepspeed.ops.quantizer.quantizer_op", "quantization kernels (ZeRO++ qwZ/qgZ) are not built in this version"),
    ("FPQuantizerBuilder", "fp_quantizer", None, "the FP8/FP6 quantizer",
     "deepspeed.ops.fp_quantizer.fp_quantizer_op", "FP quantization kernels are not built in this version"),
    ("RandomLTDBuilder", "random_ltd", "deepspeed.ops.random_ltd.dropping_utils",
     "random layer-token drop (token_sort_, token_gather, token_scatter_ in PyTorch ops)",
     "deepspeed.ops.random_ltd.random_ltd_op", ""),
    ("EvoformerAttnBuilder", "evoformer_attn", None, "DS4Science Evoformer attention",
     "deepspeed.ops.evoformer_attn_op", "the Evoformer attention (CUTLASS) kernel is not built in this version"),
    ("InferenceCoreBuilder", "inference_core_ops", None, "DeepSpeed-FastGen core ops",
     "deepspeed.inference.v2.kernels.inference_core_ops",
     "DeepSpeed-FastGen (inference v2) is not part of this version"),
    ("InferenceCutlassBuilder", "cutlass_ops", None, "DeepSpeed-FastGen CUTLASS ops",
     "deepspeed.inference.v2.kernels.cutlass_ops", "DeepSpeed-FastGen (inference v2) is not part of this version"),
    ("RaggedOpsBuilder", "ragged_device_ops", None, "DeepSpeed-FastGen ragged ops",
     "deepspeed.inference.v2.kernels.ragged_ops", "DeepSpeed-FastGen (inference v2) is not part of this version"),
    ("RaggedUtilsBuilder", "ragged_ops", None, "DeepSpeed-FastGen ragged utilities",
     "deepspeed.inference.v2.ragged_ops", "DeepSpeed-FastGen (inference v2) is not part of this version"),
    ("CCLCommBuilder", "deepspeed_ccl_comm", None, "the oneCCL communication backend",
     "deepspeed.ops.comm.deepspeed_ccl_comm_op", "communication goes through torch.distributed (gloo/NCCL); "
     "there is no oneCCL binding"),
    ("ShareMemCommBuilder", "deepspeed_shm_comm", None, "the shared-memory CPU communication backend",
     "deepspeed.ops.comm.deepspeed_shm_comm_op", "communication goes through torch.distributed (gloo on CPU)"),
]


def _make(cls_name, op_name, module, feature, absolute, why):
    doc = (f"``{op_name}``: {feature}." + (f" Implemented by ``{module}``." if module else f" Not built: {why}."))
    return type(cls_name, (OpBuilder,), {"NAME": op_name, "MODULE": module, "FEATURE": feature,
                                         "ABSOLUTE_NAME": absolute, "ABSENT_WHY": why,
                                         "BUILD_VAR": f"DS_BUILD_{op_name.upper()}",
                                         "__doc__": doc, "__module__": __name__})


BUILDERS = {row[0]: _make(*row) for row in _TABLE}
globals().update(BUILDERS)
__all__ = list(BUILDERS)
