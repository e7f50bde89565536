"""Adagrad under DeepSpeed's import path ``deepspeed.ops.adagrad``."""
from .cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
