"""Data-/model-parallel group queries, taken from an ``mpu`` when one is given."""
from __future__ import annotations

import torch.distributed as dist

_MPU = None


def set_mpu(mpu) -> None:
    global _MPU
    _MPU = mpu


def get_mpu():
    return _MPU


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_data_parallel_group(mpu=None):
    mpu = mpu or _MPU
    if mpu is not None:
        return mpu.get_data_parallel_group()
    return dist.group.WORLD if _initialized() else None


def get_data_parallel_world_size(mpu=None) -> int:
    mpu = mpu or _MPU
    if mpu is not None:
        return mpu.get_data_parallel_world_size()
    return dist.get_world_size() if _initialized() else 1


def get_data_parallel_rank(mpu=None) -> int:
    mpu = mpu or _MPU
    if mpu is not None:
        return mpu.get_data_parallel_rank()
    return dist.get_rank() if _initialized() else 0


def get_model_parallel_group(mpu=None):
    mpu = mpu or _MPU
    return mpu.get_model_parallel_group() if mpu is not None else None


def get_model_parallel_world_size(mpu=None) -> int:
    mpu = mpu or _MPU
    return mpu.get_model_parallel_world_size() if mpu is not None else 1


def get_model_parallel_rank(mpu=None) -> int:
    mpu = mpu or _MPU
    return mpu.get_model_parallel_rank() if mpu is not None else 0


# DeepSpeed's underscore spellings
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_model_parallel_group = get_model_parallel_group
_get_model_parallel_world_size = get_model_parallel_world_size
_get_model_parallel_rank = get_model_parallel_rank
