"""Checkpoint file I/O: atomic writes, one weights-only (and verified) read path.

Saving. Every file of a tag goes into ``<save_dir>/.tmp-<tag>`` (``foo.pt.part`` first,
then ``os.replace``), each rank noting what it wrote (size, CRC-32s) in a small sidecar.
Once every rank has written, rank 0 writes the tag's manifest (:mod:`.manifest`), moves the
directory to ``<save_dir>/<tag>`` and then replaces ``latest``: **the ``latest`` update is the
commit point**. If it fails, the new tag is removed again (and a tag it replaced put back),
so after any failure ``save_dir`` holds either the complete new tag named by ``latest``
or exactly the previous state, with no ``.part`` file left. A save killed midway leaves a
``.tmp-*`` directory; the next save sweeps it away, whatever its tag.

Errors from the file system (no space left, read-only file system, quota, file too
large) are raised as :class:`CheckpointWriteError`: the path, the errno text, and what
was kept.

Loading. :func:`load_file` is the only way the package reads a checkpoint file: the
file is checked against its tag's manifest (:func:`.manifest.verify_file`), then
``torch.load(weights_only=True)`` runs with the one allow-list of
:mod:`.allowlist`, so a checkpoint file cannot run code.
"""
from __future__ import annotations

import contextlib
import errno as _errno
import os
import shutil
import stat
import threading

import torch

from . import manifest as _manifest
from .allowlist import SAFE_GLOBALS, allowed_names
from .errors import CheckpointError

LATEST = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"

_writers_lock = threading.Lock()
_active_writers: dict = {}   # abspath of a temporary tag directory -> its CheckpointWriter


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint file could not be written (``path``, ``errno``). Also an ``OSError``, so
    code catching the file system's error keeps working."""

    def __init__(self, msg: str, path: str = "", errno=None):
        RuntimeError.__init__(self, msg)
        self.msg, self.path, self.filename = msg, path, path
        self.errno = errno
        self.strerror = os.strerror(errno) if errno else None

    def __str__(self) -> str:
        return self.msg


_HINTS = {
    _errno.ENOSPC: "the file system is full: free space or save elsewhere",
    _errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota",
    _errno.EROFS: "the file system is mounted read-only: save elsewhere",
    _errno.EFBIG: "the file exceeds the file-size limit (ulimit -f) or the file system's maximum",
    _errno.EACCES: "permission denied: check the directory's owner and mode",
}


def _describe(err: OSError) -> str:
    code = getattr(err, "errno", None)
    text = os.strerror(code) if code else str(err)
    name = _errno.errorcode.get(code, "") if code else ""
    hint = _HINTS.get(code)
    return f"{text}{f' ({name})' if name else ''}" + (f"; {hint}" if hint else "")


def write_error(path: str, err: BaseException, kept: str = "") -> CheckpointWriteError:
    code = getattr(err, "errno", None)
    what = _describe(err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
    return CheckpointWriteError(f"Could not write checkpoint file '{path}': {what}." + (f" {kept}" if kept else ""),
                                path=path, errno=code)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def atomic_torch_save(obj, path: str) -> dict:
    """``torch.save`` to ``path`` via ``path.part`` + fsync + ``os.replace``. Returns the
    file's manifest entry (size, chunk CRC-32s, torch's per-record CRC-32s); a file
    written into an active checkpoint writer's directory is recorded in its manifest."""
    part = path + ".part"
    try:
        with open(part, "wb") as f:
            cf = _manifest.ChecksumFile(f)
            try:
                torch.save(obj, cf)
                cf.flush()
                os.fsync(f.fileno())
            except BaseException as err:
                if cf.error is not None:   # torch reports a failed write as a bare RuntimeError
                    raise cf.error from None
                raise err
        crcs = cf.finish()
        records = _manifest.zip_record_crcs(part)
        os.replace(part, path)
    except OSError as err:
        _remove(part)
        raise write_error(path, err) from None
    except BaseException:
        _remove(part)
        raise
    entry = _manifest.entry(cf.nbytes, crcs, records, *_rank_world())
    _record(path, entry)
    return entry


def make_executable(file) -> None:
    """Add the owner's execute bit to ``file`` (a path or an open descriptor)."""
    os.chmod(file, os.stat(file).st_mode | stat.S_IEXEC)


def atomic_write_text(path: str, text: str, sync_dir: bool = True, executable: bool = False) -> None:
    """Write ``text`` to ``path`` atomically (``executable``: with the owner's execute bit, as
    DeepSpeed leaves its ``zero_to_fp32.py``)."""
    part = path + ".part"
    try:
        with open(part, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
            if executable:
                make_executable(f.fileno())
        os.replace(part, path)
    except OSError as err:
        _remove(part)
        raise write_error(path, err) from None
    if sync_dir:
        _fsync_dir(os.path.dirname(path) or ".")
    if _active_writers:
        data = text.encode("utf-8")
        _record(path, _manifest.entry(len(data), [_manifest.crc32(data)], {}, *_rank_world()))


def _rank_world():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _record(path: str, entry: dict) -> None:
    d, name = os.path.split(os.path.abspath(path))
    with _writers_lock:
        w = _active_writers.get(d)
    if w is not None and not name.startswith(_manifest.SIDECAR_PREFIX):
        w._note(name, entry)


def _latest_note(save_dir: str) -> str:
    try:
        tag = read_latest_tag(save_dir)
    except CheckpointError:
        tag = None
    return f"'latest' still names '{tag}'" if tag else "there is no 'latest' file"


def sweep_incomplete_saves(save_dir: str) -> list:
    """Remove what killed saves left in ``save_dir``: ``.tmp-<tag>`` directories and
    ``*.part`` files; a ``.old-<tag>`` (a tag being replaced when the save died) goes back
    to ``<tag>`` if that is missing, else is removed. Returns the names handled."""
    done = []
    if not os.path.isdir(save_dir):
        return done
    for n in sorted(os.listdir(save_dir)):
        p = os.path.join(save_dir, n)
        if n.startswith(TMP_PREFIX) and os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif n.startswith(OLD_PREFIX) and os.path.isdir(p):
            final = os.path.join(save_dir, n[len(OLD_PREFIX):])
            if os.path.exists(final):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.replace(p, final)
        elif n.endswith(".part") and os.path.isfile(p):
            _remove(p)
        else:
            continue
        done.append(n)
    if done:
        _fsync_dir(save_dir)
    return done


class CheckpointWriter:
    """Writes the files of one checkpoint tag into a temporary directory (every rank
    constructs one; rank 0 prepares and commits)."""

    def __init__(self, save_dir: str, tag: str):
        self.save_dir = save_dir
        self.tag = tag
        self.final_path = os.path.join(save_dir, tag)
        self.path = os.path.join(save_dir, f"{TMP_PREFIX}{tag}")
        self._entries: dict = {}
        self.rank, self.world_size = _rank_world()
        with _writers_lock:
            _active_writers[os.path.abspath(self.path)] = self

    def _kept(self) -> str:
        return (f"Nothing of tag '{self.tag}' was committed: its partial files in '{self.path}' are removed, "
                f"the checkpoints already in '{self.save_dir}' are untouched and {_latest_note(self.save_dir)}.")

    def _note(self, name: str, entry: dict) -> None:
        self._entries[name] = entry
        try:
            import json
            atomic_write_text(os.path.join(self.path, _manifest.sidecar_name(self.rank)), json.dumps(self._entries),
                              sync_dir=False)
        except CheckpointWriteError as err:
            raise CheckpointWriteError(f"{err} {self._kept()}", err.path, err.errno) from None

    def prepare(self) -> None:
        """Rank 0: sweep what killed saves left behind, start from an empty temporary directory."""
        try:
            sweep_incomplete_saves(self.save_dir)
            os.makedirs(self.path, exist_ok=True)
        except OSError as err:
            raise write_error(self.path, err, f"Nothing was written; {_latest_note(self.save_dir)}.") from None

    def save(self, name: str, obj) -> None:
        try:
            atomic_torch_save(obj, os.path.join(self.path, name))
        except CheckpointWriteError as err:
            raise CheckpointWriteError(f"{err} {self._kept()}", err.path, err.errno) from None

    def write_text(self, name: str, text: str, executable: bool = False) -> None:
        try:
            atomic_write_text(os.path.join(self.path, name), text, sync_dir=False, executable=executable)
        except CheckpointWriteError as err:
            raise CheckpointWriteError(f"{err} {self._kept()}", err.path, err.errno) from None

    def _unregister(self) -> None:
        with _writers_lock:
            _active_writers.pop(os.path.abspath(self.path), None)

    def commit(self, save_latest: bool) -> None:
        """Rank 0, after every rank wrote successfully: write the manifest, move the tag
        into place, then replace ``latest`` (the commit point). On any failure the
        previous state is restored and :class:`CheckpointWriteError` says so."""
        self._unregister()
        latest = os.path.join(self.save_dir, LATEST)
        try:
            man = _manifest.build_manifest(self.path, self.tag, self.world_size, self._entries)
            import json
            atomic_write_text(os.path.join(self.path, _manifest.MANIFEST), json.dumps(man, indent=1),
                              sync_dir=False)
            _manifest.remove_sidecars(self.path)
            _fsync_dir(self.path)
        except (OSError, CheckpointWriteError) as err:
            self.abort()
            if isinstance(err, CheckpointWriteError):
                raise CheckpointWriteError(f"{err} {self._kept()}", err.path, err.errno) from None
            raise write_error(self.path, err, self._kept()) from None
        old = None
        try:
            if os.path.exists(self.final_path):
                old = os.path.join(self.save_dir, f"{OLD_PREFIX}{self.tag}")
                if os.path.exists(old):
                    shutil.rmtree(old)
                os.replace(self.final_path, old)
            os.replace(self.path, self.final_path)
            _fsync_dir(self.save_dir)
            if save_latest:
                atomic_write_text(latest, self.tag)
        except (OSError, CheckpointWriteError) as err:
            self._roll_back(old)
            kept = (f"The save of tag '{self.tag}' was rolled back: '{self.save_dir}' holds its previous "
                    f"checkpoints{' (tag ' + repr(self.tag) + ' as it was before)' if old else ''} and "
                    f"{_latest_note(self.save_dir)}.")
            if isinstance(err, CheckpointWriteError):
                raise CheckpointWriteError(f"{err} {kept}", err.path, err.errno) from None
            raise write_error(self.final_path, err, kept) from None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _roll_back(self, old) -> None:
        _remove(os.path.join(self.save_dir, LATEST + ".part"))
        if os.path.isdir(self.final_path) and (old is None or os.path.isdir(old)):
            shutil.rmtree(self.final_path, ignore_errors=True)
        if old is not None and os.path.isdir(old):
            os.replace(old, self.final_path)
        shutil.rmtree(self.path, ignore_errors=True)
        _fsync_dir(self.save_dir)

    def abort(self) -> None:
        self._unregister()
        shutil.rmtree(self.path, ignore_errors=True)


# ---------------------------------------------------------------- reading
def load_file(path: str, map_location="cpu", mmap: bool = False, verify=None, share: bool = False):
    """The one way the package reads a checkpoint file: verified against its tag's
    manifest (unless ``verify=False`` or verification is switched off), with
    ``torch.load(weights_only=True)`` and the allow-list of :mod:`.allowlist`.
    Raises :class:`CheckpointError` naming the file.

    A torch file the manifest lists with its records is checked while it is read: each
    record's CRC-32 from the bytes torch has just read (:class:`.manifest.RecordHasher`),
    so there is no second pass over the file. Other files (and ``mmap=True`` loads, whose
    bytes are read lazily) are checked by a pass over the file before loading.
    ``share=True``: every member of the group in :func:`.manifest.deferred_failures` reads
    this file; check only this member's share of its tensors (see ``RecordHasher``).
    Inside that block a mismatch is noted for the caller's agreement instead of raised."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        d, n = os.path.split(os.path.abspath(path))
        raise CheckpointError(f"Checkpoint file '{path}' is missing{_manifest.missing_note(d, n)}; the checkpoint "
                              f"is incomplete.")
    verifying = verify if verify is not None else _manifest.verification_enabled()
    if verifying:
        entry = None if mmap else _manifest.entry_of(path)
        if entry is not None and entry.get("records"):
            size = os.path.getsize(path)
            if size != entry["bytes"]:
                d, n = os.path.split(os.path.abspath(path))
                raise CheckpointError(f"Checkpoint file '{path}' is corrupted: it holds {size} bytes but "
                                      f"{entry['bytes']} were written{_manifest.missing_note(d, n)}. Restore it from "
                                      f"a copy or load another tag.")
            return _load_hashed(path, map_location, entry, share)
        taken = _manifest.take_prefetched(path) if mmap else None
        if taken is not None:   # checked in the background over the map this load slices from
            return _load_prefetched(path, *taken)
        try:
            with _manifest.set_checkpoint_verification(True):
                _manifest.verify_file(path, _load_unverified)
        except CheckpointError as err:
            _manifest.defer_or_raise(err)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - name the file and the rule
        if mmap and ("Cannot allocate memory" in str(err) or getattr(err, "errno", None) == _errno.ENOMEM):
            # torch maps the whole file private and writable, which the kernel's default
            # overcommit heuristic refuses for a file larger than RAM + swap (an NVMe-offloaded
            # rank's optimizer state): map it without a swap reservation instead
            try:
                return _load_mapped_noreserve(path)
            except Exception as err2:  # noqa: BLE001 - name the file
                err = err2
        raise CheckpointError(
            f"Could not load checkpoint file '{path}' with torch.load(weights_only=True): {err}. Checkpoint "
            f"files may only hold tensors, plain Python containers/numbers/strings (client_state included) "
            f"and these types: {allowed_names()}.") from None


def _load_hashed(path: str, map_location, entry: dict, share):
    """``torch.load(path, weights_only=True)`` through torch's own zip reader and weights-only
    unpickler, every record hashed as it is read (:class:`.manifest.RecordHasher`)."""
    import pickle
    import torch.serialization as ts
    share = _manifest.current_share() if share else None
    try:
        with ts.safe_globals(SAFE_GLOBALS), open(path, "rb") as f, ts._open_zipfile_reader(f) as zf, \
                open(path, "rb", buffering=0) as raw:
            hasher = _manifest.RecordHasher(zf, raw, path, entry, share)
            try:
                obj = ts._load(hasher, map_location, ts._weights_only_unpickler, encoding="utf-8")
            except pickle.UnpicklingError as err:
                raise pickle.UnpicklingError(ts._get_wo_message(str(err))) from None
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - name the file and the rule
        raise CheckpointError(
            f"Could not load checkpoint file '{path}' with torch.load(weights_only=True): {err}. Checkpoint "
            f"files may only hold tensors, plain Python containers/numbers/strings (client_state included) "
            f"and these types: {allowed_names()}.") from None
    bad = hasher.mismatches(obj)
    if bad is not None:
        _manifest.defer_or_raise(CheckpointError(bad))
    return obj


def _load_prefetched(path: str, mapped, future):
    """A memory-mapped load of a file :func:`.manifest.prefetch` is checking: the tensors are
    sliced from the map the check reads (torch's own zip reader and weights-only unpickler,
    ``overall_storage`` as ``mmap=True`` does), and the check's outcome is settled later
    (:func:`.manifest.settle`). If the file does not even load, its checksum failure (when
    there is one) is the error."""
    import numpy as np
    import torch.serialization as ts
    storage = torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8)).untyped_storage()
    try:
        with ts.safe_globals(SAFE_GLOBALS), open(path, "rb") as f, ts._open_zipfile_reader(f) as zf:
            obj = ts._load(zf, "cpu", ts._weights_only_unpickler, overall_storage=storage, encoding="utf-8")
    except Exception as err:  # noqa: BLE001 - name the file and the rule
        future.result()   # a damaged file raises its CheckpointError (the mismatch) here
        raise CheckpointError(
            f"Could not load checkpoint file '{path}' with torch.load(weights_only=True): {err}. Checkpoint "
            f"files may only hold tensors, plain Python containers/numbers/strings (client_state included) "
            f"and these types: {allowed_names()}.") from None
    _manifest.settle(future)
    return obj


def _load_unverified(path: str):
    """For naming the tensors of a file that failed verification."""
    return load_file(path, mmap=True, verify=False)


def _load_mapped_noreserve(path: str):
    """``torch.load(path, weights_only=True, mmap=True)`` over a private memory map made with
    ``MAP_NORESERVE`` (:func:`~deepspeed.runtime.swap_tensor.utils.map_file`): the same
    tensors, file-backed, for a file larger than RAM + swap. Uses torch's own zip reader and
    weights-only unpickler (``torch.serialization._load``) under the same allow-list,
    handing it the map as the storage the tensors are sliced from, as ``mmap=True`` does."""
    import torch.serialization as ts
    from ..swap_tensor.utils import map_file
    storage = map_file(path, os.path.getsize(path), torch.uint8).untyped_storage()
    with ts.safe_globals(SAFE_GLOBALS), open(path, "rb") as f, ts._open_zipfile_reader(f) as zf:
        return ts._load(zf, "cpu", ts._weights_only_unpickler, overall_storage=storage, encoding="utf-8")


class CheckpointReader:
    """Reads the files of one saved checkpoint tag (checked for completeness against its
    manifest on construction; each file verified on load)."""

    def __init__(self, load_dir: str, tag: str, verify=None):
        self.load_dir = load_dir
        self.tag = tag
        self.verify = verify
        self.path = os.path.join(load_dir, tag)
        if not os.path.isdir(self.path):
            named = ""
            if os.path.isfile(os.path.join(load_dir, LATEST)):
                with contextlib.suppress(CheckpointError):
                    if read_latest_tag(load_dir) == tag:
                        named = f" 'latest' in '{load_dir}' names it."
            raise CheckpointError(
                f"Checkpoint directory '{self.path}' does not exist (load_dir='{load_dir}', tag='{tag}').{named}")
        _manifest.check_complete(self.path)

    def exists(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.path, name))

    def list(self, prefix: str = "", suffix: str = "") -> list[str]:
        return sorted(n for n in os.listdir(self.path) if n.startswith(prefix) and n.endswith(suffix))

    def load(self, name: str, map_location="cpu", share: bool = False):
        return load_file(os.path.join(self.path, name), map_location=map_location, verify=self.verify, share=share)


def read_latest_tag(load_dir: str):
    """The tag ``latest`` names; None only when there is no ``latest`` file. A ``latest``
    that is empty, unreadable or names no valid tag raises :class:`CheckpointError`."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"'{path}' exists but cannot be read ({err}). It should hold the tag of the last "
                              f"checkpoint; fix or remove it, or pass tag=... explicitly.") from None
    tag = text.strip()
    if not tag:
        raise CheckpointError(f"'{path}' exists but is empty: it names no checkpoint tag, so it is unknown which "
                              f"checkpoint to resume from. Write the tag into it, remove it (to start from "
                              f"scratch), or pass tag=... explicitly.")
    if "\n" in tag or os.sep in tag or tag in (".", ".."):
        raise CheckpointError(f"'{path}' does not hold a checkpoint tag (found {tag[:80]!r}); fix or remove it, "
                              f"or pass tag=... explicitly.")
    return tag
