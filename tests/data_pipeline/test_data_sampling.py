"""Offline analysis and curriculum data sampling: index files against a brute-force sort,
served difficulty within the schedule, ranks agreeing, exact resume."""
import os

import numpy as np
import pytest
import torch

from deepspeed.runtime.data_pipeline.data_sampling import (DataAnalyzer, DeepSpeedDataSampler, MMapIndexedDataset,
                                                           MMapIndexedDatasetBuilder)

N = 60


class LengthDataset(torch.utils.data.Dataset):
    """Sample i: a sequence whose 'difficulty' (length) is (7 * i) % 13 + 1."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.full(((7 * i) % 13 + 1,), i, dtype=torch.long)


def _collate(items):
    return items


def _seqlen(batch):
    return torch.tensor([len(x) for x in batch], dtype=torch.long)


def _vocab(batch):  # an accumulated metric: how often each sample id's parity occurs
    return torch.bincount(torch.tensor([int(x[0]) % 2 for x in batch]), minlength=2).long()


def _analyze(path, **kw):
    a = DataAnalyzer(LengthDataset(), batch_size=7, metric_names=["seqlen", "parity"],
                     metric_functions=[_seqlen, _vocab], metric_types=["single_value_per_sample",
                                                                       "accumulate_value_over_samples"],
                     metric_dtypes=[torch.long, torch.long], save_path=str(path), collate_fn=_collate, **kw)
    return a


def _truth():
    return {i: (7 * i) % 13 + 1 for i in range(N)}


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    path = tmp_path_factory.mktemp("analysis")
    a = _analyze(path, num_threads=2)
    a.run_map()
    a.run_reduce()
    return path


def test_analyzer_index_files_equal_a_brute_force_sort(analyzed):
    truth = _truth()
    d = os.path.join(analyzed, "seqlen")
    values = sorted(set(truth.values()))
    i2m = MMapIndexedDataset(os.path.join(d, "seqlen_index_to_metric"))
    i2s = MMapIndexedDataset(os.path.join(d, "seqlen_index_to_sample"))
    s2m = MMapIndexedDataset(os.path.join(d, "seqlen_sample_to_metric"))
    assert [int(i2m[r][0]) for r in range(len(i2m))] == values
    assert [list(map(int, i2s[r])) for r in range(len(i2s))] == [sorted(i for i in truth if truth[i] == v)
                                                                  for v in values]
    assert [int(s2m[i][0]) for i in range(N)] == [truth[i] for i in range(N)]
    merged = MMapIndexedDataset(os.path.join(d, "seqlen_index_to_sample_percentile_merged"))
    assert np.concatenate(merged[0:len(merged)]).tolist() == [i for v in values for i in sorted(
        j for j in truth if truth[j] == v)]
    total = MMapIndexedDataset(os.path.join(analyzed, "parity", "parity_metric_value"))[0]
    assert total.tolist() == [N // 2, N // 2]


def test_analyzer_resumes_only_unfinished_parts(tmp_path):
    a = _analyze(tmp_path, num_threads=3, specific_threads=[0, 2])
    a.run_map()
    with pytest.raises(RuntimeError, match=r"\(0, 1\)"):
        a.run_reduce()  # thread 1 never ran
    done0 = os.path.getmtime(os.path.join(tmp_path, "seqlen", "worker0_thread0", "done"))
    b = _analyze(tmp_path, num_threads=3)  # a rerun: only part 1 is missing
    b.run_map()
    assert os.path.getmtime(os.path.join(tmp_path, "seqlen", "worker0_thread0", "done")) == done0
    b.run_reduce()
    i2s = MMapIndexedDataset(os.path.join(tmp_path, "seqlen", "seqlen_index_to_sample"))
    assert sorted(int(x) for r in range(len(i2s)) for x in i2s[r]) == list(range(N))


def _de_config(analyzed, difficulty_type="value", **sched):
    d = os.path.join(analyzed, "seqlen")
    metric = {"index_to_sample_path": os.path.join(d, "seqlen_index_to_sample"),
              "index_to_metric_path": os.path.join(d, "seqlen_index_to_metric"),
              "difficulty_type": difficulty_type, "clustering_type": "schedule_based",
              "min_difficulty": 3, "max_difficulty": 13, "schedule_type": "fixed_linear",
              "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 1}}
    if difficulty_type == "percentile":
        metric.update(min_difficulty=10, max_difficulty=100,
                      schedule_config={"total_curriculum_step": 4, "difficulty_step": 10})
    metric.update(sched)
    return {"enabled": True, "seed": 7, "data_sampling": {"enabled": True, "num_epochs": 2, "curriculum_learning": {
        "enabled": True, "data_cluster_path": os.path.join(str(analyzed), "clusters"),
        "curriculum_metrics": {"seqlen": metric}}}}


def test_sampler_serves_only_admissible_samples_and_ranks_agree(analyzed):
    truth = _truth()
    cfg = _de_config(analyzed)
    ranks = [DeepSpeedDataSampler(cfg, N, 2, r, 2, None, gradient_accumulation_steps=2, global_rank=r)
             for r in range(2)]
    iters = [iter(s) for s in ranks]
    for step in range(1, 8):
        served = []
        for _ in range(2):  # gas micro-batches
            parts = [next(it) for it in iters]
            assert all(len(p) == 2 for p in parts)
            served += parts[0] + parts[1]
        # the schedule: floor(step/5 * 10 + 3), capped at 13 (difficulty_step 1)
        limit = min(13, int(step / 5 * 10 + 3))
        assert ranks[0].current_difficulties == ranks[1].current_difficulties == {"seqlen": limit}
        assert all(truth[i] <= limit for i in served), (step, limit, served)
        assert len(set(served)) == len(served)
    assert ranks[0].state_dict()["batch"] == ranks[1].state_dict()["batch"]


def test_percentile_difficulty(analyzed):
    truth = _truth()
    order = sorted(range(N), key=lambda i: (truth[i], i))
    s = DeepSpeedDataSampler(_de_config(analyzed, "percentile"), N, 4, 0, 1)
    it = iter(s)
    first = next(it)
    # step 1: floor(1/4 * 90 + 10) = 32 -> 30th percentile: the 30% easiest samples (18 of 60)
    assert s.current_difficulties == {"seqlen": 30}
    assert set(first) <= set(order[:18])
    batch = next(it)  # step 2 (one micro-batch per step): floor(2/4 * 90 + 10) = 55 -> 50th percentile
    assert s.current_difficulties == {"seqlen": 50}
    assert set(batch) <= set(order[:30])


def test_sampler_resumes_at_the_exact_next_sample(analyzed):
    cfg = _de_config(analyzed)
    a = DeepSpeedDataSampler(cfg, N, 3, 0, 1, gradient_accumulation_steps=2)
    it = iter(a)
    for _ in range(5):
        next(it)
    state = a.state_dict()
    rest = [next(it) for _ in range(9)]
    b = DeepSpeedDataSampler(cfg, N, 3, 0, 1, gradient_accumulation_steps=2)
    b.load_state_dict(state)
    assert [x for x, _ in zip(iter(b), range(9))] == rest


def test_missing_index_file_names_the_key(analyzed, tmp_path):
    cfg = _de_config(analyzed, index_to_sample_path=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="curriculum_metrics.seqlen.index_to_sample_path"):
        DeepSpeedDataSampler(cfg, N, 2, 0, 1)


def test_indexed_dataset_roundtrip(tmp_path):
    b = MMapIndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    b.add_item(torch.tensor([1, 2, 3]))
    b.add_item(np.array([], dtype=np.int64))
    b.add_item(np.array([65535]))
    b.end_document()
    b.finalize(str(tmp_path / "x.idx"))
    ds = MMapIndexedDataset(str(tmp_path / "x"))
    assert [x.tolist() for x in ds[0:3]] == [[1, 2, 3], [], [65535]] and ds.dtype == np.uint16
