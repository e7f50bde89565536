"""``DeepSpeedDataLoader`` (micro-batches, sharded by data-parallel rank) and ``RepeatingLoader``."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler


class RepeatingLoader:
    """Wrap an iterable so that it restarts when exhausted (never raises StopIteration)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            if hasattr(self.loader, "sampler") and hasattr(self.loader.sampler, "set_epoch"):
                self.loader.sampler.set_epoch(getattr(self.loader.sampler, "epoch", 0) + 1)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


class DeepSpeedDataLoader:
    """Iterates micro-batches of ``batch_size`` for this data-parallel rank.

    With more than one data-parallel rank, a ``DistributedSampler`` gives each rank a
    disjoint shard; a new epoch (each ``iter()``) reshuffles with ``seed + epoch``.
    """

    def __init__(self, dataset, batch_size: int, pin_memory: bool = False, local_rank: int = 0,
                 tput_timer=None, collate_fn=None, num_local_io_workers=None, data_sampler=None,
                 data_parallel_world_size: int = 1, data_parallel_rank: int = 0,
                 dataloader_drop_last: bool = False, shuffle: bool = True, seed: int = 0, batch_sampler=None):
        # ``batch_sampler`` (curriculum data sampling) yields this rank's micro-batch indices itself;
        # ``post_process_func(batch, batch_sampler.state_dict())`` (engine.set_data_post_process_func)
        # then sees each batch with the sampler's current difficulties.
        self.post_process_func = None
        self.batch_sampler = batch_sampler
        if batch_sampler is not None:
            self.dataset, self.batch_size, self.epoch, self.tput_timer = dataset, batch_size, 0, tput_timer
            self.data_sampler = self.sampler = batch_sampler
            self.collate_fn = collate_fn
            self.dataloader = DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn,
                                         pin_memory=pin_memory, num_workers=num_local_io_workers or 0)
            n = getattr(batch_sampler, "num_micro_batches", None)
            self.len = n() if n is not None else len(batch_sampler)
            self._iter = None
            return
        if data_sampler is None:
            if data_parallel_world_size > 1:
                data_sampler = DistributedSampler(dataset, num_replicas=data_parallel_world_size,
                                                  rank=data_parallel_rank, shuffle=shuffle, seed=seed,
                                                  drop_last=dataloader_drop_last)
            elif shuffle:
                g = torch.Generator()
                g.manual_seed(seed)
                data_sampler = RandomSampler(dataset, generator=g)
        self.dataset = dataset
        self.batch_size = batch_size
        self.data_sampler = data_sampler
        self.sampler = data_sampler
        self.epoch = 0
        self.collate_fn = collate_fn
        self.tput_timer = tput_timer
        self.dataloader = DataLoader(dataset, batch_size=batch_size, sampler=data_sampler,
                                     collate_fn=collate_fn, pin_memory=pin_memory,
                                     num_workers=num_local_io_workers or 0, drop_last=dataloader_drop_last)
        self.len = len(self.dataloader)
        self._iter = None

    def __len__(self):
        return self.len

    def __iter__(self):
        if hasattr(self.data_sampler, "set_epoch"):
            self.data_sampler.set_epoch(self.epoch)
        self.epoch += 1
        self._iter = iter(self.dataloader)
        return self

    def __next__(self):
        if self._iter is None:
            iter(self)
        if self.tput_timer is not None:
            self.tput_timer.start()
        batch = next(self._iter)
        if self.post_process_func is not None:
            state = self.batch_sampler.state_dict() if self.batch_sampler is not None else {}
            batch = self.post_process_func(batch, state)
        return batch
