"""Small swap helpers under DeepSpeed's names: submit lists of swaps, a pool of aligned buffers;
and :func:`map_file`, a tensor over a memory-mapped file."""
from __future__ import annotations

import errno
import mmap
import os
import platform
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from deepspeed.ops.aio.direct import ALIGNMENT

MIN_AIO_BYTES = 1024**2
AIO_ALIGNED_BYTES = ALIGNMENT
MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES


def swap_in_tensors(swap_handle, tensor_buffers: Sequence[torch.Tensor], swap_paths: Sequence[str]) -> None:
    """Submit one asynchronous read per (buffer, path); the caller waits on ``swap_handle``."""
    for buffer, path in zip(tensor_buffers, swap_paths):
        if swap_handle.async_pread(buffer, path, 0) != 0:
            raise RuntimeError(f"swap in of '{path}' could not be submitted")


def swap_out_tensors(swap_handle, tensor_buffers: Sequence[torch.Tensor], swap_paths: Sequence[str]) -> None:
    """Submit one asynchronous write per (buffer, path); the caller waits on ``swap_handle``."""
    for buffer, path in zip(tensor_buffers, swap_paths):
        if swap_handle.async_pwrite(buffer, path, 0) != 0:
            raise RuntimeError(f"swap out to '{path}' could not be submitted")


def get_sized_buffer(buffer: torch.Tensor, num_elems: int) -> torch.Tensor:
    if num_elems > buffer.numel():
        raise ValueError(f"num_elems {num_elems} > buffer {buffer.numel()}")
    return buffer.narrow(0, 0, num_elems) if num_elems < buffer.numel() else buffer


def get_sized_buffers(buffer_list: Sequence[torch.Tensor], num_elems_list: Sequence[int]) -> List[torch.Tensor]:
    return [get_sized_buffer(b, n) for b, n in zip(buffer_list, num_elems_list)]


class SwapBufferManager:
    """``count`` page-aligned, page-locked buffers of ``num_elems`` elements, handed out and
    returned by index. Buffers come zero-filled once, at construction."""

    def __init__(self, num_elems: int, count: int, dtype: torch.dtype, aio_handle):
        if count < 1:
            raise ValueError(f"buffer_count must be >= 1, got {count}")
        self.num_elems, self.count, self.dtype = num_elems, count, dtype
        self._handle = aio_handle
        example = torch.empty(0, dtype=dtype)
        self.all_buffers = [aio_handle.new_cpu_locked_tensor(num_elems, example).zero_() for _ in range(count)]
        self.free_buffer_index = list(range(count))
        self.used_buffer_index: Dict[int, int] = {}
        self.gigabytes = self.all_buffers[0].element_size() * num_elems * count / 1024**3

    def allocate(self, num_elems: int, count: int, dtype: torch.dtype) -> Optional[List[torch.Tensor]]:
        """``count`` buffers narrowed to ``num_elems``, or None when fewer are free."""
        if dtype != self.dtype:
            raise ValueError(f"swap buffers hold {self.dtype}, asked for {dtype}")
        if num_elems > self.num_elems:
            raise ValueError(f"asked for {num_elems} elements, swap buffers hold {self.num_elems}")
        if count > len(self.free_buffer_index):
            return None
        taken = self.free_buffer_index[-count:]
        del self.free_buffer_index[-count:]
        out = []
        for i in taken:
            buf = self.all_buffers[i].narrow(0, 0, num_elems)
            self.used_buffer_index[id(buf)] = i
            out.append(buf)
        return out

    def free(self, buffers: Sequence[torch.Tensor]) -> None:
        for buf in buffers:
            i = self.used_buffer_index.pop(id(buf), None)
            if i is None:
                raise ValueError("freeing a buffer that this SwapBufferManager did not hand out")
            self.free_buffer_index.append(i)

    def release_all(self) -> None:
        """Unlock every buffer (the manager is unusable afterwards)."""
        for buf in self.all_buffers:
            self._handle.free_cpu_locked_tensor(buf)
        self.all_buffers, self.free_buffer_index, self.used_buffer_index = [], [], {}


# Linux's MAP_NORESERVE where Python's mmap module lacks the name (it has it from 3.13 on some
# builds); 0 (no flag) on machines whose value differs or is unknown here
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") and
                         platform.machine() in ("x86_64", "aarch64", "arm64", "riscv64", "s390x") else 0)

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                 torch.int64: np.int64, torch.int32: np.int32, torch.uint8: np.uint8}


def map_file(path: str, numel: int, dtype: torch.dtype = torch.float32, *, create: bool = False) -> torch.Tensor:
    """A 1-D CPU tensor over the first ``numel`` elements of the file ``path``, memory-mapped.

    Its pages are file-backed (page cache), not anonymous memory: the kernel reads them in
    on first touch and can drop them again under memory pressure (written back first when
    dirty), so a tensor much larger than RAM can be read or written through.

    * ``create=False``: a private (copy-on-write) mapping of an existing file of at least
      ``numel`` elements; writes to the tensor never reach the file. The tensor shows the
      file as it is when each page is first read: do not keep it across a write to the file.
      Mapped with ``MAP_NORESERVE``: under the kernel's default (heuristic) overcommit a
      private writable mapping larger than RAM + swap is refused otherwise, although pages
      that are only read never need the reservation.
    * ``create=True``: the file is created (or resized) to ``numel`` elements, its blocks
      allocated, and mapped shared: writes to the tensor go to the file.

    The mapping lives as long as the tensor (and any view or alias of it); the file may be
    unlinked while mapped. Pages are advised sequential (read-ahead, early reclaim)."""
    if dtype not in _NUMPY_DTYPES:
        raise ValueError(f"map_file: {dtype} is not supported (use one of {sorted(map(str, _NUMPY_DTYPES))})")
    nbytes = int(numel) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
            try:   # blocks now: a full disk fails here (ENOSPC), not as SIGBUS on a later write
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
        elif os.fstat(fd).st_size < nbytes:
            raise OSError(f"map_file: '{path}' holds {os.fstat(fd).st_size} bytes, {nbytes} were asked for")
        if create:
            mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_WRITE)
        else:
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
        mm.madvise(mmap.MADV_SEQUENTIAL)
    # the array holds the mmap object (buffer export); the tensor holds the array
    return torch.from_numpy(np.frombuffer(mm, dtype=_NUMPY_DTYPES[dtype]))
