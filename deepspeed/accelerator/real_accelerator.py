"""Pick the accelerator once: DS_ACCELERATOR=cpu|cuda overrides, else CUDA when present."""
from __future__ import annotations

import os

from .supported import SUPPORTED_ACCELERATOR_LIST

_ACCELERATOR = None


def get_accelerator():
    global _ACCELERATOR
    if _ACCELERATOR is None:
        name = os.environ.get("DS_ACCELERATOR", "").lower()
        if name not in ("", "cpu", "cuda"):
            raise ValueError(f"DS_ACCELERATOR={name!r} is not supported; use 'cpu' or 'cuda'.")
        if not name:
            import torch
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cuda":
            from .cuda_accelerator import CUDA_Accelerator
            _ACCELERATOR = CUDA_Accelerator()
        else:
            from .cpu_accelerator import CPU_Accelerator
            _ACCELERATOR = CPU_Accelerator()
    return _ACCELERATOR


def set_accelerator(accel) -> None:
    global _ACCELERATOR
    _ACCELERATOR = accel



def is_current_accelerator_supported() -> bool:
    """True when ``get_accelerator()``'s device type is one DeepSpeed supports."""
    return get_accelerator().device_name().split(":")[0] in SUPPORTED_ACCELERATOR_LIST
