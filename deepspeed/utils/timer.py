"""Wall-clock timers (``wall_clock_breakdown``) and a samples/s throughput meter."""
from __future__ import annotations

import time

from .logging import log_dist


class _Timer:
    def __init__(self, name: str, sync):
        self.name = name
        self._sync = sync
        self.started = False
        self._start = 0.0
        self.elapsed_ = 0.0
        self.records = []

    def start(self):
        if not self.started:
            self._sync()
            self._start = time.perf_counter()
            self.started = True

    def stop(self, record=True):
        if self.started:
            self._sync()
            dt = time.perf_counter() - self._start
            self.elapsed_ += dt
            if record:
                self.records.append(dt)
            self.started = False

    def reset(self):
        self.started = False
        self.elapsed_ = 0.0
        self.records.clear()

    def elapsed(self, reset=True) -> float:
        was = self.started
        if was:
            self.stop(record=False)
        e = self.elapsed_
        if reset:
            self.reset()
        if was:
            self.start()
        return e

    def mean(self) -> float:
        return sum(self.records) / len(self.records) if self.records else 0.0


class SynchronizedWallClockTimer:
    """Named timers that synchronise the accelerator before reading the clock."""

    def __init__(self):
        self.timers: dict[str, _Timer] = {}

    @staticmethod
    def _sync():
        from ..accelerator import get_accelerator
        get_accelerator().synchronize()

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = _Timer(name, self._sync)
        return self.timers[name]

    def get_timers(self):
        return self.timers

    def log(self, names, normalizer=1.0, reset=True, memory_breakdown=False, ranks=None):
        parts = []
        for n in names:
            if n in self.timers:
                parts.append(f"{n}: {self.timers[n].elapsed(reset=reset) * 1000.0 / normalizer:.2f}")
        if parts:
            log_dist("time (ms) | " + " | ".join(parts), ranks=ranks or [0])

    def get_mean(self, names, normalizer=1.0, reset=True):
        out = {}
        for n in names:
            if n in self.timers:
                out[n] = self.timers[n].mean() * 1000.0 / normalizer
                if reset:
                    self.timers[n].reset()
        return out


class NoopTimer(SynchronizedWallClockTimer):
    class _T:
        def start(self): ...
        def stop(self, record=True): ...
        def reset(self): ...
        def elapsed(self, reset=True): return 0.0
        def mean(self): return 0.0

    def __call__(self, name):
        return self._T()

    def log(self, *a, **k): ...


class ThroughputTimer:
    """Samples per second over optimizer steps (first ``start_step`` steps skipped)."""

    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output=None, monitor_memory=False, logging_fn=None):
        self.batch_size = batch_size
        self.start_step = start_step
        self.step_count = 0
        self.total_elapsed = 0.0
        self.counted_steps = 0
        self._t0 = None

    def start(self):
        self._t0 = time.perf_counter()

    def stop(self, global_step=True, report_speed=False):
        if self._t0 is None:
            return
        dt = time.perf_counter() - self._t0
        self._t0 = None
        if global_step:
            self.step_count += 1
            if self.step_count > self.start_step:
                self.total_elapsed += dt
                self.counted_steps += 1
        self.last = dt

    def avg_samples_per_sec(self) -> float:
        if self.counted_steps == 0 or self.total_elapsed == 0:
            return 0.0
        return self.batch_size * self.counted_steps / self.total_elapsed


def trim_mean(data, trim_percent: float) -> float:
    """Mean of ``data`` after dropping ``round(len * trim_percent)`` values from each end (of a sorted
    copy: the argument is not reordered). 0 for an empty list."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_mean: trim_percent must be in [0, 1], got {trim_percent}")
    n = len(data)
    if n == 0:
        return 0
    k = int(round(n * trim_percent))
    kept = sorted(data)[k:n - k]
    return sum(kept) / len(kept) if kept else 0
