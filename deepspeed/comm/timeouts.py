"""Collective failures that say which collective and which training step.

Why: when a rank stalls, gloo's own error is "Timed out waiting 600000ms for recv
operation to complete" - no collective, no step - and at ZeRO stages 0-2 it surfaced
from a bare ``work.wait()`` on a gradient bucket. Every ``deepspeed.comm`` op is wrapped
(:func:`wrap_ops`) so a timeout or a lost peer, raised by the call itself or later by its
async handle's ``wait()``, becomes :class:`CollectiveTimeoutError` naming the op, the
group size, the process-group timeout and the training step (the engine registers
where its step counters live with :func:`set_step_source`).

After such a failure the process leaves quickly: :func:`failed` tells the exit hook
(:mod:`.shutdown`) not to wait for peers or tear down a broken process group.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional

_step_source: Optional[Callable[[], str]] = None
_failed = False
_MARKERS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
            "connection refused", "socket closed")


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: a peer stalled past the timeout, or died."""


def mark_failed() -> None:
    """Note that a collective of this process failed (raised by a caller's own error type)."""
    global _failed
    _failed = True


def failed() -> bool:
    """Whether this process saw a collective fail (its process group is unusable)."""
    return _failed


def set_step_source(engine) -> None:
    """Name ``engine``'s step counters in collective errors (held weakly)."""
    global _step_source
    ref = weakref.ref(engine)

    def describe() -> str:
        e = ref()
        if e is None:
            return ""
        return f" at global step {getattr(e, 'global_steps', '?')} (micro step {getattr(e, 'micro_steps', '?')})"
    _step_source = describe


def step_text() -> str:
    try:
        return _step_source() if _step_source is not None else ""
    except Exception:  # noqa: BLE001 - an error message must not fail
        return ""


def _is_comm_failure(err: BaseException) -> bool:
    import torch.distributed as dist
    backend_error = getattr(dist, "DistBackendError", None)
    if isinstance(err, CollectiveTimeoutError):
        return False
    if backend_error is not None and isinstance(err, backend_error):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(m in text for m in _MARKERS)


def _timeout_text(group) -> str:
    try:
        import torch.distributed.distributed_c10d as c10d
        import torch
        pg = group if group is not None else c10d._get_default_group()
        t = pg._get_backend(torch.device("cpu")).options._timeout
        return f", process-group timeout {t.total_seconds():g}s"
    except Exception:  # noqa: BLE001 - older torch: no options on the group
        return ""


def _world(group) -> str:
    try:
        import torch.distributed as dist
        return f" over {dist.get_world_size(group)} ranks"
    except Exception:  # noqa: BLE001
        return ""


def collective_error(op: str, group, err: BaseException, what: str = "") -> CollectiveTimeoutError:
    global _failed
    _failed = True
    return CollectiveTimeoutError(
        f"deepspeed.comm.{op}{f' ({what})' if what else ''}{_world(group)} did not complete{step_text()}"
        f"{_timeout_text(group)}: {err}\nA rank stopped, stalled past the timeout or died (see its log); "
        f"every rank must reach the same collectives. The timeout is init_distributed(timeout=...) or "
        f"DEEPSPEED_TIMEOUT (minutes).")


class NamedWork:
    """An async handle whose ``wait()`` names the collective when it fails."""

    __slots__ = ("_work", "_op", "_group")

    def __init__(self, work, op: str, group):
        self._work, self._op, self._group = work, op, group

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised, named, when it is a comm failure
            if _is_comm_failure(err):
                raise collective_error(self._op, self._group, err) from err
            raise

    def __getattr__(self, name):
        return getattr(self._work, name)

    def __repr__(self):
        return f"NamedWork({self._op}, {self._work!r})"


def named_op(fn):
    op = fn.__name__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised, named, when it is a comm failure
            if _is_comm_failure(err):
                raise collective_error(op, kwargs.get("group"), err) from err
            raise
        if out is not None and hasattr(out, "wait") and type(out).__name__ != "CompletedWork":
            return NamedWork(out, op, kwargs.get("group"))
        return out

    wrapper.__named_op__ = fn
    return wrapper


def wrap_ops(namespace: dict, names) -> None:
    for name in names:
        f = namespace.get(name)
        if callable(f) and not hasattr(f, "__named_op__"):
            namespace[name] = named_op(f)
