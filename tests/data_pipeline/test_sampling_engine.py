"""Curriculum data sampling through the engine on two ranks (ZeRO-2): the distributed
DataAnalyzer, served difficulty, ranks agreeing, post-processing, exact resume from a checkpoint."""
import copy
import os

import torch

from tests.helpers.dist import run_distributed

N, SEQ = 64, 16


def _difficulty(i):
    return (5 * i) % 13 + 1  # a value metric in 1..13


class DictDataset(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"idx": i, "x": (i + torch.arange(SEQ)) % 16}


def _metric(batch):
    return torch.tensor([_difficulty(int(i)) for i in batch["idx"]], dtype=torch.long)


def _body(rank, world_size, path):
    import torch.distributed as dist

    import deepspeed
    from deepspeed.runtime.data_pipeline.data_sampling import DataAnalyzer
    from tests.data_pipeline.tiny_gpt import TinyGPT

    DataAnalyzer(DictDataset(), num_workers=world_size, worker_id=rank, batch_size=5, metric_names=["diff"],
                 metric_functions=[_metric], metric_types=["single_value_per_sample"], metric_dtypes=[torch.long],
                 save_path=path).run_map_reduce()
    metrics = {
        "diff": {"index_to_sample_path": os.path.join(path, "diff", "diff_index_to_sample"),
                 "index_to_metric_path": os.path.join(path, "diff", "diff_index_to_metric"),
                 "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 4,
                 "max_difficulty": 13, "schedule_type": "fixed_linear",
                 "schedule_config": {"total_curriculum_step": 3, "difficulty_step": 1}},
        "seqlen": {"difficulty_type": "value", "clustering_type": "single_cluster", "min_difficulty": 8,
                   "max_difficulty": 16, "schedule_type": "fixed_discrete",
                   "schedule_config": {"difficulty": [8, 12, 16], "max_step": [2, 4]}}}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 2e-2}}, "zero_optimization": {"stage": 2},
           "data_efficiency": {"enabled": True, "seed": 3, "data_sampling": {
               "enabled": True, "num_epochs": 10, "curriculum_learning": {
                   "enabled": True, "data_cluster_path": os.path.join(path, "clusters"),
                   "curriculum_metrics": metrics}}}}

    def make():
        torch.manual_seed(0)
        e, _, loader, _ = deepspeed.initialize(model=TinyGPT(), config=copy.deepcopy(cfg),
                                               training_data=DictDataset())
        served = []

        def post(batch, state):  # Megatron's use: truncate to the 'seqlen' difficulty
            served.append((batch["idx"].tolist(), dict(state["current_difficulties"])))
            return batch["x"][:, :state["current_difficulties"]["seqlen"]]
        e.set_data_post_process_func(post)
        return e, loader, served

    def steps(e, it, n):
        losses = []
        for _ in range(n):
            for _ in range(2):
                x = next(it)
                loss = e(x)
                e.backward(loss)
                e.step()
            losses.append(loss.item())
        return losses

    e, loader, served = make()
    it = iter(loader)
    losses = steps(e, it, 12)
    e.save_checkpoint(os.path.join(path, "ckpt"), tag="s")
    served_at_save = len(served)
    steps(e, it, 2)
    after = served[served_at_save:]
    e2, loader2, served2 = make()
    e2.load_checkpoint(os.path.join(path, "ckpt"), tag="s")
    steps(e2, iter(loader2), 2)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, served)
    return {"losses": losses, "served": served, "gathered": gathered, "after": after, "resumed": served2}


def test_curriculum_sampling_through_the_engine(tmp_path):
    out = run_distributed(_body, world_size=2, args=(str(tmp_path),), timeout=400)
    r0, r1 = out
    assert r0["gathered"][1] == r1["served"]
    for step_batches in zip(r0["served"], r1["served"]):
        (idx0, d0), (idx1, d1) = step_batches
        assert d0 == d1  # the same schedule on both ranks
        assert len(idx0) == len(idx1) == 2 and not set(idx0) & set(idx1)  # disjoint slices of one batch
        assert all(_difficulty(i) <= d0["diff"] for i in idx0 + idx1)
    # micro-batch m belongs to step m // 2 + 1: diff = min(13, floor(step/3 * 9 + 4)); seqlen 8/12/16
    for m, (_, d) in enumerate(r0["served"][:16]):
        step = m // 2 + 1
        assert d == {"diff": min(13, int(step / 3 * 9 + 4)), "seqlen": 8 if step <= 2 else 12 if step <= 4 else 16}
    # the easiest samples come first: the first step only serves difficulty <= 7
    assert max(_difficulty(i) for i in r0["served"][0][0] + r1["served"][0][0]) <= 7
    for r in out:
        assert r["resumed"] == r["after"]  # the exact next samples after loading the checkpoint
        assert sum(r["losses"][-3:]) < 0.8 * sum(r["losses"][:3])
