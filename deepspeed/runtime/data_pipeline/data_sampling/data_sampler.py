"""``DeepSpeedDataSampler``: batches whose difficulty follows a curriculum schedule.

Each metric in ``data_efficiency.data_sampling.curriculum_learning.curriculum_metrics``
has a :class:`~deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler`
and, unless its ``clustering_type`` is ``single_cluster``, the index files the
``DataAnalyzer`` wrote (``index_to_sample_path``: one item per difficulty row, the sample
indices in it; ``index_to_metric_path``: each row's metric value).

Per global batch (``micro_batch * data_parallel_size * gradient_accumulation_steps``
samples) the curriculum step advances by one and each metric's difficulty is updated.
When a difficulty changes, the samples that became admissible form a new *cluster*:

* ``difficulty_type: value``: samples whose metric value lies in ``(previous, current]``;
* ``difficulty_type: percentile``: the samples from the ``previous``-th to the ``current``-th
  percentile of the metric (``max_difficulty`` is 100 percent);
* with several clustered metrics, the samples admissible under every metric, less those
  already in a cluster;
* ``single_cluster`` metrics admit every sample (their difficulty is for the model or a
  data post-process function, e.g. truncating sequences to ``current_difficulties[metric]``).

The batch draws from the clusters in proportion to their sizes (each cluster is read in
a shuffled order and reshuffled when exhausted), so only samples within the scheduled
difficulty are ever served. Every rank computes the same global batch from the same seed
(``data_efficiency.seed``) and serves its own slice of each micro-batch, so ranks agree
without communication. :meth:`state_dict` holds everything needed to continue at the exact
next sample: position, remaining batch, clusters, difficulties and the generator state.

Clusters live in memory (and in the checkpoint) rather than in files under
``data_cluster_path``, which is created but only used for index files written there.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ....utils.logging import logger
from ..constants import (CURRICULUM_LEARNING_BATCH, CURRICULUM_LEARNING_CONSUMED_SAMPLES,
                         CURRICULUM_LEARNING_CURRENT_DIFFICULTIES, CURRICULUM_LEARNING_DATA_CLUSTER_CURRENT_POSITION,
                         CURRICULUM_LEARNING_NP_RNG_STATE, CURRICULUM_LEARNING_PERCENTILE_BASED,
                         CURRICULUM_LEARNING_SINGLE_CLUSTER, CURRICULUM_LEARNING_STEP,
                         CURRICULUM_LEARNING_VALUE_BASED)
from ..curriculum_scheduler import CurriculumScheduler
from .indexed_dataset import MMapIndexedDataset

CLUSTERS_KEY = "data_clusters"


def _as_dict(cfg):
    return cfg.model_dump() if hasattr(cfg, "model_dump") else dict(cfg)


class DeepSpeedDataSampler:
    """A batch sampler: iterating yields this rank's micro-batches of dataset indices."""

    def __init__(self, data_efficiency_config, one_epoch_total_samples, micro_batch_size, data_parallel_rank,
                 data_parallel_size, data_parallel_group=None, gradient_accumulation_steps=1, global_rank=0,
                 drop_last=True):
        cfg = _as_dict(data_efficiency_config)
        sampling = _as_dict(cfg.get("data_sampling", {}))
        cl = _as_dict(sampling.get("curriculum_learning", {}))
        if one_epoch_total_samples <= 0 or micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"DeepSpeedDataSampler: need a non-empty dataset and positive batch sizes (samples "
                             f"{one_epoch_total_samples}, micro batch {micro_batch_size}, dp {data_parallel_size}).")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"DeepSpeedDataSampler: data_parallel_rank {data_parallel_rank} is outside "
                             f"0..{data_parallel_size - 1}.")
        self.data_efficiency_config = cfg
        self.one_epoch_total_samples = int(one_epoch_total_samples)
        self.total_samples = self.one_epoch_total_samples * int(sampling.get("num_epochs", 1000))
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size
        self.data_parallel_group = data_parallel_group
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.global_rank = global_rank
        self.drop_last = drop_last
        self.np_rng = np.random.default_rng(cfg.get("seed", 1234))
        self.batch = []
        self.consumed_samples = 0
        self.curriculum_enabled = bool(cl.get("enabled"))
        self.curriculum_step = 0
        self.current_difficulties = {}
        self.curriculum_schedulers, self.difficulty_type, self.clustering_type = {}, {}, {}
        self.index_to_sample, self.index_to_metric, self.max_difficulty = {}, {}, {}
        self.data_clusters, self.data_cluster_current_position = [], []
        where = "data_efficiency.data_sampling.curriculum_learning"
        if self.curriculum_enabled:
            path = cl.get("data_cluster_path")
            if path:
                os.makedirs(path, exist_ok=True)
            for metric, mcfg in (cl.get("curriculum_metrics") or {}).items():
                mcfg = _as_dict(mcfg)
                mwhere = f"{where}.curriculum_metrics.{metric}"
                self.curriculum_schedulers[metric] = CurriculumScheduler(mcfg, where=mwhere)
                self.difficulty_type[metric] = mcfg.get("difficulty_type")
                self.clustering_type[metric] = mcfg.get("clustering_type")
                self.max_difficulty[metric] = mcfg["max_difficulty"]
                if self.clustering_type[metric] == CURRICULUM_LEARNING_SINGLE_CLUSTER:
                    continue
                keys = ["index_to_sample_path"]
                if self.difficulty_type[metric] == CURRICULUM_LEARNING_VALUE_BASED:
                    keys.append("index_to_metric_path")
                for key in keys:
                    p = mcfg.get(key)
                    if not p or not MMapIndexedDataset.exists(p):
                        raise FileNotFoundError(
                            f"{mwhere}.{key}: {p!r} has no index files ('{p}.idx' and '{p}.bin'); run the "
                            f"DataAnalyzer first and point this key at its output (a path without extension).")
                self.index_to_sample[metric] = MMapIndexedDataset(mcfg["index_to_sample_path"])
                if self.difficulty_type[metric] == CURRICULUM_LEARNING_VALUE_BASED:
                    self.index_to_metric[metric] = MMapIndexedDataset(mcfg["index_to_metric_path"])
                    if len(self.index_to_metric[metric]) != len(self.index_to_sample[metric]):
                        raise ValueError(f"{mwhere}: index_to_sample has {len(self.index_to_sample[metric])} rows "
                                         f"but index_to_metric {len(self.index_to_metric[metric])}.")

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        return self.total_samples

    def num_micro_batches(self) -> int:
        """How many micro-batches this rank will yield."""
        full, rest = divmod(self.total_samples, self.micro_batch_times_data_parallel_size)
        return full + (1 if rest and not self.drop_last else 0)

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict) -> bool:
        used = False
        for metric, sched in self.curriculum_schedulers.items():
            if metric in schedule_func_dict:
                sched.set_custom_get_difficulty(schedule_func_dict[metric])
                used = True
        return used

    def get_start_end_idx(self, batch_len=None):
        batch_len = batch_len or self.micro_batch_times_data_parallel_size
        start = round(self.data_parallel_rank * batch_len / self.data_parallel_size)
        end = round((self.data_parallel_rank + 1) * batch_len / self.data_parallel_size)
        return start, end

    # ------------------------------------------------------------------ clusters
    def get_sample_based_on_metric_value(self, metric, value_start, value_end) -> np.ndarray:
        values = np.array([int(self.index_to_metric[metric][r][0]) for r in range(len(self.index_to_metric[metric]))])
        rows = np.nonzero((values > value_start) & (values <= value_end))[0]
        parts = [np.asarray(self.index_to_sample[metric][int(r)], dtype=np.int64) for r in rows]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def get_sample_based_on_metric_percentile(self, metric, percentile_start, percentile_end) -> np.ndarray:
        rows = self.index_to_sample[metric]
        flat = np.concatenate([np.asarray(rows[r], dtype=np.int64) for r in range(len(rows))])
        # the p-th percentile ends after len * p / max_difficulty samples (rounded down)
        top = self.max_difficulty[metric]
        start = len(flat) * max(0, int(percentile_start)) // top
        end = len(flat) if percentile_end >= top else len(flat) * int(percentile_end) // top
        return flat[start:end]

    def _admissible(self, metric, lo, hi) -> np.ndarray:
        if self.difficulty_type[metric] == CURRICULUM_LEARNING_VALUE_BASED:
            return self.get_sample_based_on_metric_value(metric, lo, hi)
        if self.difficulty_type[metric] == CURRICULUM_LEARNING_PERCENTILE_BASED:
            return self.get_sample_based_on_metric_percentile(metric, lo, hi)
        raise ValueError(f"curriculum metric '{metric}': difficulty_type {self.difficulty_type[metric]!r} is not "
                         f"'value' or 'percentile'.")

    def get_new_cluster(self, previous_difficulties) -> None:
        clustered = [m for m in self.curriculum_schedulers if self.clustering_type[m] != CURRICULUM_LEARNING_SINGLE_CLUSTER]
        new = None
        if len(clustered) > 1:
            for m in clustered:
                lo = float("-inf") if self.difficulty_type[m] == CURRICULUM_LEARNING_VALUE_BASED else 0
                cand = self._admissible(m, lo, self.current_difficulties[m])
                new = cand if new is None else np.intersect1d(new, cand, assume_unique=True)
            for c in self.data_clusters:
                new = np.setdiff1d(new, c, assume_unique=True)
        elif clustered:
            m = clustered[0]
            new = self._admissible(m, previous_difficulties[m], self.current_difficulties[m])
        elif not self.data_clusters:
            new = np.arange(self.one_epoch_total_samples, dtype=np.int64)
        if new is not None and len(new) > 0:
            new = np.array(new, dtype=np.int64)
            self.np_rng.shuffle(new)
            self.data_clusters.append(new)
            self.data_cluster_current_position.append(0)
            logger.debug(f"curriculum: difficulties {self.current_difficulties}: new cluster of {len(new)} samples")

    def sample_from_clusters(self) -> np.ndarray:
        sizes = np.array([len(c) for c in self.data_clusters], dtype=np.float64)
        picks = self.np_rng.choice(len(self.data_clusters), self.global_batch_size, replace=True, p=sizes / sizes.sum())
        return np.bincount(picks, minlength=len(self.data_clusters))

    def get_sample_from_cluster(self, cidx, num_samples):
        cluster, out = self.data_clusters[cidx], []
        while num_samples > 0:
            pos = self.data_cluster_current_position[cidx]
            if pos >= len(cluster):  # exhausted: a new order (a new array: saved states keep theirs)
                cluster = self.data_clusters[cidx] = self.np_rng.permutation(cluster)
                pos = 0
            take = cluster[pos:pos + num_samples]
            out.extend(int(x) for x in take)
            self.data_cluster_current_position[cidx] = pos + len(take)
            num_samples -= len(take)
        return out

    def get_next_global_batch(self) -> None:
        if self.curriculum_enabled:
            self.curriculum_step += 1
            changed, previous = False, {}
            for metric, sched in self.curriculum_schedulers.items():
                nxt = sched.update_difficulty(self.curriculum_step)
                if metric not in self.current_difficulties or nxt != self.current_difficulties[metric]:
                    changed = True
                if metric in self.current_difficulties:
                    previous[metric] = self.current_difficulties[metric]
                else:
                    previous[metric] = float("-inf") if self.difficulty_type[metric] == CURRICULUM_LEARNING_VALUE_BASED \
                        else 0
                self.current_difficulties[metric] = nxt
            if changed:
                self.get_new_cluster(previous)
        elif not self.data_clusters:
            self.get_new_cluster({})
        if not self.data_clusters:
            raise RuntimeError(f"curriculum data sampling: no sample is admissible at difficulties "
                               f"{self.current_difficulties}; raise min_difficulty so that the first level holds data.")
        batch = []
        for cidx, count in enumerate(self.sample_from_clusters()):
            batch += self.get_sample_from_cluster(cidx, int(count))
        self.np_rng.shuffle(batch)
        self.batch = batch

    def __iter__(self):
        while self.consumed_samples < self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            current = self.batch[:self.micro_batch_times_data_parallel_size]
            self.batch = self.batch[self.micro_batch_times_data_parallel_size:]
            if len(current) == self.micro_batch_times_data_parallel_size or (current and not self.drop_last):
                start, end = self.get_start_end_idx(len(current))
                self.consumed_samples += len(current)  # before the yield: a checkpoint taken now resumes after it
                yield current[start:end]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            CURRICULUM_LEARNING_BATCH: list(self.batch),
            CURRICULUM_LEARNING_CONSUMED_SAMPLES: self.consumed_samples,
            CURRICULUM_LEARNING_STEP: self.curriculum_step,
            CURRICULUM_LEARNING_CURRENT_DIFFICULTIES: dict(self.current_difficulties),
            CLUSTERS_KEY: [torch.from_numpy(c) for c in self.data_clusters],
            CURRICULUM_LEARNING_DATA_CLUSTER_CURRENT_POSITION: list(self.data_cluster_current_position),
            CURRICULUM_LEARNING_NP_RNG_STATE: self.np_rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        self.batch = list(state[CURRICULUM_LEARNING_BATCH])
        self.consumed_samples = state[CURRICULUM_LEARNING_CONSUMED_SAMPLES]
        self.curriculum_step = state[CURRICULUM_LEARNING_STEP]
        self.current_difficulties = dict(state[CURRICULUM_LEARNING_CURRENT_DIFFICULTIES])
        for metric, d in self.current_difficulties.items():
            if metric in self.curriculum_schedulers:
                self.curriculum_schedulers[metric].set_current_difficulty(d)
        if CLUSTERS_KEY not in state:
            raise ValueError("DeepSpeedDataSampler.load_state_dict: the state has no 'data_clusters' (written by "
                             "DeepSpeed itself, whose clusters live in files); start the curriculum afresh.")
        self.data_clusters = [t.numpy().copy() for t in state[CLUSTERS_KEY]]
        self.data_cluster_current_position = list(state[CURRICULUM_LEARNING_DATA_CLUSTER_CURRENT_POSITION])
        self.np_rng.bit_generator.state = state[CURRICULUM_LEARNING_NP_RNG_STATE]
