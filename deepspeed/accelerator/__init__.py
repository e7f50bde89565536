"""``deepspeed.accelerator.get_accelerator()``: the one place that knows the device."""
from .abstract import DeepSpeedAccelerator  # noqa: F401
from .real_accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator  # noqa: F401
from .supported import SUPPORTED_ACCELERATOR_LIST  # noqa: F401
