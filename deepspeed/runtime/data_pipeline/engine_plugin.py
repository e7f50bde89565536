"""How the data-efficiency techniques plug into the engine (``runtime/engine_features``).

* ``curriculum_learning`` (legacy): before each training forward the difficulty is updated
  for step ``global_steps + 1`` and, for ``curriculum_type: seqlen``, passed to the model's
  forward as ``curriculum_seqlen=`` (DeepSpeed's keyword). Checkpoint key
  ``curriculum_scheduler_legacy``.
* ``data_efficiency.data_sampling.curriculum_learning``: the training data loader draws
  its batches from a :class:`DeepSpeedDataSampler`. Checkpoint key ``data_sampler``.
* ``data_efficiency.data_routing.random_ltd``: the schedule advances before each training
  forward (``update_seq(global_steps)``); ``convert_to_random_ltd`` hands it to the layers.
  Checkpoint key ``random_ltd``.
"""
from __future__ import annotations

from ...utils.logging import logger
from ..engine_features import EngineFeature, register_feature
from .constants import RANDOM_LTD_SAMPLE_INDEX
from .curriculum_scheduler import CurriculumScheduler
from .data_routing.basic_layer import RandomLayerTokenDrop
from .data_routing.scheduler import RandomLTDScheduler
from .data_sampling.data_sampler import DeepSpeedDataSampler
from .data_sampling.indexed_dataset import MMapIndexedDataset


class LegacyCurriculum(EngineFeature):
    name = "curriculum_learning_legacy"
    checkpoint_key = "curriculum_scheduler_legacy"

    def __init__(self, section):
        self.curriculum_type = section.curriculum_type
        self.scheduler = CurriculumScheduler(section, where="curriculum_learning")

    def forward_kwargs(self, engine, kwargs):
        self.scheduler.update_difficulty(engine.global_steps + 1)
        if self.curriculum_type == "seqlen":
            kwargs["curriculum_seqlen"] = self.scheduler.get_current_difficulty()

    def set_custom_schedule(self, fn) -> bool:
        if callable(fn):
            self.scheduler.set_custom_get_difficulty(fn)
            return True
        return False

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state):
        self.scheduler.load_state_dict(state)


class DataSampling(EngineFeature):
    name = "data_sampling"
    checkpoint_key = "data_sampler"

    def __init__(self, section):
        self.section = section
        self.sampler = None
        self.pending_custom = {}
        where = "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics"
        for metric, m in section.data_sampling.curriculum_learning.curriculum_metrics.items():
            if m.clustering_type == "single_cluster":
                continue
            keys = ["index_to_sample_path"] + (["index_to_metric_path"] if m.difficulty_type == "value" else [])
            for key in keys:
                path = getattr(m, key)
                if not MMapIndexedDataset.exists(path):
                    raise FileNotFoundError(f"{where}.{metric}.{key}: {path!r} has no index files ('{path}.idx' and "
                                            f"'{path}.bin'); run the DataAnalyzer and point this key at its output.")

    def batch_sampler(self, engine, dataset):
        self.sampler = DeepSpeedDataSampler(self.section, len(dataset), engine.train_micro_batch_size_per_gpu(),
                                            engine.dp_rank, engine.dp_world_size, engine.dp_group,
                                            engine.gradient_accumulation_steps(), engine.global_rank,
                                            drop_last=engine.dataloader_drop_last())
        if self.pending_custom:
            self.sampler.set_custom_curriculum_learning_schedule(self.pending_custom)
        return self.sampler

    def set_custom_schedule(self, fns) -> bool:
        if not isinstance(fns, dict):
            return False
        self.pending_custom.update(fns)
        if self.sampler is not None:
            self.sampler.set_custom_curriculum_learning_schedule(fns)
        return any(k in self.section.data_sampling.curriculum_learning.curriculum_metrics for k in fns)

    def state_dict(self):
        return self.sampler.state_dict() if self.sampler is not None else None

    def load_state_dict(self, state):
        if self.sampler is not None:
            self.sampler.load_state_dict(state)


class RandomLTD(EngineFeature):
    name = "random_ltd"
    checkpoint_key = "random_ltd"

    def __init__(self, engine, section):
        cfg = section.model_dump()
        cfg["global_batch_size"] = engine.train_batch_size()
        cfg["micro_batch_size"] = engine.train_micro_batch_size_per_gpu()
        self.config = cfg
        self.scheduler = RandomLTDScheduler(cfg)

    def forward_kwargs(self, engine, kwargs):
        self.scheduler.update_seq(engine.global_steps)
        self.scheduler.state[RANDOM_LTD_SAMPLE_INDEX] = None  # each forward draws its own kept tokens

    def initialize_layers(self, engine) -> None:
        layers = [m for m in engine.module.modules() if isinstance(m, RandomLayerTokenDrop)]
        ids = sorted(self.config["random_ltd_layer_id"])
        if not layers or ids[-1] >= len(layers):
            raise ValueError(f"data_efficiency.data_routing.random_ltd.random_ltd_layer_id {ids} names layers beyond "
                             f"the {len(layers)} converted layers (numbered from 0 in module order); convert the "
                             f"model's layers with convert_to_random_ltd(engine, LayerClass).")
        if len(layers) != self.config["total_layer_num"]:
            logger.warning(f"random-LTD: {len(layers)} layers were converted but total_layer_num is "
                           f"{self.config['total_layer_num']}; the consumed-token count uses total_layer_num.")
        for count, pos in enumerate(ids):
            layers[pos].init_config(self.config, self.scheduler, count)

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state):
        self.scheduler.load_state_dict(state)


def _legacy(engine):
    s = engine.config_obj.model.curriculum_learning
    f = LegacyCurriculum(s) if s is not None and s.enabled else None
    engine.curriculum_scheduler_legacy = f.scheduler if f is not None else None
    return f


def _sampling(engine):
    s = engine.config_obj.model.data_efficiency
    on = s is not None and s.enabled and s.data_sampling.curriculum_learning.enabled
    return DataSampling(s) if on else None


def _random_ltd(engine):
    s = engine.config_obj.model.data_efficiency
    on = s is not None and s.enabled and s.data_routing.random_ltd.enabled
    f = RandomLTD(engine, s.data_routing.random_ltd) if on else None
    engine.random_ltd_scheduler = f.scheduler if f is not None else None
    return f


register_feature("curriculum_learning_legacy", _legacy, LegacyCurriculum.checkpoint_key)
register_feature("data_sampling", _sampling, DataSampling.checkpoint_key)
register_feature("random_ltd", _random_ltd, RandomLTD.checkpoint_key)
