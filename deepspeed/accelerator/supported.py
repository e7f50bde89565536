"""The accelerator names DeepSpeed knows (a leaf: ``real_accelerator`` checks the selected
accelerator against it in ``is_current_accelerator_supported``)."""
from __future__ import annotations

SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu", "xpu", "xpu.external", "npu", "mps", "hpu", "mlu", "sdaa", "supa"]
