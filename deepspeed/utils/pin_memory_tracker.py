"""Running total of the host memory this process pinned (``deepspeed.utils.pin_memory_tracker``).

Page-locked host memory cannot be swapped out and counts against the memlock limit
(``ulimit -l``), so a host out-of-memory error often shows up far from whatever pinned the
memory. Each accelerator ``pin_memory()`` that really pins adds the tensor's bytes here; the
total is logged at DEBUG per call and at INFO each time it first reaches 32 GiB, 64 GiB,
128 GiB, ... (a doubling ladder: a handful of lines however many tensors are pinned).
:func:`pinned_memory_summary` logs the total and the number of allocations on demand.

Names as in DeepSpeed 0.19: ``track_pinned_memory(num_bytes)``, ``pinned_memory_summary(tag)``,
the process-wide ``_tracker`` (``_bytes``, ``_calls``, ``_next_checkpoint``, ``reset()``) and
``_fmt_bytes``.
"""
from __future__ import annotations

from .logging import logger

_KIB = 1024
_MIB = _KIB * 1024
_GIB = _MIB * 1024
FIRST_CHECKPOINT_BYTES = 32 * _GIB


def _fmt_bytes(num_bytes: int) -> str:
    """Human-readable size: bytes as an integer, then KB / MB / GB with 1 / 2 / 3 decimals."""
    for unit, size, decimals in (("GB", _GIB, 3), ("MB", _MIB, 2), ("KB", _KIB, 1)):
        if num_bytes >= size:
            return f"{num_bytes / size:.{decimals}f} {unit}"
    return f"{num_bytes} B"


class _PinnedMemoryTracker:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = FIRST_CHECKPOINT_BYTES

    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def calls(self) -> int:
        return self._calls

    def track(self, num_bytes: int) -> None:
        self._bytes += int(num_bytes)
        self._calls += 1
        logger.debug("pin_memory: +%s (allocation %d, %s pinned in all)", _fmt_bytes(int(num_bytes)), self._calls,
                     _fmt_bytes(self._bytes))
        crossed = None
        while self._bytes >= self._next_checkpoint:   # one call may cross several rungs: one line
            crossed = self._next_checkpoint
            self._next_checkpoint *= 2
        if crossed is not None:
            logger.info(f"[pinned-memory checkpoint] reached {_fmt_bytes(crossed)}: {_fmt_bytes(self._bytes)} "
                        f"pinned in {self._calls} allocations")

    def log_summary(self, tag: str = "") -> None:
        label = f"[pinned-memory {tag}]" if tag else "[pinned-memory]"
        logger.info(f"{label} {_fmt_bytes(self._bytes)} pinned in {self._calls} allocations")


_tracker = _PinnedMemoryTracker()


def track_pinned_memory(num_bytes: int) -> None:
    """Add ``num_bytes`` just pinned to the process total (logs a checkpoint line when a rung is reached)."""
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    """Log the process total of pinned host memory, labelled with ``tag``."""
    _tracker.log_summary(tag)
