"""Lion under DeepSpeed's import path ``deepspeed.ops.lion``."""
from .lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
