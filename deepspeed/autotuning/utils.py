"""Helpers of the autotuner: nested-dict access, search spaces, experiment names and
files, error detection in an experiment's log, and number formatting.

``get_val_by_key``/``set_val_by_key`` walk every nested dict (a key such as
``reduce_bucket_size`` lives under ``zero_optimization``); ``get_all_configs`` expands a
tuning space (lists are the values to try) into every combination, in a fixed order.
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import re
from typing import Any, Dict, Iterable, List, Optional

# ------------------------------------------------------------------ nested dicts


def get_val_by_key(d: dict, k: str):
    """The value of key ``k`` anywhere in ``d`` (depth first, first match), or ``None``."""
    if not isinstance(d, dict):
        return None
    if k in d:
        return d[k]
    for v in d.values():
        if isinstance(v, dict):
            found = get_val_by_key(v, k)
            if found is not None:
                return found
    return None


def set_val_by_key(d: dict, k: str, vv) -> None:
    """Set every occurrence of key ``k`` in ``d`` (at any depth) to ``vv``."""
    if not isinstance(d, dict):
        return
    if k in d:
        d[k] = vv
    for v in d.values():
        if isinstance(v, dict):
            set_val_by_key(v, k, vv)


def combine_dict(d: dict, u: dict) -> dict:
    """``d`` updated with ``u`` recursively (``u`` wins); returns a new dict."""
    out = copy.deepcopy(d)
    for k, v in (u or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = combine_dict(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# ------------------------------------------------------------------ tuning spaces


def _flatten(space: dict, prefix=()) -> List[tuple]:
    items = []
    for k, v in space.items():
        if isinstance(v, dict):
            items.extend(_flatten(v, prefix + (k, )))
        else:
            items.append((prefix + (k, ), v))
    return items


def get_tuning_keys(tuning_space: dict) -> List[str]:
    """The keys whose value is a list of candidates (the dimensions of the search)."""
    return [path[-1] for path, v in _flatten(tuning_space) if isinstance(v, list)]


def get_all_configs(tuning_space: dict) -> List[dict]:
    """Every combination of the tuning space's lists (lexicographic, first key slowest)."""
    flat = _flatten(tuning_space)
    dims = [v if isinstance(v, list) else [v] for _, v in flat]
    if any(len(d) == 0 for d in dims):
        empty = [".".join(p) for (p, v) in flat if isinstance(v, list) and not v]
        raise ValueError(f"tuning space: no candidate values for {empty}")
    configs = []
    for combo in itertools.product(*dims):
        cfg: Dict[str, Any] = {}
        for (path, _), val in zip(flat, combo):
            node = cfg
            for p in path[:-1]:
                node = node.setdefault(p, {})
            node[path[-1]] = val
        configs.append(cfg)
    return configs


def _short(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and v >= 1000:
        for unit, div in (("g", 10**9), ("m", 10**6), ("k", 10**3)):
            if v % div == 0:
                return f"{v // div}{unit}"
    return str(v)


_ABBREV = {"reduce_bucket_size": "rbs", "allgather_bucket_size": "abs", "overlap_comm": "oc",
           "stage3_prefetch_bucket_size": "pbs", "stage3_param_persistence_threshold": "ppt",
           "stage3_max_live_parameters": "mlp", "contiguous_gradients": "cg", "reduce_scatter": "rs"}


def canonical_name(config: dict, tuning_keys: Optional[Iterable[str]] = None, prefix: str = "") -> str:
    """A file-system-safe experiment name from the values of ``tuning_keys`` in ``config``."""
    parts = [prefix] if prefix else []
    for k in tuning_keys or []:
        v = get_val_by_key(config, k)
        if v is not None:
            parts.append(f"{_ABBREV.get(k, k)}{_short(v)}")
    return re.sub(r"[^A-Za-z0-9_.=-]", "", "_".join(parts))


def write_experiments(exps: List[dict], exps_dir: str) -> List[str]:
    """Write each experiment description to ``exps_dir/<name>.json``; returns the paths."""
    os.makedirs(exps_dir, exist_ok=True)
    paths = []
    for exp in exps:
        path = os.path.join(exps_dir, f"{exp['name']}.json")
        with open(path, "w") as fd:
            json.dump(exp, fd, indent=2)
        paths.append(path)
    return paths


# ------------------------------------------------------------------ experiment logs

_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")


def search_error(filename: str) -> Optional[str]:
    """The most telling error line of an experiment's stderr log, or ``None`` when clean:
    the last exception line (``RuntimeError: ...``; an out-of-memory one first), else any
    line naming out of memory or a kill."""
    if not os.path.exists(filename):
        return f"no log at {filename}"
    with open(filename, errors="replace") as f:
        lines = [ln.strip() for ln in f]
    exc = [m.group(1) for m in (_EXCEPTION_LINE.match(ln) for ln in lines) if m]
    for text in reversed(exc):
        if "out of memory" in text.lower():
            return text
    if exc:
        return exc[-1]
    for ln in reversed(lines):
        if "out of memory" in ln.lower() or "Killed" in ln:
            return ln
    return None


def was_interrupted(filename: str) -> bool:
    """Whether the experiment whose stderr is ``filename`` was stopped by a signal (Ctrl-C)."""
    if not os.path.exists(filename):
        return False
    with open(filename, errors="replace") as f:
        return "KeyboardInterrupt" in f.read()


# ------------------------------------------------------------------ formatting


def number_to_string(n, precision: int = 2) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.{precision}f} {unit}"
    return f"{n:.{precision}f}" if isinstance(n, float) else str(n)


def memory_to_string(n, postfix: str = "B", precision: int = 2) -> str:
    for unit, div in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.{precision}f} {unit}{postfix}"
    return f"{int(n)} {postfix}"
