"""LAMB under DeepSpeed's documented import path ``deepspeed.ops.lamb``."""
from .fused_lamb import FusedLamb

__all__ = ["FusedLamb"]
