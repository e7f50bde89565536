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
