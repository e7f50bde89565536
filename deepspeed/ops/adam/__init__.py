"""Adam optimizers under DeepSpeed's documented import path ``deepspeed.ops.adam``."""
from .cpu_adam import DeepSpeedCPUAdam
from .fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
