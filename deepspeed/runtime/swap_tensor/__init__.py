"""Swapping tensors to and from NVMe files (ZeRO-Infinity's swap layer), standalone.

Parts:

* :mod:`.optimizer_utils` -- ``OptimizerSwapper``: named flat tensors per sub-group (fp32
  master partition and optimizer moments) in files, swapped in sub-group by sub-group
  through ``buffer_count`` aligned buffers, the next read and the last write overlapped
  with the caller's update (``iterate``);
* :mod:`.partitioned_optimizer_swapper` / :mod:`.pipelined_optimizer_swapper` -- the two
  DeepSpeed classes (no overlap / overlap);
* :mod:`.swapper_factory` -- ``swapper_from_config`` picks one of them from
  ``offload_optimizer.pipeline_read/pipeline_write`` as DeepSpeed does;
* :mod:`.async_swapper` -- ``AsyncTensorSwapper``: tensors packed into aligned buffers and
  written in the background, one file each (for gradients/parameters made piecemeal);
* :mod:`.swap_files` -- the run-private swap directory: unique, removed on ``close()`` and
  at interpreter exit, stale directories of crashed runs removed at start;
* :mod:`.utils` -- ``SwapBufferManager`` (page-aligned, page-locked buffers) and the
  ``swap_in_tensors``/``swap_out_tensors`` submit helpers;
* :mod:`.aio_config` / :mod:`.constants` -- the ``aio`` section as a dict, and an
  ``aio_handle`` built from it through ``AsyncIOBuilder``.

The I/O itself is :mod:`deepspeed.ops.aio` (``aio_handle``). Not yet wired into the ZeRO
strategies; see docs/zero_infinity.md for what remains.
"""
from .aio_config import aio_handle_from_config, get_aio_config
from .async_swapper import AsyncTensorSwapper
from .optimizer_utils import OptimizerSwapper, SubGroupSwapInfo
from .partitioned_optimizer_swapper import PartitionedOptimizerSwapper
from .pipelined_optimizer_swapper import PipelinedOptimizerSwapper
from .swap_files import SwapDirectory, clean_stale_swap_dirs
from .swapper_factory import swapper_from_config
from .utils import MIN_SWAPPABLE_BYTES, SwapBufferManager, get_sized_buffer, get_sized_buffers, swap_in_tensors, swap_out_tensors

__all__ = ["AsyncTensorSwapper", "OptimizerSwapper", "PartitionedOptimizerSwapper", "PipelinedOptimizerSwapper",
           "SubGroupSwapInfo",
           "swapper_from_config", "SwapDirectory", "clean_stale_swap_dirs", "SwapBufferManager",
           "get_sized_buffer", "get_sized_buffers", "swap_in_tensors", "swap_out_tensors", "get_aio_config",
           "aio_handle_from_config", "MIN_SWAPPABLE_BYTES"]
