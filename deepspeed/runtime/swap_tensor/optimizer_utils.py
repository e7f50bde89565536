"""``OptimizerSwapper``: named flat tensors per sub-group kept in files, swapped in through a
few aligned buffers, with the next read and the last write overlapped with compute.

What it holds: for each sub-group (ZeRO's ``sub_group_size`` slice of the flat fp32
master partition) a set of named tensors -- the master partition and the optimizer's
moments (``param``, ``exp_avg``, ``exp_avg_sq`` for Adam). They live in one file per
sub-group under a run-private directory (:class:`~.swap_files.SwapDirectory`), packed at
4 KiB-aligned offsets so every transfer is ``O_DIRECT``-eligible, and come into memory
only through ``buffer_count`` page-aligned, page-locked buffers of the largest
sub-group's size.

The pipeline (ZeRO-Infinity's): :meth:`OptimizerSwapper.iterate` walks the sub-groups and
yields each one's tensors (views into its buffer) for the caller to update in place;
after the caller's update the buffer is written back. With ``pipeline_read`` the read of
sub-group ``i+1`` is submitted before ``i`` is handed to the caller, so it runs during the
update of ``i``; with ``pipeline_write`` the write-back of ``i`` is submitted and left
running during the read wait and update of ``i+1``. Reads and writes go through two
``aio_handle``s, so waiting for one never waits for the other, and at most one op is in
flight on each (``aio_handle.wait()`` waits for all of a handle's ops). Full overlap needs
3 buffers (the one being updated, the one being read, the one being written); with fewer
the swapper waits for the write before reusing its buffer. If the caller's update raises,
the sub-group is not written back, so the files keep the last completed state.

:class:`~.partitioned_optimizer_swapper.PartitionedOptimizerSwapper` (no overlap) and
:class:`~.pipelined_optimizer_swapper.PipelinedOptimizerSwapper` (both overlaps) are the
two DeepSpeed classes; ``offload_optimizer.pipeline_read/pipeline_write`` choose between
them as DeepSpeed does (:func:`.swapper_factory.swapper_from_config`).
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Dict, Hashable, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from deepspeed.ops.aio.direct import ALIGNMENT, aligned_numel

from .aio_config import aio_handle_from_config, get_aio_config
from .swap_files import SwapDirectory
from .utils import SwapBufferManager, map_file


class SubGroupSwapInfo:
    """Where one sub-group's tensors sit in its file and in a swap buffer."""

    __slots__ = ("sg_id", "path", "names", "shapes", "numels", "offsets", "total")

    def __init__(self, sg_id: Hashable, path: str, tensors: Mapping[str, torch.Tensor], element_size: int):
        self.sg_id, self.path = sg_id, path
        self.names = list(tensors)
        self.shapes = [tuple(t.shape) for t in tensors.values()]
        self.numels = [t.numel() for t in tensors.values()]
        self.offsets, off = [], 0
        for n in self.numels:
            self.offsets.append(off)
            off += aligned_numel(n, element_size, ALIGNMENT)
        self.total = max(off, aligned_numel(1, element_size, ALIGNMENT))

    def views(self, buffer: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {name: buffer.narrow(0, off, n).view(shape)
                for name, shape, n, off in zip(self.names, self.shapes, self.numels, self.offsets)}


class OptimizerSwapper:
    """Named tensors per sub-group on NVMe, swapped through ``buffer_count`` buffers."""

    def __init__(self, nvme_path: str, buffer_count: int = 4, aio_config=None, dtype: torch.dtype = torch.float32,
                 pipeline_read: bool = False, pipeline_write: bool = False, trace: bool = False):
        if isinstance(buffer_count, bool) or not isinstance(buffer_count, int) or buffer_count < 1:
            raise ValueError(f"offload_optimizer.buffer_count must be an integer >= 1, got {buffer_count!r}")
        self.aio_config = get_aio_config(aio_config)
        self.dtype = dtype
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.buffer_count = buffer_count
        self.pipeline_read = bool(pipeline_read)
        self.pipeline_write = bool(pipeline_write)
        self.swap_dir = SwapDirectory(nvme_path, key="offload_optimizer.nvme_path")
        self.read_handle = aio_handle_from_config(self.aio_config)
        self.write_handle = aio_handle_from_config(self.aio_config)
        self.infos: Dict[Hashable, SubGroupSwapInfo] = {}
        self._buffers: Optional[SwapBufferManager] = None
        self._resident: Dict[Hashable, torch.Tensor] = {}
        self._reading: Optional[Tuple[Hashable, torch.Tensor]] = None
        self._writing: List[Tuple[Hashable, torch.Tensor]] = []
        self.stats = {"read_wait_s": 0.0, "write_wait_s": 0.0, "bytes_read": 0, "bytes_written": 0}
        self.trace: Optional[List[Tuple[str, Hashable]]] = [] if trace else None
        self._closed = False

    # ------------------------------------------------------------------ registration
    def add_sub_group(self, sg_id: Hashable, tensors: Mapping[str, torch.Tensor]) -> None:
        """Register a sub-group and write its initial values to its swap file (synchronously).
        The caller may drop its own copies afterwards."""
        self._check_open()
        if sg_id in self.infos:
            raise ValueError(f"sub-group {sg_id!r} is already swapped; use write_sub_group to overwrite it")
        if not tensors:
            raise ValueError(f"sub-group {sg_id!r}: no tensors given")
        for name, t in tensors.items():
            if t.dtype != self.dtype:
                raise ValueError(f"sub-group {sg_id!r}: tensor '{name}' is {t.dtype}, this swapper holds {self.dtype}")
        info = SubGroupSwapInfo(sg_id, self.swap_dir.file(f"subgroup_{len(self.infos)}.swp"), tensors,
                                self.element_size)
        self._ensure_buffers(info.total)
        self.infos[sg_id] = info
        self.write_sub_group(sg_id, tensors)

    def write_sub_group(self, sg_id: Hashable, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite a registered sub-group's stored tensors (e.g. when loading a checkpoint)."""
        info = self._info(sg_id)
        if sg_id in self._resident:
            raise RuntimeError(f"sub-group {sg_id!r} is swapped in; swap it out before overwriting it")
        if list(tensors) != info.names:
            raise ValueError(f"sub-group {sg_id!r} holds {info.names}, got {list(tensors)}")
        for name, shape, t in zip(info.names, info.shapes, tensors.values()):
            if t.numel() != math.prod(shape) or t.dtype != self.dtype:
                raise ValueError(f"sub-group {sg_id!r}: tensor '{name}' is {tuple(t.shape)} {t.dtype}, "
                                 f"the swapped one is {shape} {self.dtype}")
        with self.overwrite_sub_group(sg_id) as views:
            for view, t in zip(views.values(), tensors.values()):
                view.copy_(t.detach().reshape(view.shape))

    @contextlib.contextmanager
    def overwrite_sub_group(self, sg_id: Hashable) -> Iterator[Dict[str, torch.Tensor]]:
        """Replace a registered sub-group's stored tensors in place: yields views of a zeroed
        swap buffer laid out as the sub-group; the caller fills them, and on a normal exit
        the buffer is written to the sub-group's file (synchronously). If the body raises,
        nothing is written. No copy outside the buffer (checkpoint loads fill it straight
        from the memory-mapped checkpoint)."""
        info = self._info(sg_id)
        if sg_id in self._resident:
            raise RuntimeError(f"sub-group {sg_id!r} is swapped in; swap it out before overwriting it")
        buf = self._acquire(info.total)
        try:
            buf.zero_()
            yield info.views(buf)
            self.write_handle.sync_pwrite(buf, info.path)
            self.stats["bytes_written"] += buf.numel() * self.element_size
        finally:
            self._buffers.free([buf])

    def map_sub_group(self, sg_id: Hashable) -> Dict[str, torch.Tensor]:
        """A sub-group's stored tensors as views of a private memory map of its swap file
        (:func:`~.utils.map_file`): no copy and no anonymous memory; pages come in from the
        file as they are read and the kernel can drop them again. For checkpoint saves of
        state larger than RAM. The views show the file as it is now: drop them before the
        sub-group is written again (the next ``iterate``/``swap_out``/``write_sub_group``).
        Writes to them never reach the file."""
        info = self._info(sg_id)
        if sg_id in self._resident or (self._reading is not None and self._reading[0] == sg_id):
            raise RuntimeError(f"sub-group {sg_id!r} is swapped in; its file may not hold its current values")
        self._wait_writes()
        return info.views(map_file(info.path, info.total, self.dtype))

    def read_sub_group(self, sg_id: Hashable) -> Dict[str, torch.Tensor]:
        """A copy of a sub-group's stored tensors (for checkpoints and inspection)."""
        info = self._info(sg_id)
        self._wait_writes()
        buf = self._acquire(info.total)
        try:
            self.read_handle.sync_pread(buf, info.path)
            return {k: v.clone() for k, v in info.views(buf).items()}
        finally:
            self._buffers.free([buf])

    def sub_group_ids(self) -> List[Hashable]:
        return list(self.infos)

    def state_dict(self) -> Dict[Hashable, Dict[str, torch.Tensor]]:
        """Every sub-group's tensors, read back into ordinary tensors (no swap paths in it),
        for a checkpoint. Costs one read of every swap file."""
        return {sg_id: self.read_sub_group(sg_id) for sg_id in self.infos}

    def load_state_dict(self, state: Mapping[Hashable, Mapping[str, torch.Tensor]]) -> None:
        """Overwrite every registered sub-group from :meth:`state_dict`'s layout."""
        missing = [k for k in self.infos if k not in state]
        extra = [k for k in state if k not in self.infos]
        if missing or extra:
            raise ValueError(f"swapper state does not match: missing sub-groups {missing[:8]}, "
                             f"unexpected {extra[:8]}")
        for sg_id in self.infos:
            self.write_sub_group(sg_id, state[sg_id])

    # ------------------------------------------------------------------ one sub-group at a time
    def swap_in(self, sg_id: Hashable) -> Dict[str, torch.Tensor]:
        """Read a sub-group into a buffer and return views of its tensors (blocking)."""
        info = self._info(sg_id)
        if sg_id in self._resident:
            raise RuntimeError(f"sub-group {sg_id!r} is already swapped in")
        if self._reading is not None and self._reading[0] == sg_id:
            return self._complete_read()
        buf = self._acquire(info.total)
        self._event("read_start", sg_id)
        t0 = time.perf_counter()
        self.read_handle.async_pread(buf, info.path)
        try:
            self.read_handle.wait()
        except BaseException:
            self._buffers.free([buf])
            raise
        self.stats["read_wait_s"] += time.perf_counter() - t0
        self.stats["bytes_read"] += buf.numel() * self.element_size
        self._event("read_done", sg_id)
        self._resident[sg_id] = buf
        return info.views(buf)

    def swap_out(self, sg_id: Hashable, async_op: bool = False) -> None:
        """Write a swapped-in sub-group back and free its buffer (after the write, if async)."""
        if sg_id not in self._resident:
            raise RuntimeError(f"sub-group {sg_id!r} is not swapped in")
        buf = self._resident.pop(sg_id)
        info = self.infos[sg_id]
        self._event("write_start", sg_id)
        self.write_handle.async_pwrite(buf, info.path)
        self._writing.append((sg_id, buf))
        if not async_op:
            self._wait_writes()

    def release(self, sg_id: Hashable) -> None:
        """Drop a swapped-in sub-group without writing it back."""
        buf = self._resident.pop(sg_id, None)
        if buf is not None:
            self._buffers.free([buf])

    def iterate(self, sg_ids: Optional[Iterable[Hashable]] = None
                ) -> Iterator[Tuple[Hashable, Dict[str, torch.Tensor]]]:
        """Yield ``(sg_id, tensors)`` for each sub-group; update ``tensors`` in place in the loop body.

        Each sub-group is written back when the body for it finishes (when the loop asks for
        the next one). Reads/writes are overlapped with the body as
        ``pipeline_read``/``pipeline_write`` say. Leaving the loop early -- ``break`` or an
        exception in the body -- drops the current sub-group's changes: its file keeps the
        state from before this pass's update (earlier sub-groups stay written back).
        """
        self._check_open()
        order = list(self.infos if sg_ids is None else sg_ids)
        for sg in order:
            self._info(sg)
        current = None
        try:
            if self.pipeline_read and order:
                self._start_read(order[0])
            for i, sg in enumerate(order):
                current = sg
                views = self.swap_in(sg)
                if self.pipeline_read and i + 1 < len(order):
                    self._start_read(order[i + 1])
                self._event("compute", sg)
                yield sg, views
                if self.pipeline_write:
                    self._wait_writes()           # the previous write; keeps one write in flight
                    self.swap_out(sg, async_op=True)
                else:
                    self.swap_out(sg)
                current = None
            self._wait_writes()
        finally:
            if current is not None:               # the body raised (or the loop was abandoned)
                self.release(current)
            self._drain()

    # ------------------------------------------------------------------ internals
    def _start_read(self, sg_id: Hashable) -> None:
        info = self.infos[sg_id]
        buf = self._acquire(info.total)
        self._event("read_start", sg_id)
        self.read_handle.async_pread(buf, info.path)
        self._reading = (sg_id, buf)

    def _complete_read(self) -> Dict[str, torch.Tensor]:
        sg_id, buf = self._reading
        self._reading = None
        t0 = time.perf_counter()
        try:
            self.read_handle.wait()
        except BaseException:
            self._buffers.free([buf])
            raise
        self.stats["read_wait_s"] += time.perf_counter() - t0
        self.stats["bytes_read"] += buf.numel() * self.element_size
        self._event("read_done", sg_id)
        self._resident[sg_id] = buf
        return self.infos[sg_id].views(buf)

    def _wait_writes(self) -> None:
        if not self._writing:
            return
        writing, self._writing = self._writing, []
        t0 = time.perf_counter()
        try:
            self.write_handle.wait()
        finally:
            self.stats["write_wait_s"] += time.perf_counter() - t0
            self._buffers.free([buf for _, buf in writing])
        self.stats["bytes_written"] += sum(buf.numel() for _, buf in writing) * self.element_size
        for sg_id, _ in writing:
            self._event("write_done", sg_id)

    def _drain(self) -> None:
        """Finish every in-flight op and return its buffer (used on exit paths)."""
        if self._reading is not None:
            _, buf = self._reading
            self._reading = None
            try:
                self.read_handle.wait()
            finally:
                self._buffers.free([buf])
        self._wait_writes()

    def _acquire(self, numel: int) -> torch.Tensor:
        got = self._buffers.allocate(numel, 1, self.dtype)
        if got is None and self._writing:
            self._wait_writes()
            got = self._buffers.allocate(numel, 1, self.dtype)
        if got is None:
            raise RuntimeError(f"all {self.buffer_count} swap buffers are in use (swapped in: "
                               f"{list(self._resident)}); raise offload_optimizer.buffer_count or swap "
                               "sub-groups out before swapping more in")
        return got[0]

    def _ensure_buffers(self, numel: int) -> None:
        if self._buffers is not None and self._buffers.num_elems >= numel:
            return
        if self._resident or self._reading or self._writing:
            raise RuntimeError("cannot grow the swap buffers while sub-groups are swapped in; "
                               "register every sub-group before swapping")
        largest = max([numel] + [i.total for i in self.infos.values()])
        if self._buffers is not None:
            self._buffers.release_all()
        self._buffers = SwapBufferManager(largest, self.buffer_count, self.dtype, self.read_handle)

    def _info(self, sg_id: Hashable) -> SubGroupSwapInfo:
        info = self.infos.get(sg_id)
        if info is None:
            raise KeyError(f"sub-group {sg_id!r} is not registered with this swapper "
                           f"(registered: {list(self.infos)[:8]})")
        return info

    def _event(self, what: str, sg_id: Hashable) -> None:
        if self.trace is not None:
            self.trace.append((what, sg_id))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this swapper is closed")

    @property
    def swap_folder(self) -> str:
        return self.swap_dir.path

    def buffer_bytes(self) -> int:
        return 0 if self._buffers is None else self._buffers.num_elems * self.element_size * self.buffer_count

    def close(self) -> None:
        """Finish in-flight I/O, unlock the buffers and delete this run's swap files."""
        if self._closed:
            return
        self._closed = True
        try:
            self._drain()
        finally:
            self._resident.clear()
            if self._buffers is not None:
                self._buffers.release_all()
            self.read_handle.close()
            self.write_handle.close()
            self.swap_dir.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
