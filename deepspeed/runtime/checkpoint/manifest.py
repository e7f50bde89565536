"""Checkpoint manifests: what every file of a tag held when it was written, checked on load.

Why: a flipped bit in an optimizer file used to load without a word and training resumed
from corrupted moments. Each tag directory now carries ``checkpoint_manifest.json``,
written by rank 0 inside the atomic save (before the tag is moved into place), listing
for every file of the tag:

* ``rank`` / ``world_size``: which rank wrote it, out of how many (so a missing per-rank
  file is named with the rank and world size that should have produced it);
* ``bytes`` and ``crc32``: the file's size and the CRC-32 of each ``chunk_bytes`` slice of
  it, computed while the bytes stream to disk (no second read);
* ``records``: for torch files, the CRC-32 torch itself stored for every record of its zip
  container - one per tensor storage - read back from the file's central directory (no
  extra pass). When a file does not match, these name the tensor(s) whose bytes changed.

Loading checks a torch file while reading it: each record (the pickle, every tensor
storage) is CRC-32'd from the bytes torch has just read and compared with ``records``
(:class:`RecordHasher`): one CPU pass over bytes already in memory, overlapped with the
reading, no second read of the file; a rank checks only the files it reads. A mismatch
raises :class:`CheckpointError` naming the file, the record and the tensor(s) in it.
Files without records, and memory-mapped loads, are checked against the chunk CRC-32s by
a pass over the file before loading (:func:`verify_file`; each unchanged file once per
process).
Checkpoints without a manifest (older ones, DeepSpeed's own) load unverified.

Switch verification off with the environment variable ``DS_CHECKPOINT_VERIFY=0`` or
:func:`set_checkpoint_verification(False) <set_checkpoint_verification>` (also a context
manager): loading then skips the checksums (the missing-file check stays).
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional

from .errors import CheckpointError

try:   # the same CRC-32 as zlib.crc32 (identical values), SIMD-accelerated by ISA-L: ~7x faster here
    from isal.isal_zlib import crc32
    CRC_IMPL = "isal"
except ImportError:  # pragma: no cover - optional: `pip install isal`
    from zlib import crc32
    CRC_IMPL = "zlib"

MANIFEST = "checkpoint_manifest.json"
FORMAT = "deepspeed-checkpoint-manifest"
VERSION = 1
CHECKSUM = "crc32"
CHUNK_BYTES = 64 << 20
SIDECAR_PREFIX = ".manifest-rank"
ENV_VERIFY = "DS_CHECKPOINT_VERIFY"

_state = threading.local()
_default_verify = os.environ.get(ENV_VERIFY, "1").strip().lower() not in ("0", "false", "no", "off")
_lock = threading.Lock()
_manifest_cache: Dict[str, tuple] = {}
_verified: Dict[str, tuple] = {}


# ---------------------------------------------------------------- the switch
def verification_enabled() -> bool:
    return getattr(_state, "verify", None) if getattr(_state, "verify", None) is not None else _default_verify


class set_checkpoint_verification(contextlib.ContextDecorator):
    """``set_checkpoint_verification(False)`` turns checksum verification of loaded
    checkpoint files off for the whole process; ``with set_checkpoint_verification(False):``
    only inside the block (on this thread)."""

    def __init__(self, enabled: bool):
        global _default_verify
        self.enabled = bool(enabled)
        self._prev_default = _default_verify
        _default_verify = self.enabled

    def __enter__(self):
        global _default_verify
        _default_verify = self._prev_default   # only the block changes: restore the process default
        self._prev = getattr(_state, "verify", None)
        _state.verify = self.enabled
        return self

    def __exit__(self, *exc):
        _state.verify = self._prev
        return False


# ---------------------------------------------------------------- writing
class ChecksumFile:
    """A writable file wrapper that computes chunked CRC-32s of everything written and
    keeps the first ``OSError`` (torch's serializer turns it into a bare RuntimeError)."""

    def __init__(self, f, chunk: int = CHUNK_BYTES):
        self.f = f
        self.chunk = chunk
        self.crcs: List[int] = []
        self._crc = 0
        self._fill = 0
        self.nbytes = 0
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        try:
            self.f.write(mv)
        except OSError as err:
            if self.error is None:
                self.error = err
            raise
        pos = 0
        while pos < n:
            take = min(n - pos, self.chunk - self._fill)
            self._crc = crc32(mv[pos:pos + take], self._crc)
            self._fill += take
            pos += take
            if self._fill == self.chunk:
                self.crcs.append(self._crc)
                self._crc, self._fill = 0, 0
        self.nbytes += n
        return n

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as err:
            self.error = self.error or err
            raise

    def finish(self) -> List[int]:
        if self._fill or not self.crcs:
            self.crcs.append(self._crc)
            self._crc, self._fill = 0, 0
        return self.crcs


def zip_record_crcs(path: str) -> Dict[str, int]:
    """The CRC-32 torch stored for each record of its zip container (one per storage);
    {} for a file that is not one."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as zf:
            return {_short(i.filename): i.CRC for i in zf.infolist()}
    except (zipfile.BadZipFile, OSError, ValueError):
        return {}


def _short(record: str) -> str:
    return record.split("/", 1)[1] if "/" in record else record   # drop torch's archive name


def entry(nbytes: int, crcs: List[int], records: Dict[str, int], rank, world_size) -> dict:
    return {"rank": rank, "world_size": world_size, "bytes": int(nbytes), "chunk_bytes": CHUNK_BYTES,
            "crc32": [int(c) for c in crcs], "records": records}


def entry_for_path(path: str, rank=None, world_size=None) -> dict:
    """A manifest entry computed by reading a file already on disk (files written by other
    means than the checkpoint writer, e.g. a user's checkpoint engine)."""
    return entry(os.path.getsize(path), file_crcs(path), zip_record_crcs(path), rank, world_size)


def sidecar_name(rank: int) -> str:
    return f"{SIDECAR_PREFIX}{rank}.json"


def build_manifest(directory: str, tag: str, world_size: int, own: dict) -> dict:
    """Rank 0 at commit: every rank's sidecar merged, plus any file written into the tag
    by other means (checksummed here)."""
    files = {}
    for n in sorted(os.listdir(directory)):
        if n.startswith(SIDECAR_PREFIX) and n.endswith(".json"):
            with open(os.path.join(directory, n), encoding="utf-8") as f:
                files.update(json.load(f))
    files.update(own)
    for n in sorted(os.listdir(directory)):
        p = os.path.join(directory, n)
        if n in files or n == MANIFEST or n.startswith(SIDECAR_PREFIX) or n.endswith(".part") \
                or not os.path.isfile(p):
            continue
        files[n] = entry_for_path(p)
    files = {n: e for n, e in files.items() if os.path.isfile(os.path.join(directory, n))}
    return {"format": FORMAT, "version": VERSION, "tag": tag, "world_size": world_size, "checksum": CHECKSUM,
            "files": files}


def remove_sidecars(directory: str) -> None:
    for n in os.listdir(directory):
        if n.startswith(SIDECAR_PREFIX):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, n))


# ---------------------------------------------------------------- reading
def read_manifest(directory: str) -> Optional[dict]:
    """The manifest of a tag directory (cached while the file is unchanged); None if absent."""
    path = os.path.join(directory, MANIFEST)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _lock:
        hit = _manifest_cache.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
    try:
        with open(path, encoding="utf-8") as f:
            man = json.load(f)
        if not isinstance(man, dict) or man.get("format") != FORMAT or not isinstance(man.get("files"), dict):
            raise ValueError(f"not a {FORMAT} file")
    except (OSError, ValueError) as err:
        raise CheckpointError(f"Checkpoint manifest '{path}' is unreadable ({err}); the checkpoint cannot be "
                              f"verified. Restore the file, or load without verification ({ENV_VERIFY}=0 or "
                              f"deepspeed.runtime.checkpoint.set_checkpoint_verification(False)).") from None
    with _lock:
        _manifest_cache[path] = (key, man)
    return man


def _who(man: dict, name: str) -> str:
    e = man["files"][name]
    rank, world = e.get("rank"), e.get("world_size") or man.get("world_size")
    who = f"written by rank {rank}" if rank is not None else "written"
    return f"{who} of the {world} ranks that saved tag '{man.get('tag')}'"


def check_complete(directory: str, names: Optional[Iterable[str]] = None) -> None:
    """Raise if a file the manifest lists (every ``.pt`` file, or those in ``names``) is
    missing, naming the file, the rank that wrote it and the world size."""
    man = read_manifest(directory)
    if man is None:
        return
    # all the tag's data files (a removed zero_to_fp32.py script does not make it incomplete)
    wanted = [n for n in man["files"] if n.endswith(".pt")] if names is None else \
        [n for n in names if n in man["files"]]
    missing = [n for n in wanted if not os.path.isfile(os.path.join(directory, n))]
    if missing:
        lines = "; ".join(f"'{n}' ({_who(man, n)})" for n in missing)
        raise CheckpointError(f"Checkpoint '{directory}' is incomplete: {len(missing)} file(s) listed in its "
                              f"manifest are missing: {lines}. Restore them from a copy, or load another tag.")


def missing_note(directory: str, name: str) -> str:
    """' (written by rank R of the W ranks ...)' when the manifest lists ``name``."""
    try:
        man = read_manifest(directory)
    except CheckpointError:
        return ""
    return f" ({_who(man, name)})" if man is not None and name in man["files"] else ""


# ---------------------------------------------------------------- verifying while loading
_deferred = threading.local()


@contextlib.contextmanager
def deferred_failures(share=None):
    """Inside the block, a tensor whose bytes do not match the manifest does not raise on
    the spot: :func:`~.io.load_file` returns what it read and the failure (a message naming
    the file, record and tensor) is appended to the yielded list. For a caller that then
    agrees on the outcome with the other ranks (one collective), so that every rank raises,
    including those that never read the damaged file, and no rank leaves a collective its
    peers are in. A damaged pickle (the structure itself) still raises at once.

    ``share=(i, n)``: this process is member ``i`` of ``n`` that all read the same files
    here; a file (or the tensors of a file) every member reads is checked by one member
    only (:func:`current_share`), the agreement covering the others."""
    prev = (getattr(_deferred, "failures", None), getattr(_deferred, "share", None),
            getattr(_deferred, "futures", None))
    _deferred.failures, _deferred.share = [], (share if share is not None and share[1] > 1 else None)
    _deferred.futures = []
    failures, futures = _deferred.failures, _deferred.futures
    try:
        yield failures
    finally:
        _deferred.failures, _deferred.share, _deferred.futures = prev
        cancel_prefetch()
        for fut in futures:   # checks of files loaded before their check ended (see settle)
            try:
                fut.result()
            except CheckpointError as err:
                failures.append(str(err))


def deferring() -> bool:
    return getattr(_deferred, "failures", None) is not None


def current_share():
    """``(i, n)`` inside :func:`deferred_failures` with a share, else None."""
    return getattr(_deferred, "share", None) if deferring() else None


def defer_or_raise(err: CheckpointError) -> None:
    """Inside :func:`deferred_failures`, note ``err`` for the agreement; else raise it."""
    failures = getattr(_deferred, "failures", None)
    if failures is None:
        raise err
    failures.append(str(err))


def entry_of(path: str) -> Optional[dict]:
    """``path``'s manifest entry (None: no manifest, or the file is not listed)."""
    directory, name = os.path.split(os.path.abspath(path))
    man = read_manifest(directory)
    return None if man is None else man["files"].get(name)


READ_SLICE = 4 << 20   # bytes read, then hashed while still in the CPU cache


class RecordHasher:
    """Stands in for torch's zip reader (``torch._C.PyTorchFileReader``) inside
    ``torch.serialization._load``: every record torch asks for is read here, ``READ_SLICE``
    bytes at a time, each slice CRC-32'd right after it is read (still in the CPU cache),
    and compared with the CRC-32 the manifest holds for that record (torch's own, from the
    zip directory at save time). Verification is thus one pass over the bytes as they are
    read, no second read of the file. The pickle and the small metadata records are
    checked before torch uses them; storages when torch has them all (a mismatch names
    the tensors stored in the record). ``share=(i, n)``: hash only every n-th storage
    starting at the i-th (a file every rank of a group reads: each rank checks its share;
    the caller agrees on the result)."""

    def __init__(self, zf, f, path: str, entry: dict, share=None):
        self._zf, self._f, self.path, self.entry = zf, f, path, entry
        self.saved = entry.get("records") or {}
        self.share = share
        self._n = 0
        self._got: Dict[str, int] = {}
        self.storage_record: Dict[int, str] = {}

    def __getattr__(self, name):
        return getattr(self._zf, name)

    def get_record(self, name):
        data = self._zf.get_record(name)
        if name in self.saved and crc32(data) != self.saved[name]:
            what = "the pickled structure" if name.endswith(".pkl") else "the archive's metadata"
            raise CheckpointError(
                f"Checkpoint file '{self.path}' is corrupted: record '{name}' ({what}) does not match its CRC-32 "
                f"in the manifest ({self._who()}). No tensor's data is involved: the damage is in the pickled "
                f"structure or the zip directory. Restore the file from a copy or load another tag.")
        return data

    def get_storage_from_record(self, name, nbytes, dtype):
        import torch
        i, self._n = self._n, self._n + 1
        check = self.share is None or i % self.share[1] == self.share[0]
        st = torch.UntypedStorage(nbytes)
        t = torch.empty(0, dtype=torch.uint8).set_(st)
        if nbytes:
            buf = memoryview(t.numpy())
            f, crc, pos = self._f, 0, 0
            f.seek(self._zf.get_record_offset(name))
            while pos < nbytes:
                n = f.readinto(buf[pos:pos + min(READ_SLICE, nbytes - pos)])
                if not n:
                    raise CheckpointError(f"Checkpoint file '{self.path}' is corrupted: record '{name}' ends "
                                          f"early ({pos} of {nbytes} bytes).")
                if check:
                    crc = crc32(buf[pos:pos + n], crc)
                pos += n
        else:
            crc = 0
        if check:
            self._got[name] = crc
            self.storage_record[st.data_ptr()] = name
        return t

    def _who(self) -> str:
        d, n = os.path.split(os.path.abspath(self.path))
        man = read_manifest(d)
        return _who(man, n) if man is not None and n in man["files"] else "unknown writer"

    def mismatches(self, obj) -> Optional[str]:
        """None if every storage hashed matched, else the message naming the file, the
        record(s) and the tensor(s) stored in them."""
        bad = [name for name, crc in self._got.items() if crc != self.saved.get(name)]
        if not bad:
            return None
        names: Dict[str, List[str]] = {}
        for key, t in _walk(obj, ""):
            rec = self.storage_record.get(t.untyped_storage().data_ptr())
            if rec in bad:
                names.setdefault(rec, []).append(f"'{key or '<root>'}'")
        parts = [f"{rec} -> {', '.join(names.get(rec, [])) or '?'}" for rec in sorted(bad)]
        return (f"Checkpoint file '{self.path}' is corrupted: its tensor data does not match the CRC-32s in the "
                f"manifest ({self._who()}). Tensor data changed in record(s) {'; '.join(parts)}. Restore the file "
                f"from a copy or load another tag (to load it anyway, switch verification off: {ENV_VERIFY}=0).")


def _threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _crc_ranges(path: str, size: int, chunk: int, mapped=None) -> List[int]:
    """CRC-32 of each ``chunk`` of the file, over ``mapped`` (a map of the whole file that
    the caller also loads from, see :func:`prefetch`) or over a map made here."""
    if size == 0:
        return [0]
    with contextlib.ExitStack() as stack:
        if mapped is None:
            f = stack.enter_context(open(path, "rb"))
            mapped = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        mv = stack.enter_context(memoryview(mapped))
        starts = list(range(0, size, chunk))

        def one(a):
            view = mv[a:min(a + chunk, size)]
            try:
                return crc32(view)
            finally:
                view.release()
        if len(starts) == 1:
            return [one(0)]
        with ThreadPoolExecutor(min(_threads(), len(starts))) as pool:
            return list(pool.map(one, starts))


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if os.uname().sysname == "Linux" else 0)


def map_private(path: str):
    """A private (copy-on-write), unreserved map of the whole file: what ``torch.load(mmap=True)``
    slices its tensors from, made here so that the checksum pass and the load share it (each
    page is faulted in once, by whichever touches it first). None for an empty file."""
    size = os.path.getsize(path)
    if size == 0:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def file_crcs(path: str, chunk: int = CHUNK_BYTES) -> List[int]:
    return _crc_ranges(path, os.path.getsize(path), chunk)


def verify_file(path: str, loader=None) -> None:
    """Check ``path`` against its tag's manifest (no-op without one, or when verification
    is off, or when this unchanged file was verified before in this process). ``loader``
    (path -> object, weights-only, unverified) lets a mismatch name the changed tensors."""
    if not verification_enabled():
        return
    with _lock:
        pending = _pending.pop(os.path.abspath(path), None)
    if pending is not None and pending[0] == _file_key(path):
        pending[1].result()   # verified in the background (raises its CheckpointError here)
        if _file_key(path) == pending[0]:   # and the file did not change meanwhile
            return
    _verify_now(path, loader)


_prefetch_pool: Optional[ThreadPoolExecutor] = None
_pending: Dict[str, tuple] = {}


def prefetch(paths: Iterable[str], loader=None) -> None:
    """Start verifying these files (ones a caller is about to load memory-mapped) on a
    background thread, one at a time in the given order, so the checksums overlap with
    loading other files and with copying out of these. Each file is mapped here once and the
    checksum pass reads that map: a memory-mapped load takes it (:func:`take_prefetched`)
    instead of mapping the file again, so every page is faulted in once. :func:`verify_file`
    waits for a file's result instead of starting over. :func:`cancel_prefetch` drops those
    nobody asked for."""
    global _prefetch_pool
    if not verification_enabled():
        return
    with _lock:
        if _prefetch_pool is None:
            _prefetch_pool = ThreadPoolExecutor(1, thread_name_prefix="ds_ckpt_verify")
            register = getattr(threading, "_register_atexit", None)   # runs before the pool's own join
            if register is not None:
                register(cancel_prefetch)
        for p in paths:
            path = os.path.abspath(p)
            if path not in _pending and os.path.isfile(path):
                key = _file_key(path)
                try:
                    mapped = map_private(path)
                except (OSError, ValueError):
                    mapped = None
                _pending[path] = (key, _prefetch_pool.submit(_verify_now, path, loader, mapped), mapped)


def take_prefetched(path: str):
    """``(map, future)`` of a file :func:`prefetch` is checking, for a memory-mapped load that
    slices its tensors from the same map and then hands the future to :func:`settle`; None if
    the file was not prefetched, was changed since, or is empty."""
    path = os.path.abspath(path)
    with _lock:
        pending = _pending.get(path)
        if pending is None or pending[2] is None or pending[0] != _file_key(path):
            return None
        del _pending[path]
    return pending[2], pending[1]


def settle(future) -> None:
    """The outcome of a background check whose file was loaded before the check ended: inside
    :func:`deferred_failures` it is collected when the block ends (so the check overlaps with
    what the caller does with the loaded tensors, all of it before the agreement); else it
    is waited for here and a mismatch raises."""
    futures = getattr(_deferred, "futures", None)
    if futures is not None and deferring():
        futures.append(future)
        return
    future.result()


def cancel_prefetch() -> None:
    """Drop background verifications nobody waited for (files that were not loaded)."""
    with _lock:
        for _, fut, _ in _pending.values():
            fut.cancel()
        _pending.clear()


def _file_key(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _verify_now(path: str, loader=None, mapped=None) -> None:
    directory, name = os.path.split(os.path.abspath(path))
    man = read_manifest(directory)
    if man is None or name not in man["files"]:
        return
    st = os.stat(path)
    key = (st.st_ino, st.st_size, st.st_mtime_ns, os.path.getmtime(os.path.join(directory, MANIFEST)))
    with _lock:
        if _verified.get(path) == key:
            return
    e = man["files"][name]
    if st.st_size != e["bytes"]:
        raise CheckpointError(f"Checkpoint file '{path}' is corrupted: it holds {st.st_size} bytes but "
                              f"{e['bytes']} were written ({_who(man, name)}). Restore it from a copy or load "
                              f"another tag.")
    chunk = int(e.get("chunk_bytes", CHUNK_BYTES))
    got = _crc_ranges(path, st.st_size, chunk, mapped)
    bad = [i for i, (a, b) in enumerate(zip(got, e["crc32"])) if a != b]
    if bad or len(got) != len(e["crc32"]):
        ranges = ", ".join(f"[{i * chunk}, {min((i + 1) * chunk, st.st_size)})" for i in bad[:4])
        raise CheckpointError(
            f"Checkpoint file '{path}' is corrupted: its CRC-32 does not match the manifest ({_who(man, name)}); "
            f"changed byte range(s) {ranges}. {_diagnose(path, e, loader)} Restore the file from a copy or load another "
            f"tag (to load it anyway, switch verification off: {ENV_VERIFY}=0).")
    with _lock:
        _verified[path] = key


def _record_ranges(path: str):
    """(record, data offset, size) of each record of a stored (uncompressed) zip."""
    import zipfile
    out = []
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for i in zf.infolist():
            f.seek(i.header_offset)
            head = f.read(30)
            if len(head) != 30 or head[:4] != b"PK\x03\x04":
                continue
            n, x = struct.unpack("<HH", head[26:30])
            out.append((_short(i.filename), i.header_offset + 30 + n + x, i.compress_size))
    return out


def _diagnose(path: str, e: dict, loader) -> str:
    """Name the tensors whose bytes changed (records whose CRC differs from the one saved)."""
    saved = e.get("records") or {}
    if not saved:
        return ""
    try:
        ranges = _record_ranges(path)
    except Exception:  # noqa: BLE001 - the zip directory itself is damaged
        return "The file's zip directory is damaged."
    bad = {}
    with open(path, "rb") as f:
        for rec, off, size in ranges:
            if rec in saved:
                f.seek(off)
                crc = crc32(f.read(size))
                if crc != saved[rec]:
                    bad[rec] = (crc, size)
    if not bad:
        return "No tensor's data changed: the damage is in the pickled structure or the zip directory."
    names = _tensor_names(path, bad, loader) if loader is not None else {}
    parts = [f"{rec} -> {', '.join(names.get(rec, [])) or '?'}" for rec in sorted(bad)]
    return f"Tensor data changed in record(s) {'; '.join(parts)}."


def _tensor_names(path: str, bad: dict, loader) -> Dict[str, List[str]]:
    """record -> key paths of the loaded tensors whose storage bytes match that record's
    (corrupted) bytes."""
    import torch
    try:
        obj = loader(path)
    except Exception:  # noqa: BLE001 - unloadable: the records are all we can name
        return {}
    want = {crc: rec for rec, (crc, _) in bad.items()}
    sizes = {size for _, size in bad.values()}
    out: Dict[str, List[str]] = {}
    seen = {}
    for key, t in _walk(obj, ""):
        st = t.untyped_storage()
        if st.nbytes() not in sizes:
            continue
        ptr = st.data_ptr()
        if ptr not in seen:
            seen[ptr] = crc32(memoryview(torch.empty(0, dtype=torch.uint8).set_(st).numpy()))
        rec = want.get(seen[ptr])
        if rec is not None:
            out.setdefault(rec, []).append(f"'{key or '<root>'}'")
    return out


def _walk(obj, prefix):
    import torch
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{prefix}[{i}]")
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from _walk(vars(obj), prefix)
