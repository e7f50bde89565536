"""Native host-memory pinning (``DS_PIN_MEMORY_BACKEND=native``), as DeepSpeed 0.19.

By default an accelerator pins through torch (``Tensor.pin_memory()``, which needs a device
runtime; the CPU accelerator pins nothing). With ``DS_PIN_MEMORY_BACKEND=native`` every
``get_accelerator().pin_memory()`` / ``is_pinned()`` / ``unpin_memory()`` goes through ONE
process-wide :class:`NativePinnedMemory`, which copies the tensor into page-locked memory from
the ``pin_memory`` op (``PinMemoryBuilder().load().pin_handle()``: ``posix_memalign`` + ``mlock``)
and works with or without a device.

* ``pin(tensor, make_copy=True, match_shape=True)``: a pinned tensor of the same dtype and
  element count (a copy of ``tensor`` unless ``make_copy=False``; flat unless ``match_shape``),
  tagged ``ds_pinned = True`` and ``ds_pin_base`` (its allocation's address).
* ``is_pinned(t)``: True for any tensor whose data lies inside a live allocation (so views and
  slices count, though they do not carry the tag); False for meta and fake tensors.
* ``unpin(t)``: frees the allocation ``t`` was pinned into (by the recorded address, so it works
  after ``t.data`` was rebound) and returns True; False when it was already freed. Using ``t``
  afterwards reads freed memory, as with DeepSpeed.
* An allocation nobody unpins is freed when its last tensor (the pinned tensor and every view
  of it) is garbage collected.

Selecting ``native`` when the op cannot be loaded raises ``RuntimeError`` at once (no silent
fallback to torch).
"""
from __future__ import annotations

import os
import weakref

BACKEND_ENV = "DS_PIN_MEMORY_BACKEND"
BACKENDS = ("torch", "native")


def _storageless(tensor) -> bool:
    """Meta and fake tensors have no host data whose address could be looked up."""
    if getattr(getattr(tensor, "device", None), "type", None) == "meta":
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:          # a torch without fake tensors: nothing is fake
        return False
    return bool(is_fake(tensor))


class NativePinnedMemory:
    """Pins host tensors into page-locked allocations and tracks their address ranges."""

    def __init__(self):
        self._ranges: dict[int, int] = {}        # allocation address -> end address
        self._finalizers: dict[int, weakref.finalize] = {}
        try:
            from deepspeed.ops.op_builder import PinMemoryBuilder
            self._handle = PinMemoryBuilder().load().pin_handle()
        except Exception as err:
            raise RuntimeError(f"{BACKEND_ENV}=native needs the pin_memory op (PinMemoryBuilder), which could not "
                               f"be loaded: {err}. Unset {BACKEND_ENV} to pin through torch") from err

    def pin(self, tensor, make_copy: bool = True, match_shape: bool = True):
        numel = tensor.numel()
        root = self._handle.new_cpu_locked_tensor(numel, tensor)
        begin = root.data_ptr()
        out = root[:numel]
        if make_copy:
            out.copy_(tensor.detach().reshape(-1))
        if match_shape:
            out = out.view(tensor.shape)
        self._ranges[begin] = begin + max(numel, 1) * tensor.element_size()
        out.ds_pinned = True
        out.ds_pin_base = begin
        # Freed with `root`: every view (out, out's slices) holds root through ._base. The callback
        # must not reference root itself, or root would never be collected.
        self._finalizers[begin] = weakref.finalize(root, _release, self._handle, begin, self._ranges,
                                                   self._finalizers)
        return out

    def is_pinned(self, tensor) -> bool:
        if getattr(tensor, "ds_pinned", False):
            return True
        if _storageless(tensor):
            return False
        ptr = tensor.data_ptr()
        return any(begin <= ptr < end for begin, end in self._ranges.items())

    def unpin(self, tensor) -> bool:
        begin = getattr(tensor, "ds_pin_base", None)
        if begin is None:
            begin = tensor.data_ptr()
        fin = self._finalizers.pop(begin, None)
        if fin is not None:
            fin.detach()                      # freed here, not again at garbage collection
        self._ranges.pop(begin, None)
        freed = bool(self._handle.free_cpu_locked_tensor_by_ptr(begin))
        if getattr(tensor, "ds_pinned", False):
            tensor.ds_pinned = False
        return freed


def _release(handle, begin, ranges, finalizers) -> None:
    ranges.pop(begin, None)
    finalizers.pop(begin, None)
    try:
        handle.free_cpu_locked_tensor_by_ptr(begin)
    except Exception:   # interpreter shutdown: the op module may already be gone, the OS reclaims it
        pass


_shared_native_pins = None


def get_native_pinned_memory() -> NativePinnedMemory:
    """The process-wide manager (created on first use)."""
    global _shared_native_pins
    if _shared_native_pins is None:
        _shared_native_pins = NativePinnedMemory()
    return _shared_native_pins


def pin_memory_backend() -> str:
    """``DS_PIN_MEMORY_BACKEND`` (read at every call): 'torch' (default) or 'native'."""
    value = os.environ.get(BACKEND_ENV, "torch").strip().lower() or "torch"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not a pin-memory backend; valid: 'torch' (default), 'native'")
    return value


def native_pinning() -> bool:
    """Whether ``DS_PIN_MEMORY_BACKEND=native`` is selected: host memory is then page-locked with
    or without a device, so ZeRO pins its host buffers on a CPU-only run too."""
    return pin_memory_backend() == "native"


def get_active_native_pinned_memory():
    """The shared manager when ``DS_PIN_MEMORY_BACKEND=native``, else None (pin through torch)."""
    if pin_memory_backend() != "native":
        return None
    return get_native_pinned_memory()
