"""``deepspeed.ops.op_builder``: DeepSpeed's op builders over PyTorch-native ops.

Parts: ``builder.py`` (``OpBuilder``: ``NAME``, ``is_compatible``, ``load`` importing the
Python module that implements the op), ``builders.py`` (one table row per DeepSpeed
builder: the module implementing it here, or why it is not built), ``all_ops.py``
(``ALL_OPS``), ``flatten_op.py`` (the ``utils`` op).
"""
from .builder import CUDAOpBuilder, OpBuilder, OpNotAvailableError, PythonExtension, TorchCPUOpBuilder  # noqa: F401
from .builders import *  # noqa: F401,F403
from .builders import BUILDERS
from .all_ops import ALL_OPS  # noqa: F401


# DeepSpeed keeps each builder in its own file (``deepspeed.ops.op_builder.cpu_adam`` ...);
# those import paths are registered here as small modules holding the one class.
_FILE_OF = {"cpu_adam": "CPUAdamBuilder", "fused_adam": "FusedAdamBuilder", "cpu_adagrad": "CPUAdagradBuilder",
            "cpu_lion": "CPULionBuilder", "fused_lamb": "FusedLambBuilder", "fused_lion": "FusedLionBuilder",
            "async_io": "AsyncIOBuilder", "gds": "GDSBuilder", "transformer": "TransformerBuilder",
            "stochastic_transformer": "StochasticTransformerBuilder", "sparse_attn": "SparseAttnBuilder",
            "transformer_inference": "InferenceBuilder", "spatial_inference": "SpatialInferenceBuilder",
            "quantizer": "QuantizerBuilder", "fp_quantizer": "FPQuantizerBuilder", "random_ltd": "RandomLTDBuilder",
            "evoformer_attn": "EvoformerAttnBuilder", "pin_memory": "PinMemoryBuilder"}


def _register_file_paths() -> None:
    import sys
    import types
    for fname, cls_name in _FILE_OF.items():
        full = f"{__name__}.{fname}"
        if full not in sys.modules:
            mod = types.ModuleType(full, f"DeepSpeed's import path for {cls_name} (defined in builders.py).")
            setattr(mod, cls_name, BUILDERS[cls_name])
            sys.modules[full] = mod
            globals()[fname] = mod


_register_file_paths()


def get_default_compute_capabilities() -> str:
    """Compute capabilities to build for: nothing is compiled here, so this only reports
    the GPU present (DeepSpeed's default list when there is none)."""
    import torch
    if torch.cuda.is_available():
        caps = sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return ";".join(caps)
    return "6.0;6.1;7.0"


def get_op_builder(class_name: str):
    """The builder class named ``class_name`` (what ``accelerator.get_op_builder`` returns)."""
    return BUILDERS.get(class_name)


__all__ = ["OpBuilder", "CUDAOpBuilder", "TorchCPUOpBuilder", "ALL_OPS", "get_default_compute_capabilities",
           *BUILDERS]
