"""``MpiBackend``: the compressed all-reduce with its two collectives carried by MPI
(``mpi4py``) on host buffers, as DeepSpeed's ``comm_backend_name: "mpi"``.

Importing this module needs ``mpi4py`` (and an MPI library); without it the import fails
with an ImportError that says so and names the alternative. The ranks are those of
``MPI.COMM_WORLD``, which must be the same processes as the torch.distributed world.
``cuda_aware`` is accepted for DeepSpeed's signature; buffers always go through host
memory here.
"""
from __future__ import annotations

from collections import Counter

try:
    from mpi4py import MPI
except ImportError as _err:  # pragma: no cover - depends on the machine
    raise ImportError(
        "deepspeed.runtime.comm.mpi needs mpi4py (pip install mpi4py, with an MPI library installed); "
        f"it is not available here ({_err}). Set optimizer.params.comm_backend_name to 'compressed' "
        "(any torch.distributed backend, gloo included) or 'nccl' instead.") from None

import numpy as np
import torch

from .compressed import CompressedBackend, wire_bytes


class MpiBackend(CompressedBackend):
    name = "mpi"

    def __init__(self, cuda_aware: bool = False):  # noqa: D401 - DeepSpeed's signature
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.cuda_aware = cuda_aware
        self.world_group = None
        self.calls = Counter()
        self.bytes_sent = 0.0

    def _count(self, op, t):
        self.calls[op] += 1
        self.bytes_sent += wire_bytes(op, t.numel() * t.element_size(), self.size)

    def _all_to_all(self, out, inp):
        self._count("all_to_all", inp)
        recv = np.empty(out.numel(), dtype=np.uint8)
        self.comm.Alltoall(np.ascontiguousarray(inp.cpu().numpy().reshape(-1)), recv)
        out.copy_(torch.from_numpy(recv).reshape(out.shape))

    def _all_gather(self, out, inp):
        self._count("all_gather", inp)
        src = np.ascontiguousarray(inp.detach().cpu().numpy().reshape(-1))
        recv = np.empty(out.numel(), dtype=src.dtype)
        self.comm.Allgather(src, recv)
        out.copy_(torch.from_numpy(recv).reshape(out.shape))
