"""``NcclBackend``: DeepSpeed's name for the compressed all-reduce over an NCCL group.

The algorithm is :class:`deepspeed.runtime.comm.compressed.CompressedBackend` (no cupy:
packing is torch). This class only insists that the group really runs NCCL, so that
``comm_backend_name: "nccl"`` means what it says; ``"compressed"`` serves any group.
"""
from __future__ import annotations

import torch.distributed as dist

from ...config.errors import DeepSpeedConfigError
from .compressed import CompressedBackend


class NcclBackend(CompressedBackend):
    name = "nccl"

    def _check_group(self) -> None:
        backend = dist.get_backend(self.world_group)
        if "nccl" not in str(backend).lower():
            raise DeepSpeedConfigError(
                f"optimizer.params.comm_backend_name 'nccl': the data-parallel process group runs "
                f"'{backend}', not NCCL. Use 'compressed' (the same 1-bit all-reduce over any "
                f"torch.distributed backend, gloo included) or leave comm_backend_name unset.")
