"""The engine's compression hook: one :class:`~deepspeed.runtime.engine_features.EngineFeature`.

When ``compression_training`` is on and the model was prepared by ``init_compression``,
the engine gets ``engine.compression_scheduler``. After each optimizer step
(``EngineFeature.after_step``) the scheduler is set to the engine's count of applied
optimizer steps (``global_steps - skipped_steps``), as DeepSpeed's engine steps it after
each applied step; a forward pre-hook on the model does the same whenever that count has
moved without a step, i.e. after a checkpoint is loaded (the count is in the checkpoint;
masks, scores and activation ranges are in the module's state dict).

Refused, with the reason: ZeRO stage 3 (parameters are partitioned, while masks, scores,
in-place quantization and ``redundancy_clean`` need whole weights); and weight
quantization in the optimizer step (``quantize_weight_in_forward: false``) with fp32 at
stage 0, where the module's weights are the master weights and quantizing them every step
would compound (DeepSpeed's reference: set ``quantize_weight_in_forward`` for FP32).
"""
from __future__ import annotations

import weakref

from ..config.errors import DeepSpeedConfigError
from ..runtime.engine_features import EngineFeature, register_feature
from ..utils.logging import logger
from .helper import compressed_modules
from .scheduler import compression_scheduler


class CompressionFeature(EngineFeature):
    name = "compression_training"

    def __init__(self, engine, scheduler: compression_scheduler):
        self.scheduler = scheduler
        self._engine = weakref.ref(engine)
        self._synced = False
        self._handle = engine.module.register_forward_pre_hook(self._pre_forward)

    def applied_steps(self, engine) -> int:
        return int(engine.global_steps - engine.skipped_steps)

    def sync(self) -> None:
        engine = self._engine()
        if engine is None:
            return
        n = self.applied_steps(engine)
        if not self._synced or n != self.scheduler.training_steps:
            self.scheduler.set_step(n)
            self._synced = True

    def after_step(self, engine) -> None:
        self.sync()  # DeepSpeed steps the scheduler right after each applied optimizer step

    def _pre_forward(self, module, args):
        self.sync()  # cheap when nothing moved; catches a loaded checkpoint's step count


def _check_supported(engine, section) -> None:
    keys = [k for k in section.enabling_keys() if k != "layer_reduction.enabled"]
    if keys and engine.zero_optimization_stage() == 3:
        raise DeepSpeedConfigError(
            f"compression_training.{keys[0]} cannot run with zero_optimization.stage 3: stage 3 partitions the "
            f"parameters across ranks, while pruning masks and scores, in-place weight quantization and "
            f"redundancy_clean need whole weights on every rank. Use stage 0, 1 or 2.")
    wq = section.weight_quantization
    if wq is not None and wq.shared_parameters.enabled and not wq.shared_parameters.quantize_weight_in_forward \
            and engine.zero_optimization_stage() == 0 and not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        raise DeepSpeedConfigError(
            "compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward is false, which "
            "quantizes the weights in the optimizer step; with fp32 at zero_optimization.stage 0 the module's weights "
            "are the master weights and would be re-quantized every step. Set quantize_weight_in_forward to true "
            "(as DeepSpeed requires for FP32 training), or train in fp16/bf16 or at stage 1/2 (fp32 masters).")


def _factory(engine):
    section = getattr(engine.config_obj.model, "compression_training", None)
    if section is None or not section.enabled:
        return None
    _check_supported(engine, section)
    if not compressed_modules(engine.module):
        logger.warning("compression_training is enabled but the model has no compressible layers: call "
                       "deepspeed.compression.init_compression(model, config) before deepspeed.initialize.")
        return None
    scheduler = compression_scheduler(engine.module, section)
    engine.compression_scheduler = scheduler
    feature = CompressionFeature(engine, scheduler)
    pruner = getattr(engine.module, "_ds_snip_pruner", None)
    if pruner is not None:
        pruner.group = engine.dp_group  # scores averaged over data parallelism before each mask update
    feature.sync()  # DeepSpeed's step_zero_check: offsets of 0 are on before the first forward
    return feature


register_feature("compression_training", _factory)
