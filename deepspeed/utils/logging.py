"""``deepspeed.utils.logger`` and rank-aware logging helpers."""
from __future__ import annotations

import logging
import os
import sys

_FMT = "[%(asctime)s] [%(levelname)s] [deepspeed] %(message)s"


def _make_logger() -> logging.Logger:
    lg = logging.getLogger("DeepSpeed")
    if not lg.handlers:
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter(_FMT))
        lg.addHandler(h)
    lg.setLevel(os.environ.get("DEEPSPEED_LOG_LEVEL", "INFO").upper())
    lg.propagate = False
    return lg


logger = _make_logger()


def _rank() -> int:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (ImportError, RuntimeError):  # logging must never raise: fall back to the env rank
        pass
    return int(os.environ.get("RANK", "0"))


def log_dist(message: str, ranks=None, level=logging.INFO) -> None:
    """Log on the given ranks only (default: rank 0; [-1] means every rank)."""
    ranks = [0] if ranks is None else ranks
    r = _rank()
    if -1 in ranks or r in ranks:
        logger.log(level, f"[Rank {r}] {message}")


def print_rank_0(message: str) -> None:
    if _rank() == 0:
        print(message, flush=True)


#: DeepSpeed's level names (``set_log_level_from_string``)
log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


def get_log_level_from_string(log_level_str: str) -> int:
    """``"info"`` -> ``logging.INFO`` (any case); ValueError naming the valid names otherwise."""
    level = log_levels.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"{log_level_str!r} is not a log level; valid: {', '.join(log_levels)}.")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """Set ``custom_logger`` (default: the DeepSpeed logger) and its handlers to the level named."""
    level = get_log_level_from_string(log_level_str)
    lg = logger if custom_logger is None else custom_logger
    lg.setLevel(level)
    for h in lg.handlers:
        h.setLevel(level)


def get_current_level() -> int:
    """The DeepSpeed logger's effective level."""
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """True when the current level is at or below the level named (``should_log_le("info")``
    is True at INFO and DEBUG)."""
    return get_current_level() <= get_log_level_from_string(max_log_level_str)
