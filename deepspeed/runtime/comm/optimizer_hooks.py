"""The small protocol between training strategies and optimizers that do their own
gradient communication (the 1-bit optimizers of ``runtime/fp16/onebit``).

Strategies call these with whatever optimizer they step; for every other optimizer they
are no-ops, so generic code never imports the optimizers themselves.
"""
from __future__ import annotations

RANK_STATE_FILE = "onebit_dp_rank_{dp}_mp_rank_{mp:02d}_states.pt"


def gradient_allreduce_needed(optimizer) -> bool:
    """False while ``optimizer`` averages (compressed) in its own ``step()``: the strategy
    then leaves the gradients local for this accumulation window."""
    return bool(getattr(optimizer, "gradient_allreduce_needed", True))


def save_rank_local_state(optimizer, writer, dp_rank: int, mp_rank: int) -> None:
    """Every rank writes the state that differs between ranks (error feedback buffers)."""
    fn = getattr(optimizer, "rank_local_state_dict", None)
    if fn is not None:
        writer.save(RANK_STATE_FILE.format(dp=dp_rank, mp=mp_rank), fn())


def load_rank_local_state(optimizer, reader, dp_rank: int, mp_rank: int) -> None:
    fn = getattr(optimizer, "load_rank_local_state_dict", None)
    if fn is None:
        return
    name = RANK_STATE_FILE.format(dp=dp_rank, mp=mp_rank)
    if not reader.exists(name):  # e.g. more ranks now than saved: rank 0's counters, no errors
        name = RANK_STATE_FILE.format(dp=0, mp=mp_rank)
    fn(reader.load(name) if reader.exists(name) else None, where=f" (checkpoint '{reader.path}')")
