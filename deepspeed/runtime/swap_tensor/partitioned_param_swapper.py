"""``AsyncPartitionedParameterSwapper``: ZeRO-3 parameter partitions kept on NVMe
(``zero_optimization.offload_param.device: "nvme"``).

Each registered parameter's partition (``param.ds_tensor``, this rank's 1/N slice) lives
in its own file under a run-private :class:`~.swap_files.SwapDirectory`
(``<nvme_path>/ds_swap/<host>.<pid>.<random>/param_<n>.swp``). While it is swapped out,
``param.ds_tensor`` is a storage-less ``meta`` tensor with the partition's shape and dtype
(``ds_tensor.ds_numel`` kept; ``ds_tensor.status`` is
:class:`PartitionedParamStatus.NOT_AVAILABLE`), so code that only asks for sizes keeps
working and code that touches the data fails with a clear error instead of reading garbage.

Coming into memory:

* :meth:`make_resident` (what ``gather_params`` and ``resident_partitions`` call) makes the
  partitions real tensors until the matching :meth:`release_resident`. Holds nest.
* Reads land in a pool of ``buffer_count`` page-aligned buffers of ``buffer_size``
  elements (of the swapper's dtype), allocated on first use; several partitions are
  packed into one buffer at 4 KiB-aligned offsets, so every read and write is
  ``O_DIRECT``-eligible. A buffer is reused once every partition in it has left.
  A partition larger than ``buffer_size`` is read into a buffer of its own size,
  allocated for that swap-in and freed after it (it does not count against
  ``buffer_count``; a warning names ``buffer_size`` once). When a caller asks for more
  partitions at once than the pool holds, the excess gets ordinary host tensors for the
  duration of the hold (also warned once); the gather path splits its work so that this
  does not happen there.
* :meth:`prefetch` submits asynchronous reads into free pool space and returns at once;
  the stage-3 prefetcher calls it for the modules it predicts next, and the following
  :meth:`make_resident` waits for those reads.

Leaving memory: when the last hold is released the partition either stays in the host
cache - up to ``max_in_cpu`` elements of partitions, least recently used evicted first,
never re-read while cached - or is evicted: written back (asynchronously, from the buffer
it occupies) only when a holder released it with ``write_back=True`` since it was last
written, then its buffer space is freed. Reads and writes use two ``aio_handle`` s, so a
wait for one never waits for the other; a partition whose write is still in flight is read
again only after that write completed.

Contract for holders: inside a hold, read and write ``param.ds_tensor`` in place (e.g.
``p.ds_tensor.copy_(new_values)``) and release with ``write_back=True`` when you wrote;
never rebind ``param.ds_tensor`` to another tensor while it is swapped (the release
refuses). :meth:`close` (the stage-3 strategy's ``destroy()``) waits for all I/O and
deletes the swap files; the partitions are gone with them.
"""
from __future__ import annotations

import collections
import enum
import os
import time
import weakref
from typing import Dict, Iterable, List, Optional

import torch

from deepspeed.ops.aio.direct import ALIGNMENT, align_up, aligned_empty
from deepspeed.utils.logging import logger

from .aio_config import aio_handle_from_config, get_aio_config
from .swap_files import SwapDirectory

KEY = "zero_optimization.offload_param"


class PartitionedParamStatus(enum.Enum):
    """Where a swapped partition's data is (DeepSpeed's names, on ``param.ds_tensor.status``)."""
    AVAILABLE = 1       # in memory: ds_tensor is a real tensor
    NOT_AVAILABLE = 2   # only in its swap file: ds_tensor is a storage-less meta tensor
    INFLIGHT = 3        # a read into a buffer is in progress


_OUT, _READING, _IN, _WRITING = "out", "reading", "in", "writing"


class _Arena:
    """One pool buffer (bytes), filled by bump allocation and reset when empty."""

    __slots__ = ("data", "used", "refs")

    def __init__(self, data: torch.Tensor):
        self.data, self.used, self.refs = data, 0, 0


class _Slot:
    """Bytes a partition occupies: pool space ("arena"), a buffer of its own for a partition
    larger than buffer_size ("oversize"), host memory beyond the pool ("overflow"), or the
    partition's own tensor kept alive while it is written out ("own")."""
    __slots__ = ("arena", "bytes", "kind")

    def __init__(self, arena: Optional[_Arena], data: torch.Tensor, kind: str = "arena"):
        self.arena, self.bytes, self.kind = arena, data, kind


class _Entry:
    __slots__ = ("ref", "key", "path", "numel", "dtype", "nbytes", "state", "slot", "data", "holds", "dirty",
                 "cached", "on_disk")

    def __init__(self, param, path: str, numel: int, dtype: torch.dtype, on_death):
        # a weak reference: a parameter dropped by the model (e.g. replaced by a tied one after
        # zero.Init partitioned it) takes its entry and swap file with it
        self.key = id(param)
        self.ref = weakref.ref(param, lambda _r, k=self.key: on_death(k))
        self.path, self.numel, self.dtype = path, numel, dtype
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.state = _IN
        self.slot: Optional[_Slot] = None
        self.data: Optional[torch.Tensor] = None   # the resident tensor (ds_tensor while in memory)
        self.holds = 0
        self.dirty = False       # memory newer than the file
        self.cached = False      # resident in the max_in_cpu cache (own tensor, counted)
        self.on_disk = False     # the file holds a complete copy

    @property
    def param(self):
        return self.ref()

    def set_tensor(self, t: torch.Tensor) -> None:
        p = self.ref()
        if p is not None:
            p.ds_tensor = t

    def __deepcopy__(self, memo):
        return self


_libc = None


def _return_freed_memory() -> None:
    """Hand heap memory freed by written-out partitions back to the OS (glibc ``malloc_trim``).

    Without it glibc keeps the freed multi-megabyte chunks of partitions handed over by
    ``zero.Init`` in its heap (measured: the process grew by every partition it wrote), so
    building a model on NVMe would still cost its size in resident memory."""
    global _libc
    if _libc is None:
        try:
            import ctypes
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def _meta_placeholder(numel: int, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(numel, dtype=dtype, device="meta")
    t.ds_numel = numel
    t.status = PartitionedParamStatus.NOT_AVAILABLE
    t.final_location = "nvme"
    return t


class AsyncPartitionedParameterSwapper:
    """Parameter partitions on NVMe, swapped through ``buffer_count`` buffers of
    ``buffer_size`` elements, with up to ``max_in_cpu`` elements cached in host memory."""

    def __init__(self, nvme_path: str, dtype: torch.dtype = torch.float32, buffer_count: int = 5,
                 buffer_size: int = 100_000_000, max_in_cpu: int = 1_000_000_000, aio_config=None):
        for name, v, lo in (("buffer_count", buffer_count, 1), ("buffer_size", buffer_size, 1),
                            ("max_in_cpu", max_in_cpu, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{KEY}.{name} must be an integer >= {lo} with device 'nvme', got {v!r}")
        self.dtype = dtype
        self.buffer_count = buffer_count
        self.buffer_size = buffer_size
        self.buffer_bytes = align_up(buffer_size * torch.empty((), dtype=dtype).element_size(), ALIGNMENT)
        self.max_in_cpu = max_in_cpu
        self.aio_config = get_aio_config(aio_config)
        self.swap_dir = SwapDirectory(nvme_path, key=f"{KEY}.nvme_path")
        self.read_handle = aio_handle_from_config(self.aio_config)
        self.write_handle = aio_handle_from_config(self.aio_config)
        self._arenas: List[_Arena] = []
        self._entries: Dict[int, _Entry] = {}
        self._lru: "collections.OrderedDict[int, _Entry]" = collections.OrderedDict()   # cached, oldest first
        self._ready: "collections.OrderedDict[int, _Entry]" = collections.OrderedDict()  # prefetched, unheld
        self._reading: List[_Entry] = []
        self._writing: List[_Entry] = []
        self._writing_own = 0            # bytes of partitions' own tensors kept alive by writes in flight
        self._next_file = 0
        self.cached_numel = 0
        self.oversize_bytes = 0          # live bytes of buffers made for partitions > buffer_size
        self.overflow_bytes = 0          # live bytes of ordinary tensors handed out beyond the pool
        self._warned = set()
        self._dead: List[int] = []       # keys of entries whose parameter was garbage-collected
        self.stats = {"reads": 0, "writes": 0, "bytes_read": 0, "bytes_written": 0, "read_wait_s": 0.0,
                      "write_wait_s": 0.0, "prefetched": 0, "prefetch_dropped": 0, "cache_hits": 0, "evictions": 0,
                      "peak_arenas": 0, "peak_cached_numel": 0, "peak_pool_bytes": 0, "overflow": 0}
        self._closed = False

    @classmethod
    def from_config(cls, offload_param, aio=None, dtype: torch.dtype = torch.float32):
        """Build from the typed ``offload_param`` section (or its dict) and the ``aio`` section."""
        get = offload_param.get if isinstance(offload_param, dict) else \
            (lambda k, d=None: getattr(offload_param, k, d))
        nvme_path = get("nvme_path")
        if not nvme_path:
            raise ValueError(f"{KEY}.device is 'nvme' but {KEY}.nvme_path is not set; set it to a writable "
                             f"directory on the NVMe device")
        return cls(os.fspath(nvme_path), dtype=dtype, buffer_count=int(get("buffer_count", 5)),
                   buffer_size=int(get("buffer_size", 100_000_000)), max_in_cpu=int(get("max_in_cpu", 1_000_000_000)),
                   aio_config=aio)

    # ------------------------------------------------------------------ registration
    @property
    def swap_folder(self) -> str:
        return self.swap_dir.path

    def is_swapped(self, p) -> bool:
        self._reap()
        return id(p) in self._entries

    def _reap(self) -> None:
        """Forget entries whose parameter is gone (their files are deleted)."""
        while self._dead and not self._closed:
            e = self._entries.get(self._dead.pop())
            if e is None or e.param is not None:
                continue
            if e.state in (_READING, _WRITING):
                self.synchronize()
            self._forget(e)

    def add_params(self, params: Iterable) -> None:
        """Take over the partitions of ``params`` (each ``p.ds_tensor`` holding its data):
        they are written to their files (or kept in the cache while it has room) and
        ``p.ds_tensor`` becomes a storage-less placeholder. The caller's partition tensors
        are not referenced afterwards."""
        self._check_open()
        self._reap()
        for p in params:
            if id(p) in self._entries:
                raise ValueError(f"parameter {getattr(p, 'ds_id', '?')} is already swapped by this swapper")
            part = p.ds_tensor
            if part.device.type == "meta":
                raise ValueError(f"parameter {getattr(p, 'ds_id', '?')}: its partition has no data to swap")
            e = _Entry(p, self.swap_dir.file(f"param_{self._next_file}.swp"), part.numel(), part.dtype,
                       self._dead.append)
            self._next_file += 1
            self._entries[id(p)] = e
            e.dirty = True
            if e.numel <= self.max_in_cpu:      # start in the cache; written when evicted
                e.data = part if part.is_contiguous() and part.dim() == 1 else part.reshape(-1).clone()
                e.state, e.cached = _IN, True
                self._set_resident(e)
                self._lru[id(p)] = e
                self.cached_numel += e.numel
                self._trim_cache()
            else:
                e.data, e.state = part.reshape(-1), _IN
                self._evict(e)
            self.stats["peak_cached_numel"] = max(self.stats["peak_cached_numel"], self.cached_numel)

    def remove_params(self, params: Iterable) -> None:
        """Give ``params`` their partitions back as ordinary in-memory tensors and delete
        their swap files (e.g. parameters that become persistent)."""
        params = [p for p in params if id(p) in self._entries]
        if not params:
            return
        self.make_resident(params)
        for p in params:
            e = self._entries[id(p)]
            data = e.data.clone()
            data.ds_numel = e.numel
            e.holds = 0
            self._forget(e)
            p.ds_tensor = data

    def _forget(self, e: _Entry) -> None:
        self._free_slot(e)
        if e.cached:
            self._lru.pop(e.key, None)
            self.cached_numel -= e.numel
        self._ready.pop(e.key, None)
        self._entries.pop(e.key, None)
        e.data, e.state, e.cached = None, _OUT, False
        if e.on_disk:
            try:
                os.unlink(e.path)
            except OSError:
                pass

    # ------------------------------------------------------------------ holds
    def make_resident(self, params: Iterable, read: bool = True) -> None:
        """Make every swapped ``p.ds_tensor`` in ``params`` a real tensor holding its data,
        until :meth:`release_resident`. Params not registered here are ignored. With
        ``read=False`` the caller overwrites every element: a partition not in memory gets
        its buffer space without being read (its contents are undefined until written)."""
        self._check_open()
        self._reap()
        todo = []
        for p in params:
            e = self._entries.get(id(p))
            if e is None:
                continue
            e.holds += 1
            if e.holds == 1:
                todo.append(e)
        if not todo:
            return
        need = []
        for e in todo:
            if e.cached:
                self._lru.move_to_end(e.key)
                self.stats["cache_hits"] += 1
            self._ready.pop(e.key, None)
            if e.state == _WRITING:
                self._wait_writes()
            if e.state == _OUT:
                need.append(e)
        for e in need:
            slot = self._alloc(e, for_hold=True)
            if read:
                self._submit_read(e, slot)
            else:
                e.slot, e.data, e.state = slot, slot.bytes[:e.nbytes].view(e.dtype), _IN
                e.dirty = True
        if any(e.state == _READING for e in todo):
            self._wait_reads()
        for e in todo:
            self._set_resident(e)
        self._note_peaks()

    def release_resident(self, params: Iterable, write_back: bool = False) -> None:
        """End a hold. With ``write_back`` the partitions' (in-place modified) data is
        written to their files before they are evicted."""
        for p in params:
            e = self._entries.get(id(p))
            if e is None:
                continue
            if e.holds <= 0:
                raise RuntimeError(f"release_resident: parameter {getattr(p, 'ds_id', '?')} is not held")
            if p.ds_tensor is not e.data:
                raise RuntimeError(
                    f"parameter {getattr(p, 'ds_id', '?')}: its ds_tensor was rebound while its partition was "
                    f"resident; the partition lives in the NVMe swapper ({KEY}.device 'nvme'): write into "
                    f"p.ds_tensor in place (copy_) inside resident_partitions(..., write_back=True) instead")
            if write_back:
                e.dirty = True
            e.holds -= 1
            if e.holds == 0:
                self._settle(e)
        self.stats["peak_cached_numel"] = max(self.stats["peak_cached_numel"], self.cached_numel)

    def prefetch(self, params: Iterable) -> int:
        """Submit asynchronous reads for swapped-out ``params`` into free pool space (no
        waiting, no overflow); returns how many reads were submitted."""
        if self._closed:
            return 0
        self._reap()
        n = 0
        for p in params:
            e = self._entries.get(id(p))
            if e is None or e.state != _OUT or e.nbytes > self.buffer_bytes:
                continue
            slot = self._alloc(e, for_hold=False)
            if slot is None:
                break
            self._submit_read(e, slot)
            self._ready[id(p)] = e
            n += 1
        self.stats["prefetched"] += n
        self._note_peaks()
        return n

    def is_available(self, p) -> bool:
        """True when ``p``'s partition is in memory (or being read) right now."""
        self._reap()
        e = self._entries.get(id(p))
        return e is None or e.state in (_IN, _READING)

    # ------------------------------------------------------------------ internals
    def _set_resident(self, e: _Entry) -> None:
        t = e.data
        t.ds_numel = e.numel
        t.status = PartitionedParamStatus.AVAILABLE
        t.final_location = "nvme"
        e.state = _IN
        e.set_tensor(t)

    def _settle(self, e: _Entry) -> None:
        """Last hold released: keep it in the cache if it may stay, else evict."""
        if e.numel <= self.max_in_cpu:
            if not e.cached:
                own = e.data.clone()
                self._free_slot(e)
                e.data, e.cached = own, True
                self._set_resident(e)
                self.cached_numel += e.numel
            self._lru[e.key] = e
            self._lru.move_to_end(e.key)
            self._trim_cache(keep=e)
            if e.cached:
                return
        else:
            self._evict(e)

    def _trim_cache(self, keep: Optional[_Entry] = None) -> None:
        for key in list(self._lru):
            if self.cached_numel <= self.max_in_cpu:
                return
            e = self._lru[key]
            if e.holds > 0 or e is keep:
                continue
            self._evict(e)
        if self.cached_numel > self.max_in_cpu and keep is not None and keep.holds == 0:
            self._evict(keep)

    def _evict(self, e: _Entry) -> None:
        """Drop ``e`` from memory, writing it first when memory is newer than its file."""
        self.stats["evictions"] += 1
        if e.cached:
            self._lru.pop(e.key, None)
            self.cached_numel -= e.numel
            e.cached = False
        e.set_tensor(_meta_placeholder(e.numel, e.dtype))
        if e.dirty or not e.on_disk:
            if e.slot is None:   # an own tensor (cache, or the caller's partition): written from it
                own = e.data.reshape(-1)
                e.slot = _Slot(None, own.view(torch.uint8) if own.is_contiguous() else own.contiguous().view(torch.uint8),
                               "own")
            e.data = None
            self.write_handle.async_pwrite(e.slot.bytes[:e.nbytes], e.path)
            self.stats["writes"] += 1
            self.stats["bytes_written"] += e.nbytes
            e.state, e.dirty, e.on_disk = _WRITING, False, True
            self._writing.append(e)
            if e.slot.kind == "own":
                # Bound the memory writes keep alive (zero.Init hands over every partition it
                # makes): at most a pool's worth before waiting for them.
                self._writing_own += e.nbytes
                if self._writing_own > self.buffer_count * self.buffer_bytes:
                    self._wait_writes()
        else:
            self._free_slot(e)
            e.data, e.state = None, _OUT

    def _submit_read(self, e: _Entry, slot: _Slot) -> None:
        if not e.on_disk:
            raise RuntimeError(f"swap file '{e.path}' was never written")
        e.slot = slot
        e.data = slot.bytes[:e.nbytes].view(e.dtype)
        self.read_handle.async_pread(slot.bytes[:e.nbytes], e.path, 0)
        e.state = _READING
        self._reading.append(e)
        if e.param is not None:
            e.param.ds_tensor.status = PartitionedParamStatus.INFLIGHT
        self.stats["reads"] += 1
        self.stats["bytes_read"] += e.nbytes

    def _wait_reads(self) -> None:
        if not self._reading:
            return
        t0 = time.perf_counter()
        try:
            self.read_handle.wait()
        finally:
            self.stats["read_wait_s"] += time.perf_counter() - t0
            done, self._reading = self._reading, []
            for e in done:
                if e.state == _READING:
                    e.state = _IN
                    if e.holds == 0:     # a prefetch: ready, not yet handed out
                        self._set_resident(e)

    def _wait_writes(self) -> None:
        if not self._writing:
            return
        t0 = time.perf_counter()
        try:
            self.write_handle.wait()
        finally:
            self.stats["write_wait_s"] += time.perf_counter() - t0
            done, self._writing = self._writing, []
            own, self._writing_own = self._writing_own, 0
            for e in done:
                self._free_slot(e)
                e.state = _OUT
            if own:
                _return_freed_memory()

    def _free_slot(self, e: _Entry) -> None:
        s, e.slot = e.slot, None
        if s is None:
            return
        if s.kind == "arena":
            s.arena.refs -= 1
            if s.arena.refs == 0:
                s.arena.used = 0
        elif s.kind == "oversize":
            self.oversize_bytes -= s.bytes.numel()
        elif s.kind == "overflow":
            self.overflow_bytes -= s.bytes.numel()

    def _private_slot(self, e: _Entry, why: str) -> _Slot:
        data, _ = aligned_empty(align_up(e.nbytes, ALIGNMENT), torch.uint8, lock=False)
        kind = "oversize" if e.nbytes > self.buffer_bytes else "overflow"
        if kind == "oversize":
            self.oversize_bytes += data.numel()
            self._warn_once("oversize", f"{KEY}: a partition of {e.numel} elements is larger than "
                                        f"buffer_size ({self.buffer_size}); it gets a buffer of its own for each "
                                        f"swap (host memory grows by it). Raise {KEY}.buffer_size to at least the "
                                        f"largest partition to keep all swapping inside the pool.")
        else:
            self.overflow_bytes += data.numel()
            self.stats["overflow"] += 1
            self._warn_once("overflow", f"{KEY}: more partitions were needed in memory at once ({why}) than "
                                        f"buffer_count ({self.buffer_count}) buffers of buffer_size "
                                        f"({self.buffer_size}) hold; the excess uses ordinary host memory. "
                                        f"Raise {KEY}.buffer_count or buffer_size.")
        return _Slot(None, data, kind)

    def _take_arena_space(self, nbytes: int) -> Optional[_Slot]:
        need = align_up(nbytes, ALIGNMENT)
        for a in self._arenas:
            if a.used + need <= a.data.numel():
                s = _Slot(a, a.data.narrow(0, a.used, need))
                a.used += need
                a.refs += 1
                return s
        if len(self._arenas) < self.buffer_count:
            data = self.read_handle.new_cpu_locked_tensor(self.buffer_bytes, torch.empty(0, dtype=torch.uint8))
            a = _Arena(data)
            self._arenas.append(a)
            self.stats["peak_arenas"] = max(self.stats["peak_arenas"], len(self._arenas))
            return self._take_arena_space(nbytes)
        return None

    def _alloc(self, e: _Entry, for_hold: bool) -> Optional[_Slot]:
        """Space for ``e``'s bytes: pool space, freeing prefetched and written-out
        partitions if needed; for a hold, a private buffer when the pool is full."""
        if e.nbytes > self.buffer_bytes:
            return self._private_slot(e, "oversize") if for_hold else None
        s = self._take_arena_space(e.nbytes)
        if s is not None or not for_hold:
            return s
        if self._writing:
            self._wait_writes()
            s = self._take_arena_space(e.nbytes)
        while s is None and self._ready:
            self._drop_ready_one()
            s = self._take_arena_space(e.nbytes)
        return s if s is not None else self._private_slot(e, "hold")

    def _drop_ready_one(self) -> None:
        """Give up the prefetched, not yet used partition needed last (the newest read ahead;
        its data is on disk)."""
        _, e = self._ready.popitem(last=True)
        if e.state == _READING:
            self._wait_reads()
        if e.holds == 0 and not e.cached and e.state == _IN:
            e.set_tensor(_meta_placeholder(e.numel, e.dtype))
            self._free_slot(e)
            e.data, e.state = None, _OUT
            self.stats["prefetch_dropped"] += 1

    def _note_peaks(self) -> None:
        used = sum(a.used for a in self._arenas)
        self.stats["peak_pool_bytes"] = max(self.stats["peak_pool_bytes"], used)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the NVMe parameter swapper is closed (engine destroyed); its partitions are gone")

    # ------------------------------------------------------------------ accounting / lifecycle
    def synchronize(self) -> None:
        """Wait for every read and write in flight."""
        self._wait_reads()
        self._wait_writes()

    def flush(self) -> None:
        """Write every dirty cached partition to its file (they stay cached)."""
        for e in list(self._entries.values()):
            if e.dirty and e.state == _IN and e.holds == 0:
                self.write_handle.sync_pwrite(e.data.reshape(-1).view(torch.uint8), e.path)
                e.dirty, e.on_disk = False, True
                self.stats["writes"] += 1
                self.stats["bytes_written"] += e.nbytes

    def pool_bytes(self) -> int:
        """Bytes of pool buffers allocated (at most buffer_count x buffer_size elements)."""
        return sum(a.data.numel() for a in self._arenas)

    def resident_numel(self) -> int:
        """Elements of swapped partitions in memory now (held, cached, prefetched)."""
        return sum(e.numel for e in self._entries.values() if e.state in (_IN, _READING))

    def swapped_numel(self) -> int:
        """Elements of the partitions this swapper holds (in files or in memory)."""
        self._reap()
        return sum(e.numel for e in self._entries.values())

    def close(self) -> None:
        """Wait for I/O, free the buffers and delete the swap files (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self.synchronize()
            finally:
                for e in self._entries.values():
                    e.set_tensor(_meta_placeholder(e.numel, e.dtype))
                    e.data, e.slot = None, None
                self._entries.clear()
                self._lru.clear()
                self._ready.clear()
                for a in self._arenas:
                    self.read_handle.free_cpu_locked_tensor(a.data)
                self._arenas = []
                self.read_handle.close()
                self.write_handle.close()
        finally:
            self.swap_dir.remove()

    @property
    def closed(self) -> bool:
        return self._closed
