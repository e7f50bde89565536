"""Which old (pipeline, tensor)-parallel ranks feed each new one when a Megatron-style
checkpoint is shrunk (DeepSpeed's ``deepspeed.checkpoint.reshape_meg_2d`` names).

Old ranks are numbered ``pp_index * tp_degree + tp_index``. Shrinking a degree from ``old`` to
``new`` (``old`` a multiple of ``new``) gives new index ``i`` the contiguous old indices
``[i * old/new, (i + 1) * old/new)``; a new (pp, tp) cell lists its old ranks pipeline-major."""
from __future__ import annotations

from .reshape_utils import partition_data


class meg_2d_parallel_map:  # noqa: N801 - DeepSpeed's class name
    """(pp_index, tp_index) -> list of old ranks."""

    def __init__(self, pp_degree, tp_degree):
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.map = {}

    def simple_init(self):
        """Each cell holds its own rank (the identity map)."""
        self.map = {(i // self.tp_degree, i % self.tp_degree): [i] for i in range(self.pp_degree * self.tp_degree)}

    def _check(self, pp_index, tp_index):
        if pp_index is not None and not 0 <= pp_index < self.pp_degree:
            raise IndexError(f"pp_index {pp_index} is outside 0..{self.pp_degree - 1}")
        if tp_index is not None and not 0 <= tp_index < self.tp_degree:
            raise IndexError(f"tp_index {tp_index} is outside 0..{self.tp_degree - 1}")

    def add_data(self, pp_index, tp_index, data):
        self._check(pp_index, tp_index)
        if not isinstance(data, list):
            raise TypeError(f"add_data: data must be a list, got {type(data).__name__}")
        self.map.setdefault((pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index=None, tp_index=None) -> list:
        """The ranks of one cell, or of a whole row/column/map when an index is None."""
        self._check(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [r for i in pps for j in tps for r in self.map.get((i, j), [])]

    def print_data(self, tag):
        print(tag)
        for key, value in sorted(self.map.items()):
            print(f"{key} = {value}")


def reshape_meg_2d_parallel(old_pp_degree, old_tp_degree, new_pp_degree, new_tp_degree, verbose=False):
    """The new (pp, tp) map whose cells list the old ranks that merge into them."""
    if new_pp_degree > old_pp_degree or new_tp_degree > old_tp_degree:
        raise ValueError(f"reshape_meg_2d_parallel: only shrinking is supported, got pp {old_pp_degree} -> "
                         f"{new_pp_degree}, tp {old_tp_degree} -> {new_tp_degree}")
    pp_groups = partition_data(list(range(old_pp_degree)), new_pp_degree)
    tp_groups = partition_data(list(range(old_tp_degree)), new_tp_degree)
    out = meg_2d_parallel_map(new_pp_degree, new_tp_degree)
    for i, pps in enumerate(pp_groups):
        for j, tps in enumerate(tp_groups):
            out.add_data(i, j, [p * old_tp_degree + t for p in pps for t in tps])
    if verbose:
        out.print_data(f"reshape pp {old_pp_degree}->{new_pp_degree}, tp {old_tp_degree}->{new_tp_degree}")
    return out
