"""Process topologies: which global rank holds which (pipe, data, model) coordinate,
and :class:`PipelineParallelGrid`, which builds the process groups and serves as the
``mpu`` (model-parallel unit) the rest of DeepSpeed queries.

Ranks are laid out row-major over the axes in the order given: with
``axes=['pipe', 'data']`` and ``dims=[2, 2]`` the ranks are pipe 0 = {0, 1},
pipe 1 = {2, 3}, and data-parallel peers differ by 1.
"""
from __future__ import annotations

from collections import namedtuple
from itertools import product
from typing import Dict, List

import torch.distributed as dist


class ProcessTopology:
    """Maps n-dimensional coordinates (named axes) to linear ranks, row-major."""

    def __init__(self, axes: List[str], dims: List[int]):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}.")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be unique, got {axes}.")
        if any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {dims}.")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self.mapping: Dict[tuple, int] = {}
        for rank, coord in enumerate(product(*[range(d) for d in dims])):
            self.mapping[self.ProcessCoord(*coord)] = rank
        self._coords = {r: c for c, r in self.mapping.items()}

    def get_rank(self, **coord_kwargs) -> int:
        if sorted(coord_kwargs) != sorted(self.axes):
            raise ValueError(f"get_rank needs exactly the axes {self.axes}, got {sorted(coord_kwargs)}.")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank: coordinate {coord_kwargs} is outside dims {dict(zip(self.axes, self.dims))}.")
        return self.mapping[key]

    def get_axis_names(self) -> List[str]:
        return list(self.axes)

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-") -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omit_axes)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        if rank not in self._coords:
            raise ValueError(f"get_coord: rank {rank} is not in this topology of {self.world_size()} ranks.")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> List[List[int]]:
        """Lists of ranks that differ only in ``axis`` (one list per communicator)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for coord in product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, coord))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs) -> List[int]:
        """Ranks whose coordinate matches every ``axis=value`` given."""
        bad = [a for a in filter_kwargs if a not in self.axes]
        if bad:
            raise ValueError(f"filter_match: unknown axes {bad}; this topology has {self.axes}.")
        return sorted(r for c, r in self.mapping.items()
                      if all(getattr(c, a) == v for a, v in filter_kwargs.items()))

    def get_axis_list(self, axis: str, idx: int) -> List[int]:
        """Ranks whose coordinate on ``axis`` is ``idx``."""
        if axis not in self.axes:
            return []
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self):
        return str(self.mapping)


def _prime_factors(n: int) -> List[int]:
    """The prime factors of a positive integer, smallest first, with multiplicity
    (``12 -> [2, 2, 3]``, ``1 -> []``); DeepSpeed's helper name."""
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"_prime_factors: expected a positive integer, got {n!r}")
    out, d = [], 2
    while d * d <= n:
        while n % d == 0:
            out.append(d)
            n //= d
        d += 1
    if n > 1:
        out.append(n)
    return out


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism; data-parallel peers are adjacent ranks."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism (Megatron-style 3D)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _new_groups(lists: List[List[int]], me: int):
    """Create one group per list (every rank calls this with the same lists, in order);
    return (the group containing ``me``, its rank list)."""
    mine = (None, None)
    for ranks in lists:
        g = dist.new_group(ranks=ranks) if dist.get_world_size() > 1 else dist.group.WORLD
        if me in ranks:
            mine = (g, ranks)
    return mine


class PipelineParallelGrid:
    """Process groups of a topology, and the ``mpu`` interface over them.

    ``get_data_parallel_*`` is the ``data`` axis, ``get_pipe_parallel_*`` the ``pipe`` axis,
    ``get_model_parallel_*`` / ``get_tensor_model_parallel_*`` / ``get_slice_parallel_*``
    the ``model`` (tensor-slicing) axis. Every rank must construct the grid (group
    creation is collective).
    """

    def __init__(self, topology: ProcessTopology = None, process_group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("PipelineParallelGrid needs torch.distributed initialised: call "
                               "deepspeed.init_distributed() before building a PipelineModule.")
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if topology is None:
            topology = PipeDataParallelTopology(num_pp=1, num_dp=self.world_size)
        if topology.world_size() != self.world_size:
            raise ValueError(f"The pipeline topology {dict(zip(topology.axes, topology.dims))} covers "
                             f"{topology.world_size()} ranks but the job has {self.world_size}.")
        self._topo = topology
        coord = topology.get_coord(self.global_rank)
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.model_parallel_id = getattr(coord, "model", 0)

        me = self.global_rank
        self.dp_group, self.dp_ranks = self._axis_group("data", me)
        self.pp_group, self.pp_ranks = self._axis_group("pipe", me)
        self.mp_group, self.mp_ranks = self._axis_group("model", me)
        # all ranks sharing this data-parallel coordinate: the whole model (pipe x model)
        slices = [topology.filter_match(data=d) for d in range(self.data_parallel_size)] \
            if "data" in topology.axes else [list(range(self.world_size))]
        self.slice_group, self.slice_ranks = _new_groups(slices, me)

    def _axis_group(self, axis, me):
        lists = self._topo.get_axis_comm_lists(axis)
        if not lists:
            return _new_groups([[r] for r in range(self.world_size)], me)
        return _new_groups(lists, me)

    # -- topology queries --------------------------------------------------------------
    def topology(self) -> ProcessTopology:
        return self._topo

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe_parallel_size - 1

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """Global rank of ``stage_id`` with this rank's other coordinates (override by kwargs)."""
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(kwargs)
        coord["pipe"] = stage_id
        return self._topo.get_rank(**coord)

    # -- the mpu interface ---------------------------------------------------------------
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.pp_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        return self.model_parallel_id

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self):
        return self.mp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group


class StageMpu:
    """The ``mpu`` the engine hands to the ZeRO strategy of one pipeline stage.

    Data parallelism is the grid's ``data`` axis. For the global gradient norm and the
    fp16 overflow flag the "model-parallel" group is every rank holding a part of one
    model replica (all stages x all tensor slices), so sums run across stages; the rank
    within it is the tensor-slice rank, so parameters replicated across tensor slices are
    counted once (tensor-split ones are marked ``model_parallel``), while the disjoint
    parameters of different stages all count.
    """

    def __init__(self, grid: PipelineParallelGrid):
        self.grid = grid

    def get_data_parallel_group(self):
        return self.grid.dp_group

    def get_data_parallel_world_size(self):
        return self.grid.data_parallel_size

    def get_data_parallel_rank(self):
        return self.grid.data_parallel_id

    def get_model_parallel_group(self):
        return self.grid.slice_group

    def get_model_parallel_world_size(self):
        return len(self.grid.slice_ranks)

    def get_model_parallel_rank(self):
        return self.grid.model_parallel_id

    def __getattr__(self, name):
        return getattr(self.grid, name)
