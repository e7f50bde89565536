"""DeepSpeed's import path for ``SUPA_Accelerator`` (defined in ``device_accelerators.py``)."""
from .device_accelerators import SUPA_Accelerator  # noqa: F401
