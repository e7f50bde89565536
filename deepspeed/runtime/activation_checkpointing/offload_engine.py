"""Keep checkpoint inputs in host memory between forward and backward.

With activation checkpointing, what a layer keeps for backward is its input (the
hidden states at the checkpoint boundary); it stays on the accelerator from the
layer's forward until its backward. :class:`HostOffloadEngine` copies such a
tensor into a host buffer, lets the accelerator copy go, and copies it back when
backward asks for it. The values come back bit for bit, so gradients equal the
run without offload.

Parts (this file):

* :class:`HostBufferPool`: dense host buffers, pinned through
  ``get_accelerator().pin_memory`` when asked, reused across steps and keyed by
  (shape, dtype, layout, pinned). A buffer an in-flight copy still reads goes back
  to the pool only once that copy's event has completed.
* :class:`HostOffloadEngine`: hands out an id per offloaded tensor and brings it
  back by id. The newest ``keep_last_count`` tensors are not moved at all (the
  first backward needs them at once). Where the accelerator has streams the copies
  run on a side stream, so they overlap compute; the last ``max_fwd_stash_count``
  offloaded device tensors are held until a later offload (a backward that comes
  first uses the device copy and skips the copy back). Without streams (or with
  ``use_streams=False``) the copies are ordered on the compute stream. A restored
  tensor is held only weakly afterwards (its host copy is kept until the block exits,
  for a retained graph's second backward), so backward brings the inputs back one
  checkpoint at a time instead of accumulating them on the device.

Nothing is moved on a synchronized device (the CPU: the tensor already lives in
host memory), nor tensors below ``min_offload_bytes``, parameters, buffers,
non-strided tensors, or overlapping views (a stride of 0: rebuilding one would
need the aliased storage). Such a tensor stays where it is and is counted in
``stats.skipped_marked_tensors``.

The consumer is :class:`~.offload_activations.CheckpointHiddenStatesOffload`
(saved-tensor hooks that offload only the marked checkpoint inputs).
"""
from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import torch

from deepspeed.accelerator import get_accelerator

_OWNER = "CheckpointHiddenStatesOffload"

BufferKey = Tuple[Tuple[int, ...], torch.dtype, torch.layout, bool]


@dataclass
class CheckpointActivationOffloadStats:
    """Counters since the manager was last entered (or ``reset``)."""
    saved_tensors_seen: int = 0      # tensors autograd saved while the hooks were active
    marked_tensors: int = 0          # ``mark`` calls
    offloaded_tensors: int = 0       # copies started to host
    restored_tensors: int = 0        # offloaded tensors handed back to backward
    skipped_marked_tensors: int = 0  # marked tensors left in place (see the module docstring)
    kept_last_tensors: int = 0       # marked tensors kept on the device as the newest keep_last_count
    offloaded_bytes: int = 0
    restored_bytes: int = 0


class OffloadedTensor(NamedTuple):
    """Where an offloaded tensor's values are, and how to rebuild it on its device."""
    host: torch.Tensor
    device: torch.device
    size: torch.Size
    stride: Tuple[int, ...]
    key: BufferKey


def _nbytes(t: torch.Tensor) -> int:
    return t.element_size() * t.numel()


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{_OWNER}: {name} must be True or False, got {value!r}")


def _check_count(name: str, value, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{_OWNER}: {name} must be an int >= 0 ({meaning}), got {value!r}")


class HostBufferPool:
    """Reusable dense host buffers; at most ``capacity`` are kept idle."""

    def __init__(self, capacity: int, pinned: bool):
        self.capacity, self.pinned = capacity, pinned
        self._free: Dict[BufferKey, List[torch.Tensor]] = {}
        self._waiting: List[Tuple[BufferKey, torch.Tensor, object]] = []  # (key, buffer, event of its last copy)
        self.count = 0

    def key(self, like: torch.Tensor) -> BufferKey:
        # Buffers are dense, so tensors differing only in strides share one.
        return tuple(like.size()), like.dtype, like.layout, self.pinned

    def take(self, like: torch.Tensor) -> Tuple[torch.Tensor, BufferKey]:
        self.collect()
        key = self.key(like)
        free = self._free.get(key)
        if free:
            self.count -= 1
            return free.pop(), key
        host = torch.empty(tuple(like.size()), dtype=like.dtype, layout=like.layout, device="cpu")
        if self.pinned:
            host = get_accelerator().pin_memory(host)
        return host, key

    def give(self, key: BufferKey, host: torch.Tensor) -> None:
        if self.count < self.capacity:
            self._free.setdefault(key, []).append(host)
            self.count += 1

    def give_after(self, key: BufferKey, host: torch.Tensor, event) -> None:
        self._waiting.append((key, host, event))

    def collect(self, wait: bool = False) -> None:
        """Return waiting buffers whose copy has finished (all of them, after waiting, if ``wait``)."""
        waiting, self._waiting = self._waiting, []
        for key, host, event in waiting:
            if wait:
                event.synchronize()
            if wait or event.query():
                self.give(key, host)
            else:
                self._waiting.append((key, host, event))


class HostOffloadEngine:
    """Offload tensors to host by id and bring them back (see the module docstring)."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1):
        _check_flag("use_pin_memory", use_pin_memory)
        _check_flag("use_streams", use_streams)
        _check_count("min_offload_bytes", min_offload_bytes, "smaller tensors stay on the device")
        _check_count("max_fwd_stash_count", max_fwd_stash_count,
                     "offloaded device tensors held until their copy is no longer the newest")
        _check_count("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count, "idle host buffers kept for reuse")
        _check_count("keep_last_count", keep_last_count, "newest marked tensors left on the device")
        self.use_pin_memory = use_pin_memory
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        self.stats = CheckpointActivationOffloadStats()
        self._pool = HostBufferPool(max_cpu_buffer_pool_count, use_pin_memory)
        self._next_id = 0
        self._keep_last: "OrderedDict[int, torch.Tensor]" = OrderedDict()  # newest marked, not moved
        self._tracker: Dict[int, OffloadedTensor] = {}                      # moved to host
        self._fwd_stash: "OrderedDict[int, Tuple[torch.Tensor, object]]" = OrderedDict()
        # Restored by the unpack hook, kept until the block exits for a retained graph's second backward:
        # the device tensor (weakly, or as is for a never-moved one) and the host copy it came from.
        self._restored: Dict[int, Union[torch.Tensor, "weakref.ref"]] = {}
        self._restored_host: Dict[int, OffloadedTensor] = {}
        accel = get_accelerator()
        self.s1 = accel.Stream() if use_streams and not accel.is_synchronized_device() else None
        self.use_streams = self.s1 is not None

    # -- DeepSpeed's internal names, read by its tests ------------------------------------------------
    @property
    def _cpu_buffer_pool_count(self) -> int:
        return self._pool.count

    def _buffer_key(self, tensor: torch.Tensor) -> BufferKey:
        return self._pool.key(tensor)

    def _empty_cpu_like(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, BufferKey]:
        return self._pool.take(tensor)

    # -- streams --------------------------------------------------------------------------------
    @property
    def compute_stream(self):
        return get_accelerator().current_stream()

    def _copy_stream(self):
        return self.s1 if self.use_streams else self.compute_stream

    @staticmethod
    def _on(stream):
        return contextlib.nullcontext() if stream is None else get_accelerator().stream(stream)

    # -- offload ----------------------------------------------------------------------------------
    def should_skip(self, tensor: torch.Tensor) -> bool:
        accel = get_accelerator()
        return (accel.is_synchronized_device() or not accel.on_accelerator(tensor)
                or tensor.layout != torch.strided or _nbytes(tensor) < self.min_offload_bytes
                or isinstance(tensor, (torch.nn.Parameter, torch.nn.Buffer))
                or (tensor.numel() > 1 and 0 in tensor.stride()))

    def offload_input(self, tensor: torch.Tensor) -> Optional[int]:
        """Take ``tensor`` into the engine; its id, or None when it is left where it is.

        The newest ``keep_last_count`` stay on the device; the one pushed out of that
        window starts its copy to host now.
        """
        if self.should_skip(tensor):
            self.stats.skipped_marked_tensors += 1
            return None
        self._next_id += 1
        newest = self._next_id
        self._keep_last[newest] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest, device_tensor = self._keep_last.popitem(last=False)
            self._start_offload(oldest, device_tensor, newest)
        return newest

    def _start_offload(self, tensor_id: int, tensor: torch.Tensor, newest: int) -> None:
        if self.use_streams:
            # Drop device tensors that left the stash window; record_stream keeps their memory
            # from being reused before the side stream's copy has read it.
            while self._fwd_stash and next(iter(self._fwd_stash)) <= newest - self.max_fwd_stash_count:
                self._fwd_stash.popitem(last=False)
            self.s1.wait_stream(self.compute_stream)  # the tensor's producer has run
        host, key = self._pool.take(tensor)
        with self._on(self._copy_stream()):
            host.copy_(tensor.detach(), non_blocking=self.use_streams)
        self._tracker[tensor_id] = OffloadedTensor(host, tensor.device, tensor.size(), tensor.stride(), key)
        if self.use_streams:
            tensor.record_stream(self.s1)
            if self.max_fwd_stash_count > 0:
                self._fwd_stash[tensor_id] = (tensor, self.s1.record_event())
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += _nbytes(host)

    # -- restore --------------------------------------------------------------------------------
    def restore_input(self, tensor_id: int) -> torch.Tensor:
        """The tensor behind ``tensor_id``, on its device, for one use (the id is then forgotten and
        its host buffer goes back to the pool)."""
        return self._restore_tensor(tensor_id, cache=False)

    def _restore_tensor(self, tensor_id: int, cache: bool = True) -> torch.Tensor:
        """The tensor behind ``tensor_id`` on its device.

        With ``cache`` (the saved-tensor hook's unpack) the id stays valid until the block exits, so a
        graph kept with ``retain_graph=True`` can run backward again; but the restored device tensor is
        held only weakly (a strong cache would put every checkpoint input back on the device by the end
        of backward): the host copy is kept instead, and copied back again if a second backward asks
        after the first one's tensor was freed. Tensors never moved (the newest ``keep_last_count``)
        are held as they are.
        """
        if cache and tensor_id in self._restored:
            held = self._restored[tensor_id]
            tensor = held() if isinstance(held, weakref.ref) else held
            if tensor is None:  # freed after the first backward: copy back again from the kept host copy
                tensor = self._copy_back(self._restored_host[tensor_id], release=False)
                self._restored[tensor_id] = weakref.ref(tensor)
            return tensor
        if tensor_id in self._keep_last:
            tensor = self._keep_last.pop(tensor_id)
            self.stats.kept_last_tensors += 1
            if cache:
                self._restored[tensor_id] = tensor
            return tensor
        record = self._tracker.pop(tensor_id, None)
        if record is None:
            raise RuntimeError(
                f"{_OWNER}: offloaded activation {tensor_id} is no longer held. Run backward() inside the same "
                f"`with` block as its forward (leaving the block, or reset(), releases what was offloaded).")
        stashed = self._fwd_stash.pop(tensor_id, None)
        if stashed is not None:
            # Its device tensor is still alive: no copy back. Later copies into the host buffer run on
            # the same side stream, after the one that filled it.
            tensor = stashed[0]
            if not cache:
                self._pool.give(record.key, record.host)
        else:
            tensor = self._copy_back(record, release=not cache)
        if cache:
            self._restored_host[tensor_id] = record
            self._restored[tensor_id] = weakref.ref(tensor)
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += _nbytes(tensor)
        return tensor

    def _copy_back(self, record: OffloadedTensor, release: bool) -> torch.Tensor:
        """A new device tensor with ``record``'s values (its host buffer back to the pool if ``release``)."""
        with self._on(self._copy_stream()):
            # Fresh storage at offset 0 with the original strides (views and strided tensors come back alike).
            tensor = torch.empty_strided(record.size, record.stride, dtype=record.host.dtype, device=record.device)
            tensor.copy_(record.host, non_blocking=self.use_streams)
        if self.use_streams:
            done = self.s1.record_event()
            compute = self.compute_stream
            compute.wait_event(done)
            tensor.record_stream(compute)
            if release:
                self._pool.give_after(record.key, record.host, done)
        elif release:
            self._pool.give(record.key, record.host)
        return tensor

    # -- lifetime -------------------------------------------------------------------------------
    def _sync_and_clear(self) -> None:
        """Wait for in-flight copies, return every host buffer to the pool, forget all ids."""
        if self.use_streams:
            self.s1.synchronize()
        self._pool.collect(wait=self.use_streams)
        for record in (*self._tracker.values(), *self._restored_host.values()):
            self._pool.give(record.key, record.host)
        self._tracker.clear()
        self._restored_host.clear()
        self._fwd_stash.clear()
        self._keep_last.clear()
        self._restored.clear()

    def reset(self) -> None:
        """Forget everything held (after waiting for in-flight copies) and zero the counters; the
        pooled host buffers stay for reuse."""
        self._sync_and_clear()
        self.stats = CheckpointActivationOffloadStats()
        self._next_id = 0
