"""``Monitor``, the interface every backend implements, and the helpers backends share
(event checking, scalar conversion, the global rank). Backends import this file;
:mod:`.monitor` builds them (``MonitorMaster``) and re-exports these names."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Iterable, List, Sequence, Tuple

Event = Tuple[str, float, int]


def global_rank() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def check_events(event_list: Iterable) -> List[Event]:
    """Events are ``(name, value, step)`` 3-tuples; say which one is not."""
    events = list(event_list)
    for i, ev in enumerate(events):
        if not (isinstance(ev, (tuple, list)) and len(ev) == 3 and isinstance(ev[0], str)):
            raise ValueError(f"write_events: event {i} is {ev!r}; each event must be a (name: str, value, step) "
                             f"3-tuple, e.g. ('Train/loss', 0.5, engine.global_samples).")
    return events


def _scalar(value) -> float:
    return value.item() if hasattr(value, "item") else float(value)


class Monitor(ABC):
    """A metrics backend: ``write_events([(name, value, step), ...])``."""

    def __init__(self, monitor_config):
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: Sequence[Event]) -> None:
        ...

    def flush(self) -> None:  # backends that buffer override this
        pass

    def close(self) -> None:
        self.flush()
