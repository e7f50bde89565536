"""``DataAnalyzer``: offline map-reduce over a dataset that produces the difficulty index
files curriculum data sampling reads.

Map (:meth:`DataAnalyzer.run_map`): the dataset is split into ``num_workers`` contiguous
parts (one per node or launch; this process is ``worker_id``), each into ``num_threads``
parts run in separate processes. Each part computes every metric on its samples, in
batches of ``batch_size``, and writes under ``save_path/<metric>/worker<W>_thread<T>/``;
a ``done`` marker written last makes the map resumable: a rerun skips finished parts.

Reduce (:meth:`DataAnalyzer.run_reduce`, on worker 0 once every part is done) writes,
for a ``single_value_per_sample`` metric, in ``save_path/<metric>/``:

* ``<metric>_sample_to_metric``: item ``i`` = the metric value of sample ``i``;
* ``<metric>_index_to_metric``: one item per distinct value, ascending;
* ``<metric>_index_to_sample``: item ``j`` = the (ascending) sample indices whose value
  is item ``j`` of ``index_to_metric`` (the files the config's ``index_to_sample_path`` /
  ``index_to_metric_path`` name);
* ``<metric>_index_to_sample_percentile_merged``: ``index_to_sample`` merged into about
  100 items, for percentile-based curricula;

and for an ``accumulate_value_over_samples`` metric ``<metric>_metric_value`` (the sum
over all samples). Files are DeepSpeed's MMIDIDX format (``indexed_dataset``).
"""
from __future__ import annotations

import os
from multiprocessing import get_context

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

from ....utils.logging import logger
from .indexed_dataset import MMapIndexedDataset, valid_dtypes
from .utils import close_mmap_dataset_builder, create_mmap_dataset_builder, find_fit_int_dtype, split_dataset

METRIC_TYPES = ("single_value_per_sample", "accumulate_value_over_samples")
_DONE = "done"


class DataAnalyzer:

    def __init__(self, dataset, num_workers=1, worker_id=0, num_threads=1, num_threads_reduce=1,
                 specific_threads=(), batch_size=1, metric_names=(), metric_functions=(), metric_types=(),
                 metric_dtypes=(), save_path="./", collate_fn=None, custom_map_init=None, custom_map_update=None,
                 custom_map_finalize=None, custom_reduce=None, sample_indices=None):
        n = len(metric_names)
        if not n or not (len(metric_functions) == len(metric_types) == len(metric_dtypes) == n):
            raise ValueError(f"DataAnalyzer: metric_names, metric_functions, metric_types and metric_dtypes need "
                             f"one entry per metric (got {len(metric_names)}, {len(metric_functions)}, "
                             f"{len(metric_types)}, {len(metric_dtypes)}).")
        for name, mtype, dt in zip(metric_names, metric_types, metric_dtypes):
            if mtype not in METRIC_TYPES:
                raise ValueError(f"DataAnalyzer: metric '{name}' has metric_type {mtype!r}; valid: {list(METRIC_TYPES)}.")
            if dt not in valid_dtypes:
                raise ValueError(f"DataAnalyzer: metric '{name}' has metric_dtype {dt}; valid: integer dtypes "
                                 f"{sorted(map(str, valid_dtypes))}.")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"DataAnalyzer: worker_id {worker_id} is outside 0..{num_workers - 1}.")
        self.dataset = dataset
        self.num_workers, self.worker_id = num_workers, worker_id
        self.num_threads, self.num_threads_reduce = num_threads, num_threads_reduce
        self.specific_threads = list(specific_threads)
        self.batch_size = batch_size
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.metric_dtypes = list(metric_types), list(metric_dtypes)
        self.save_path = save_path
        self.collate_fn = collate_fn
        self.custom_map_init, self.custom_map_update = custom_map_init, custom_map_update
        self.custom_map_finalize, self.custom_reduce = custom_map_finalize, custom_reduce
        self.sample_indices = sample_indices

    # ------------------------------------------------------------------ map
    def _part_dir(self, metric: str, worker: int, thread: int) -> str:
        return os.path.join(self.save_path, metric, f"worker{worker}_thread{thread}")

    def _part_done(self, worker: int, thread: int) -> bool:
        return all(os.path.isfile(os.path.join(self._part_dir(m, worker, thread), _DONE)) for m in self.metric_names)

    def _metric_values(self, m_idx: int, data) -> torch.Tensor:
        values = self.metric_functions[m_idx](data)
        if isinstance(values, np.ndarray):
            values = torch.from_numpy(values)
        if not torch.is_tensor(values):
            raise TypeError(f"DataAnalyzer: metric_function of '{self.metric_names[m_idx]}' must return a tensor "
                            f"or numpy array, got {type(values).__name__}.")
        want = self.metric_dtypes[m_idx]
        if values.dtype != want and not (not isinstance(want, torch.dtype) and values.numpy().dtype == np.dtype(want)):
            raise TypeError(f"DataAnalyzer: metric_function of '{self.metric_names[m_idx]}' returned {values.dtype}, "
                            f"but metric_dtypes says {want}.")
        return values

    def run_map_helper(self, thread_id: int) -> None:
        start, end = self.thread_splits[thread_id]
        part = Subset(self.dataset, list(range(start, end)))
        loader = DataLoader(part, batch_sampler=BatchSampler(SequentialSampler(part), self.batch_size, False),
                            num_workers=0, collate_fn=self.collate_fn)
        singles = {m: ([], []) for m, t in zip(self.metric_names, self.metric_types) if t == METRIC_TYPES[0]}
        sums = {m: None for m, t in zip(self.metric_names, self.metric_types) if t == METRIC_TYPES[1]}
        processed = 0
        for data in loader:
            nb = None
            for m_idx, name in enumerate(self.metric_names):
                values = self._metric_values(m_idx, data)
                if name in singles:
                    nb = values.shape[0]
                    ids = np.arange(start + processed, start + processed + values.shape[0])
                    if isinstance(data, dict) and "index" in data:  # Megatron: the dataset names its samples
                        ids = np.asarray(data["index"]).reshape(values.shape[0], -1)[:, 0]
                    elif self.sample_indices is not None:
                        ids = np.asarray(self.sample_indices)[ids]
                    singles[name][0].append(ids.astype(np.int64))
                    singles[name][1].append(values.reshape(values.shape[0], -1)[:, 0].numpy().astype(np.int64))
                else:
                    sums[name] = values.clone() if sums[name] is None else sums[name] + values
            processed += nb if singles and nb is not None else self.batch_size
        for name in self.metric_names:
            out = self._part_dir(name, self.worker_id, thread_id)
            os.makedirs(out, exist_ok=True)
            if name in singles:
                ids, vals = singles[name]
                ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
                vals = np.concatenate(vals) if vals else np.zeros(0, dtype=np.int64)
                for suffix, arr in (("sample_index", ids), ("sample_to_metric", vals)):
                    b = create_mmap_dataset_builder(os.path.join(out, f"{name}_{suffix}"), np.int64)
                    b.add_item(arr)
                    close_mmap_dataset_builder(b, os.path.join(out, f"{name}_{suffix}"))
            elif sums[name] is not None:
                b = create_mmap_dataset_builder(os.path.join(out, f"{name}_metric_value"), np.int64)
                b.add_item(sums[name].reshape(-1).to(torch.int64))
                close_mmap_dataset_builder(b, os.path.join(out, f"{name}_metric_value"))
            with open(os.path.join(out, _DONE), "w") as f:  # last: marks this part resumable-complete
                f.write(f"{end - start}\n")
        logger.info(f"DataAnalyzer worker {self.worker_id} thread {thread_id}: samples {start}..{end} done")

    def run_map(self) -> None:
        self.worker_splits, self.thread_splits = split_dataset(self.dataset, self.num_workers, self.worker_id,
                                                               self.num_threads)
        threads = self.specific_threads or list(range(self.num_threads))
        todo = [t for t in threads if not self._part_done(self.worker_id, t)]
        if len(todo) < len(threads):
            logger.info(f"DataAnalyzer: resuming; parts {sorted(set(threads) - set(todo))} are already done")
        if self.num_threads > 1 and len(todo) > 0:
            ctx = get_context("fork") if os.name == "posix" else get_context()
            procs = [ctx.Process(target=self.run_map_helper, args=(t,)) for t in todo]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            failed = [t for t, p in zip(todo, procs) if p.exitcode != 0]
            if failed:
                raise RuntimeError(f"DataAnalyzer: map threads {failed} of worker {self.worker_id} failed; rerun "
                                   f"run_map() to redo only the unfinished parts.")
        else:
            for t in todo:
                self.run_map_helper(t)

    # ------------------------------------------------------------------ reduce
    def run_reduce(self) -> None:
        if self.custom_reduce is not None:
            self.custom_reduce(self.dataset, self.metric_names, self.metric_types, self.save_path,
                               self.num_workers, self.num_threads, self.num_threads_reduce)
            return
        missing = [(w, t) for w in range(self.num_workers) for t in range(self.num_threads)
                   if not self._part_done(w, t)]
        if missing:
            raise RuntimeError(f"DataAnalyzer.run_reduce: map parts (worker, thread) {missing} have not finished; "
                               f"run run_map() on those workers first.")
        n = len(self.dataset)
        for name, mtype in zip(self.metric_names, self.metric_types):
            mdir = os.path.join(self.save_path, name)
            parts = [self._part_dir(name, w, t) for w in range(self.num_workers) for t in range(self.num_threads)]
            if mtype == METRIC_TYPES[1]:
                total = None
                for p in parts:
                    f = os.path.join(p, f"{name}_metric_value")
                    if MMapIndexedDataset.exists(f):
                        v = np.array(MMapIndexedDataset(f)[0], dtype=np.int64)
                        total = v if total is None else total + v
                dt = find_fit_int_dtype(int(total.min()), int(total.max()))
                self._write(os.path.join(mdir, f"{name}_metric_value"), dt, [total])
                continue
            ids = np.concatenate([np.array(MMapIndexedDataset(os.path.join(p, f"{name}_sample_index"))[0])
                                  for p in parts])
            vals = np.concatenate([np.array(MMapIndexedDataset(os.path.join(p, f"{name}_sample_to_metric"))[0])
                                   for p in parts])
            if len(ids) != n or len(np.unique(ids)) != n:
                raise RuntimeError(f"DataAnalyzer.run_reduce: metric '{name}' covers {len(np.unique(ids))} distinct "
                                   f"samples of {n}; some map part is incomplete or overlaps another.")
            sample_dt = find_fit_int_dtype(0, n - 1)
            value_dt = find_fit_int_dtype(int(vals.min()), int(vals.max()))
            by_sample = np.empty(n, dtype=np.int64)
            by_sample[ids] = vals
            self._write(os.path.join(mdir, f"{name}_sample_to_metric"), value_dt, [[v] for v in by_sample])
            order = np.lexsort((ids, vals))  # by value, then sample index
            uniq, starts = np.unique(vals[order], return_index=True)
            groups = np.split(ids[order], starts[1:])
            self._write(os.path.join(mdir, f"{name}_index_to_sample"), sample_dt, groups)
            self._write(os.path.join(mdir, f"{name}_index_to_metric"), value_dt, [[v] for v in uniq])
            step = max(1, len(groups) // 100)
            merged = [np.concatenate(groups[i:i + step]) for i in range(0, len(groups), step)]
            self._write(os.path.join(mdir, f"{name}_index_to_sample_percentile_merged"), sample_dt, merged)
            logger.info(f"DataAnalyzer: metric '{name}': {len(uniq)} distinct values in [{uniq[0]}, {uniq[-1]}] "
                        f"over {n} samples")

    @staticmethod
    def _write(prefix: str, dtype, items) -> None:
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        b = create_mmap_dataset_builder(prefix, dtype)
        for it in items:
            b.add_item(np.asarray(it))
        close_mmap_dataset_builder(b, prefix)

    def run_map_reduce(self, comm_group=None) -> None:
        """Map this worker's part, wait for every worker, reduce on worker 0, wait again."""
        import torch.distributed as dist
        self.run_map()
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=comm_group)
