"""``swapper_from_config``: the optimizer swapper DeepSpeed would build from the config
(a file of its own, above :mod:`.optimizer_utils` and the two swapper classes it chooses between)."""
from __future__ import annotations

from typing import Mapping

import torch

from .optimizer_utils import OptimizerSwapper
from .partitioned_optimizer_swapper import PartitionedOptimizerSwapper
from .pipelined_optimizer_swapper import PipelinedOptimizerSwapper


def swapper_from_config(offload_optimizer, aio=None, dtype: torch.dtype = torch.float32, **kwargs) -> OptimizerSwapper:
    """Build the swapper DeepSpeed would from ``zero_optimization.offload_optimizer`` (a dict
    or the typed section) and the ``aio`` section: pipelined when ``pipeline_read`` or
    ``pipeline_write`` is set, partitioned (no overlap) otherwise."""
    get = (offload_optimizer.get if isinstance(offload_optimizer, Mapping)
           else lambda k, d=None: getattr(offload_optimizer, k, d))
    device = get("device", "nvme")
    if str(device) != "nvme":
        raise ValueError(f"offload_optimizer.device is {device!r}; an NVMe swapper needs 'nvme'")
    nvme_path = get("nvme_path")
    if not nvme_path:
        raise ValueError("offload_optimizer.nvme_path is required when offload_optimizer.device is 'nvme'")
    read, write = bool(get("pipeline_read", False)), bool(get("pipeline_write", False))
    common = dict(nvme_path=nvme_path, buffer_count=get("buffer_count", 4), aio_config=aio, dtype=dtype, **kwargs)
    if read or write:
        return PipelinedOptimizerSwapper(pipeline_read=read, pipeline_write=write, **common)
    return PartitionedOptimizerSwapper(**common)
