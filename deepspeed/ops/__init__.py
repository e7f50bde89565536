"""Optimizer kernels under DeepSpeed's documented paths (``deepspeed.ops.adam`` and friends).

DeepSpeed ships these as compiled C++/CUDA extensions; here they are PyTorch
fused/foreach kernels, so nothing is compiled and every op is always available.
"""
from . import adagrad, adam, lamb, lion

__all__ = ["adam", "adagrad", "lamb", "lion"]
