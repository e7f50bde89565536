"""The ``pin_memory`` op (what ``PinMemoryBuilder().load()`` returns): page-locked host buffers.

DeepSpeed compiles a small C++ extension for this (``posix_memalign`` + ``mlock``). Here each
allocation is one page-aligned anonymous mapping from the async-I/O layer's ``LockedBuffer``
(``deepspeed/ops/aio/direct.py``), page-locked with ``cudaHostRegister`` when CUDA is present
(so device copies from it are asynchronous) and ``mlock`` otherwise; the tensor wraps it
without a copy. A process-wide registry maps each allocation's address to its buffer, so an
address is freed once: freeing unlocks the pages (they no longer count against
``ulimit -l``). Unlike the C++ op, the mapping itself lives as long as any tensor still uses
it, so a tensor used after its free reads valid (pageable) memory rather than freed memory.

``pin_handle`` has the extension's methods: ``new_cpu_locked_tensor(num_elem, example_tensor)``,
``free_cpu_locked_tensor(tensor)``, ``free_cpu_locked_tensor_by_ptr(address)`` and
``is_pinned(tensor)``. A buffer that cannot be locked is an error naming ``ulimit -l``.
"""
from __future__ import annotations

import threading

import torch

from deepspeed.ops.aio.direct import LockedBuffer


class _LockedAllocations:
    """Process-wide registry of live page-locked allocations: address -> LockedBuffer."""

    def __init__(self):
        self._buffers: dict = {}
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> LockedBuffer:
        buf = LockedBuffer(nbytes, lock=True)
        if buf.how == "none":
            raise RuntimeError(f"pin_memory: could not page-lock {buf.nbytes} bytes: the page-locked memory limit "
                               f"is `ulimit -l` (RLIMIT_MEMLOCK). Raise it, or leave DS_PIN_MEMORY_BACKEND unset "
                               f"to pin through torch")
        with self._lock:
            self._buffers[buf.addr] = buf
        return buf

    def free(self, address: int) -> bool:
        with self._lock:
            buf = self._buffers.pop(int(address), None)
        if buf is None:
            return False
        buf.release()
        return True

    def owns(self, address: int) -> bool:
        with self._lock:
            return any(b.addr <= address < b.addr + b.nbytes for b in self._buffers.values())


_ALLOCATIONS = _LockedAllocations()


class pin_handle:  # noqa: N801 - the extension's class name
    """Allocate and free page-locked CPU tensors (one registry shared by every handle)."""

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A 1-D CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype in fresh page-locked
        memory (contents undefined), starting at its allocation's address. Free it with a ``free_*``."""
        num_elem = int(num_elem)
        if num_elem < 0:
            raise ValueError(f"new_cpu_locked_tensor: num_elem must be >= 0, got {num_elem}")
        dtype = example_tensor.dtype
        room = max(num_elem, 1)          # an empty tensor still gets (and frees) its own address
        buf = _ALLOCATIONS.alloc(room * torch.empty((), dtype=dtype).element_size())
        root = torch.frombuffer(buf.mapping, dtype=dtype, count=room)
        return root if num_elem == room else root[:num_elem]

    def free_cpu_locked_tensor(self, locked_tensor: torch.Tensor) -> bool:
        return _ALLOCATIONS.free(locked_tensor.data_ptr())

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        """Release the allocation that starts at ``address``; False when none does (already freed)."""
        return _ALLOCATIONS.free(address)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        return _ALLOCATIONS.owns(buffer.data_ptr())
