"""The communication logger: op name, message size, latency and bandwidth of every
``deepspeed.comm`` collective and point-to-point op.

Parts:

* :func:`timed_op` wraps each op of :mod:`deepspeed.comm.comm` once, at import. While
  the logger is off (the default) the wrapper is one flag check and the call; nothing
  else runs.
* :class:`CommsLogger` keeps, per op label and message size, the count, latencies and
  bandwidths; :func:`configure` switches it on (from the ``comms_logger`` config
  section or keyword arguments); :func:`log_summary` prints one table.

Latency of a blocking op is the wall time of the call, with the accelerator
synchronised before and after. An op launched with ``async_op=True`` returns a work
handle whose ``wait()`` records the time from launch to completion (so overlapped
communication shows its real span, not the launch cost).

Bandwidths follow nccl-tests (``doc/PERFORMANCE.md``): ``algbw = S / t`` with ``S`` the
op's data size (for all-gather the gathered output, for reduce-scatter the input,
for all-to-all the input), and ``busbw = algbw * f`` with ``f = 2(n-1)/n`` for
all-reduce, ``(n-1)/n`` for all-gather, reduce-scatter and all-to-all, and ``1`` for
broadcast, reduce and point-to-point ops; ``n`` is the group size. Reported in Gbps
(10^9 bits per second).
"""
from __future__ import annotations

import functools
import inspect
import sys
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional

import torch


def _bytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def _list_bytes(ts) -> int:
    return sum(_bytes(t) for t in ts) if isinstance(ts, (list, tuple)) else 0


def _arg(args, kwargs, i, name):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else None


# op -> (message size in bytes from the call's arguments, bus-bandwidth factor of n)
_ALL_REDUCE = lambda n: 2.0 * (n - 1) / n  # noqa: E731
_GATHER_LIKE = lambda n: (n - 1) / n  # noqa: E731
_ONE = lambda n: 1.0  # noqa: E731
OPS: Dict[str, tuple] = {
    "all_reduce": (lambda a, k: _bytes(_arg(a, k, 0, "tensor")), _ALL_REDUCE),
    "inference_all_reduce": (lambda a, k: _bytes(_arg(a, k, 0, "tensor")), _ALL_REDUCE),
    "all_reduce_coalesced": (lambda a, k: _list_bytes(_arg(a, k, 0, "tensors")), _ALL_REDUCE),
    "all_gather_coalesced": (lambda a, k: sum(_list_bytes(o) for o in _arg(a, k, 0, "output_tensors") or ()),
                             _GATHER_LIKE),
    "reduce_scatter_coalesced": (lambda a, k: _list_bytes(_arg(a, k, 0, "tensors")), _GATHER_LIKE),
    "reduce": (lambda a, k: _bytes(_arg(a, k, 0, "tensor")), _ONE),
    "broadcast": (lambda a, k: _bytes(_arg(a, k, 0, "tensor")), _ONE),
    "all_gather": (lambda a, k: _list_bytes(_arg(a, k, 0, "tensor_list")), _GATHER_LIKE),
    "all_gather_into_tensor": (lambda a, k: _bytes(_arg(a, k, 0, "output_tensor")), _GATHER_LIKE),
    "reduce_scatter": (lambda a, k: _list_bytes(_arg(a, k, 1, "input_list")), _GATHER_LIKE),
    "reduce_scatter_tensor": (lambda a, k: _bytes(_arg(a, k, 1, "input")), _GATHER_LIKE),
    "all_to_all_single": (lambda a, k: _bytes(_arg(a, k, 1, "input")), _GATHER_LIKE),
    "send": (lambda a, k: _bytes(_arg(a, k, 0, "tensor")), _ONE),
    "recv": (lambda a, k: _bytes(_arg(a, k, 0, "tensor")), _ONE),
    "isend": (lambda a, k: _bytes(_arg(a, k, 0, "tensor")), _ONE),
    "irecv": (lambda a, k: _bytes(_arg(a, k, 0, "tensor")), _ONE),
    "barrier": (lambda a, k: 0, _ONE),
}


def bandwidths_gbps(op: str, size_bytes: int, latency_s: float, n: int):
    """``(algbw, busbw)`` in Gbps for ``op`` moving ``size_bytes`` in ``latency_s`` over ``n`` ranks."""
    if latency_s <= 0 or size_bytes <= 0 or n < 1:
        return 0.0, 0.0
    algbw = size_bytes * 8 / latency_s / 1e9
    return algbw, algbw * OPS[op][1](n)


def convert_size(size_bytes: int) -> str:
    """``1536 -> '1.5 KB'`` (binary units, as DeepSpeed's summary prints them)."""
    if size_bytes == 0:
        return "0B"
    units = ("B", "KB", "MB", "GB", "TB")
    i, s = 0, float(size_bytes)
    while s >= 1024 and i < len(units) - 1:
        s /= 1024
        i += 1
    return f"{round(s, 2):g} {units[i]}"


class CommsLogger:
    """Records per ``(label, message size)``: count, latencies (ms), algbw and busbw (Gbps)."""

    def __init__(self):
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.prof_ops: List[str] = []
        self.debug = False
        self.comms_dict: Dict[str, Dict[int, list]] = defaultdict(dict)

    def configure(self, comms_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None,
                  debug=None) -> None:
        if comms_config is not None:
            for key in ("enabled", "prof_all", "prof_ops", "verbose", "debug"):
                setattr(self, key, getattr(comms_config, key))
        for key, v in (("enabled", enabled), ("prof_all", prof_all), ("verbose", verbose), ("debug", debug)):
            if v is not None:
                setattr(self, key, bool(v))
        if prof_ops is not None:
            if isinstance(prof_ops, str) or not all(isinstance(o, str) for o in prof_ops):
                raise TypeError(f"comms_logger prof_ops must be a list of op names such as ['all_reduce'], "
                                f"got {prof_ops!r}")
            self.prof_ops = list(prof_ops)
        unknown = [o for o in self.prof_ops if o not in OPS]
        if unknown:
            raise ValueError(f"comms_logger.prof_ops: unknown op(s) {unknown}; valid: {sorted(OPS)}")

    def should_log(self, op: str, prof: bool) -> bool:
        return prof or self.prof_all or op in self.prof_ops

    def reset(self) -> None:
        self.comms_dict = defaultdict(dict)

    # DeepSpeed 0.19's runtime switches and queries
    def start_profiling_comms(self) -> None:
        """Record every op (``prof_all``), as if the config said ``prof_all: true``."""
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        """Record only the ops in ``prof_ops`` (and calls made with ``prof=True``)."""
        self.prof_all = False

    def start_profiling_op(self, op_name_list) -> None:
        self.configure(prof_ops=list(dict.fromkeys(list(self.prof_ops) + list(op_name_list))))

    def stop_profiling_op(self, op_name_list) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def get_raw_data(self) -> dict:
        """``{label: {message size: [count, [latency ms], [algbw Gbps], [busbw Gbps]]}}`` (a shallow copy)."""
        return dict(self.comms_dict)

    def has_data(self) -> bool:
        return len(self.comms_dict) > 0

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> List[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(rec[0] for sizes in self.comms_dict.values() for rec in sizes.values())

    def get_operation_summary(self, operation_name: str) -> Optional[dict]:
        """Per message size of one op label: count, total and (10%-trimmed) average latency in ms,
        average algbw / busbw in Gbps, and the size; None when the label was never recorded. The
        recorded lists are not reordered."""
        if operation_name not in self.comms_dict:
            return None
        from ..utils.timer import trim_mean
        out = {}
        for size, (count, lats, algs, buses) in list(self.comms_dict[operation_name].items()):
            out[size] = {"count": count, "total_latency_ms": sum(lats), "avg_latency_ms": trim_mean(lats, 0.1),
                         "tput_avg_gbps": trim_mean(algs, 0.1), "busbw_avg_gbps": trim_mean(buses, 0.1),
                         "msg_size_bytes": size, "msg_size_str": convert_size(size)}
        return out

    def append(self, op: str, label: str, size: int, latency_s: float, n: int) -> None:
        algbw, busbw = bandwidths_gbps(op, size, latency_s, n)
        rec = self.comms_dict[label].setdefault(size, [0, [], [], []])
        rec[0] += 1
        rec[1].append(latency_s * 1e3)
        rec[2].append(algbw)
        rec[3].append(busbw)
        if self.verbose:
            from ..utils.logging import log_dist
            log_dist(f"comm op: {label} | time (ms): {latency_s * 1e3:.3f} | msg size: {convert_size(size)} | "
                     f"algbw (Gbps): {algbw:.3f} | busbw (Gbps): {busbw:.3f}", ranks=[0])

    def summary_rows(self, mins: Optional[Dict] = None) -> List[list]:
        from ..utils.timer import trim_mean
        rows = []
        for label in sorted(self.comms_dict):
            for size in sorted(self.comms_dict[label]):
                count, lats, algs, buses = self.comms_dict[label][size]
                total = sum(lats)
                # averages drop outliers as DeepSpeed's log_all does (10% trimmed mean)
                row = [label, size, count, total, trim_mean(lats, 0.1), trim_mean(algs, 0.1), trim_mean(buses, 0.1)]
                if mins is not None:
                    row.append(total - mins.get((label, size), total))
                rows.append(row)
        return rows

    def format_summary(self, rows: List[list], show_straggler: bool = False) -> str:
        header = ["Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
                  "busbw_avg (Gbps)"] + (["straggler (ms)"] if show_straggler else [])
        table = [header] + [[r[0], convert_size(r[1]), str(r[2])] + [f"{x:.3f}" for x in r[3:]] for r in rows]
        widths = [max(len(row[i]) for row in table) + 3 for i in range(len(header))]  # >= 2 spaces apart
        return "\n".join("".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


comms_logger = CommsLogger()


class _TimedWork:
    """An async work handle whose ``wait()`` records the op's latency once."""

    def __init__(self, work, record: Callable[[float], None], t0: float):
        self._work, self._record, self._t0, self._done = work, record, t0, False

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if not self._done:
            self._done = True
            # On a GPU wait() only orders the current stream after the op; synchronise so
            # the time read is the op's completion, not its enqueueing.
            from ..accelerator import get_accelerator
            get_accelerator().synchronize()
            self._record(time.perf_counter() - self._t0)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _group_size(args, kwargs, fn) -> int:
    import torch.distributed as dist
    group = kwargs.get("group")
    if group is None and "group" in _positional(fn):
        i = _positional(fn).index("group")
        group = args[i] if len(args) > i else None
    return dist.get_world_size(group)


@functools.lru_cache(maxsize=None)
def _positional(fn) -> tuple:
    return tuple(inspect.signature(fn).parameters)


def _caller() -> str:
    """``function@file:line`` of the code that called the op (frames: this, the wrapper, it)."""
    f = sys._getframe(2)
    return f"{f.f_code.co_name}@{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}"


_EXTRA_KWARGS = frozenset(("prof", "log_name", "debug"))


def timed_op(fn):
    """Wrap a ``deepspeed.comm`` op so it is recorded while the logger is on. Accepts
    DeepSpeed's extra keywords ``prof`` (log this call even if its op is not profiled),
    ``log_name`` (the label in the summary) and ``debug`` (append the caller)."""
    op = fn.__name__
    size_of = OPS[op][0]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not comms_logger.enabled:
            if kwargs and not _EXTRA_KWARGS.isdisjoint(kwargs):
                for k in _EXTRA_KWARGS:
                    kwargs.pop(k, None)
            return fn(*args, **kwargs)
        prof = kwargs.pop("prof", False)
        label = kwargs.pop("log_name", None) or op
        debug = kwargs.pop("debug", False) or comms_logger.debug
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or not comms_logger.should_log(op, prof):
            return fn(*args, **kwargs)
        if debug:
            label = f"{label} | [Caller Func: {_caller()}]"
        size, n = size_of(args, kwargs), _group_size(args, kwargs, fn)
        from ..accelerator import get_accelerator
        acc = get_accelerator()
        acc.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)

        def record(dt):
            comms_logger.append(op, label, size, dt, n)

        if out is not None and hasattr(out, "wait"):
            return _TimedWork(out, record, t0)
        acc.synchronize()
        record(time.perf_counter() - t0)
        return out

    wrapper.__wrapped_op__ = fn
    return wrapper


def wrap_ops(namespace: dict) -> None:
    """Wrap every op of ``OPS`` defined in ``namespace`` (a module's globals) once."""
    for op in OPS:
        f = namespace.get(op)
        if callable(f) and not hasattr(f, "__wrapped_op__"):
            namespace[op] = timed_op(f)


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None):
    """Switch the logger on or off: from a ``DeepSpeedConfig`` (its ``comms_logger``
    section) and/or keyword arguments, which win."""
    section = None
    if deepspeed_config is not None:
        model = getattr(deepspeed_config, "model", deepspeed_config)
        section = getattr(model, "comms_logger", None)
        if section is None and isinstance(deepspeed_config, dict) and "comms_logger" in deepspeed_config:
            from ..config.monitor_sections import CommsLoggerSection
            section = CommsLoggerSection(**deepspeed_config["comms_logger"])
    comms_logger.configure(section, enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose,
                           debug=debug)


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """Print (rank 0) one table of every recorded op and message size: count, total and
    average latency (ms), average algorithmic and bus bandwidth (Gbps). With
    ``show_straggler`` (a collective: every rank must call it) a last column gives this
    rank's total latency minus the smallest across ranks, i.e. the time lost waiting
    for the slowest rank. Returns the table text (or the raw dict with ``return_dict``)."""
    import torch.distributed as dist
    was = comms_logger.enabled
    comms_logger.enabled = False  # the straggler reduction itself is not logged
    try:
        mins = None
        if show_straggler and dist.is_available() and dist.is_initialized():
            keys = [(label, size) for label in sorted(comms_logger.comms_dict)
                    for size in sorted(comms_logger.comms_dict[label])]
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, keys)
            all_keys = sorted(set().union(*[set(map(tuple, g)) for g in gathered]))
            totals = torch.tensor([sum(comms_logger.comms_dict.get(k[0], {}).get(k[1], [0, [0.0]])[1])
                                   for k in all_keys], dtype=torch.float64)
            from .. import comm as ds_comm
            totals = ds_comm.to_comm_device(totals)  # NCCL reduces device tensors only
            dist.all_reduce(totals, op=dist.ReduceOp.MIN)
            mins = dict(zip(all_keys, totals.tolist()))
        rows = comms_logger.summary_rows(mins)
        text = comms_logger.format_summary(rows, show_straggler=mins is not None)
    finally:
        comms_logger.enabled = was
    # DeepSpeed prints the table on rank 0 (print, not the logger): it shows even when the user has
    # quieted the DeepSpeed logger, and redirecting stdout captures it.
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        print("Communication summary\n" + text, flush=True)
    if return_dict:
        return {label: dict(v) for label, v in comms_logger.comms_dict.items()}
    return text
