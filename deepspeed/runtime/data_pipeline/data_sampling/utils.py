"""Small helpers shared by the data analyzer and the sampler (DeepSpeed's names)."""
from __future__ import annotations

import numpy as np

from .indexed_dataset import MMapIndexedDatasetBuilder


def find_fit_int_dtype(min_value: int, max_value: int):
    """The smallest integer dtype holding ``[min_value, max_value]``."""
    if min_value >= 0:
        for dt in (np.uint8, np.uint16, np.uint32):
            if max_value <= np.iinfo(dt).max:
                return dt
        return np.uint64
    for dt in (np.int8, np.int16, np.int32):
        if np.iinfo(dt).min <= min_value and max_value <= np.iinfo(dt).max:
            return dt
    return np.int64


def split_index(start_idx: int, end_idx: int, num_partitions: int):
    """``num_partitions`` contiguous ``(start, end)`` ranges covering ``[start_idx, end_idx)``."""
    bounds = np.linspace(start_idx, end_idx, num=num_partitions + 1, dtype=int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(num_partitions)]


def split_dataset(dataset, num_workers: int, worker_id: int, num_threads: int):
    worker_splits = split_index(0, len(dataset), num_workers)
    thread_splits = split_index(worker_splits[worker_id][0], worker_splits[worker_id][1], num_threads)
    return worker_splits, thread_splits


def create_mmap_dataset_builder(fname: str, dtype) -> MMapIndexedDatasetBuilder:
    return MMapIndexedDatasetBuilder(f"{fname}.bin", dtype=dtype)


def close_mmap_dataset_builder(builder: MMapIndexedDatasetBuilder, fname: str) -> None:
    builder.end_document()
    builder.finalize(f"{fname}.idx")
