"""Optimizer kernels under DeepSpeed's documented paths (``deepspeed.ops.adam`` and friends).

DeepSpeed ships these as compiled C++/CUDA extensions; here they are PyTorch
fused/foreach kernels, so nothing is compiled. ``deepspeed.ops.op_builder`` answers
DeepSpeed's builder API over them; ``__compatible_ops__`` maps each op name to whether
it is usable on this machine (computed on first access).

The optimizer packages (``adam``, ``adagrad``, ``lamb``, ``lion``) and ``op_builder`` load on
first attribute access: ``import deepspeed`` reaches this package through ZeRO's quantizer
and should not pay for every optimizer with it.
"""
__all__ = ["adam", "adagrad", "lamb", "lion", "op_builder"]
_LAZY_SUBMODULES = ("adam", "adagrad", "lamb", "lion", "op_builder")


def __getattr__(name):
    import importlib
    if name == "__compatible_ops__":
        from ..git_version_info import compatible_ops
        return compatible_ops
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'deepspeed.ops' has no attribute '{name}'")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
