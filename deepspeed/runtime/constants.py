"""``deepspeed.runtime.constants``: DeepSpeed's config key names and their defaults.

The defaults are read from the typed config models in :mod:`deepspeed.config` (the
one place they are defined), so these constants cannot drift from what the parser does.
"""
from __future__ import annotations

from ..config.ds_config import DeepSpeedConfigModel as _Top
from ..config.sections import CheckpointSection as _Ckpt, FP16Section as _FP16, BF16Section as _BF16


def _default(model, key):
    for name, f in model.model_fields.items():
        if key in (name, f.alias):
            return f.get_default(call_default_factory=True)
    raise KeyError(key)


# Routes through the engine's forward (pipeline and data-efficiency code use them).
ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"
ROUTE_PREDICT = "predict"
ROUTE_ENCODE = "encode"

# Batch
TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_BATCH_SIZE_DEFAULT = _default(_Top, TRAIN_BATCH_SIZE)
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = _default(_Top, TRAIN_MICRO_BATCH_SIZE_PER_GPU)
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
GRADIENT_ACCUMULATION_STEPS_DEFAULT = _default(_Top, GRADIENT_ACCUMULATION_STEPS)
MANAGED_GRADIENT_ACCUMULATION = "managed_gradient_accumulation"
MANAGED_GRADIENT_ACCUMULATION_DEFAULT = _default(_Top, MANAGED_GRADIENT_ACCUMULATION)

# Optimizer and scheduler
OPTIMIZER = "optimizer"
OPTIMIZER_TYPE_DEFAULT = None
OPTIMIZER_PARAMS = "params"
TYPE = "type"
LEGACY_FUSION = "legacy_fusion"
LEGACY_FUSION_DEFAULT = False
SCHEDULER = "scheduler"
SCHEDULER_TYPE_DEFAULT = None
SCHEDULER_PARAMS = "params"
MAX_GRAD_NORM = "max_grad_norm"
ZERO_ALLOW_UNTESTED_OPTIMIZER = "zero_allow_untested_optimizer"
ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT = _default(_Top, ZERO_ALLOW_UNTESTED_OPTIMIZER)
ZERO_FORCE_DS_CPU_OPTIMIZER = "zero_force_ds_cpu_optimizer"
ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT = _default(_Top, ZERO_FORCE_DS_CPU_OPTIMIZER)

# Logging and debugging
STEPS_PER_PRINT = "steps_per_print"
STEPS_PER_PRINT_DEFAULT = _default(_Top, STEPS_PER_PRINT)
WALL_CLOCK_BREAKDOWN = "wall_clock_breakdown"
WALL_CLOCK_BREAKDOWN_DEFAULT = _default(_Top, WALL_CLOCK_BREAKDOWN)
MEMORY_BREAKDOWN = "memory_breakdown"
MEMORY_BREAKDOWN_DEFAULT = _default(_Top, MEMORY_BREAKDOWN)
DUMP_STATE = "dump_state"
DUMP_STATE_DEFAULT = _default(_Top, DUMP_STATE)

# Gradients and communication
PRESCALE_GRADIENTS = "prescale_gradients"
PRESCALE_GRADIENTS_DEFAULT = _default(_Top, PRESCALE_GRADIENTS)
GRADIENT_PREDIVIDE_FACTOR = "gradient_predivide_factor"
GRADIENT_PREDIVIDE_FACTOR_DEFAULT = _default(_Top, GRADIENT_PREDIVIDE_FACTOR)
GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = _default(_Top, GRADIENT_CLIPPING)
LOG_LEVEL = "log_level"
LOG_LEVEL_DEFAULT = _default(_Top, LOG_LEVEL)
SPARSE_GRADIENTS = "sparse_gradients"
SPARSE_GRADIENTS_DEFAULT = _default(_Top, SPARSE_GRADIENTS)
COMMUNICATION_DATA_TYPE = "communication_data_type"
COMMUNICATION_DATA_TYPE_DEFAULT = _default(_Top, COMMUNICATION_DATA_TYPE)
SEQ_PARALLEL_COMMUNICATION_DATA_TYPE = "seq_parallel_communication_data_type"
SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT = _default(_Top, SEQ_PARALLEL_COMMUNICATION_DATA_TYPE)
DISABLE_ALLGATHER = "disable_allgather"
DISABLE_ALLGATHER_DEFAULT = _default(_Top, DISABLE_ALLGATHER)
GRAPH_HARVESTING = "graph_harvesting"
GRAPH_HARVESTING_DEFAULT = _default(_Top, GRAPH_HARVESTING)
USE_DATA_BEFORE_EXPERT_PARALLEL = "use_data_before_expert_parallelism"
USE_DATA_BEFORE_EXPERT_PARALLEL_DEFAULT = _default(_Top, USE_DATA_BEFORE_EXPERT_PARALLEL)

# FP16 / BF16 / AMP
FP16 = "fp16"
FP16_ENABLED = "enabled"
FP16_ENABLED_DEFAULT = _default(_FP16, "enabled")
FP16_LOSS_SCALE = "loss_scale"
FP16_LOSS_SCALE_DEFAULT = _default(_FP16, "loss_scale")
FP16_AUTO_CAST = "auto_cast"
FP16_AUTO_CAST_DEFAULT = _default(_FP16, "auto_cast")
FP16_INITIAL_SCALE_POWER = "initial_scale_power"
FP16_INITIAL_SCALE_POWER_DEFAULT = _default(_FP16, "initial_scale_power")
FP16_LOSS_SCALE_WINDOW = "loss_scale_window"
FP16_LOSS_SCALE_WINDOW_DEFAULT = _default(_FP16, "loss_scale_window")
FP16_HYSTERESIS = "hysteresis"
FP16_HYSTERESIS_DEFAULT = _default(_FP16, "hysteresis")
FP16_CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
FP16_CONSECUTIVE_HYSTERESIS_DEFAULT = _default(_FP16, "consecutive_hysteresis")
FP16_MIN_LOSS_SCALE = "min_loss_scale"
FP16_MIN_LOSS_SCALE_DEFAULT = _default(_FP16, "min_loss_scale")
FP16_MASTER_WEIGHTS_AND_GRADS = "fp16_master_weights_and_grads"
FP16_MASTER_WEIGHTS_AND_GRADS_DEFAULT = _default(_FP16, "fp16_master_weights_and_grads")
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # older spelling of the section name
BFLOAT16_ENABLED = "enabled"
BFLOAT16_ENABLED_DEFAULT = _default(_BF16, "enabled")
BFLOAT16_IMMEDIATE_GRAD_UPDATE = "immediate_grad_update"
BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT = _default(_BF16, "immediate_grad_update")
AMP = "amp"
AMP_ENABLED = "enabled"
AMP_ENABLED_DEFAULT = False

# Checkpoint
CHECKPOINT = "checkpoint"
CHECKPOINT_TAG_VALIDATION = "tag_validation"
CHECKPOINT_TAG_VALIDATION_DEFAULT = _default(_Ckpt, "tag_validation").upper()


class ValidationMode:
    WARN = "WARN"
    IGNORE = "IGNORE"
    FAIL = "FAIL"


CHECKPOINT_TAG_VALIDATION_MODES = [ValidationMode.WARN, ValidationMode.IGNORE, ValidationMode.FAIL]
LOAD_UNIVERSAL_CHECKPOINT = "load_universal"
LOAD_UNIVERSAL_CHECKPOINT_DEFAULT = _default(_Ckpt, "load_universal")
USE_NODE_LOCAL_STORAGE_CHECKPOINT = "use_node_local_storage"
USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT = _default(_Ckpt, "use_node_local_storage")
CHECKPOINT_PARALLEL_WRITE = "parallel_write"
CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE = "pipeline_stage"
CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT = False

# Data loading
DATALOADER_DROP_LAST = "dataloader_drop_last"
DATALOADER_DROP_LAST_DEFAULT = False

# Parallel-topology names put on tensors and in state dicts
PIPE_REPLICATED = "ds_pipe_replicated"
DATA_PARALLEL_GROUP = "data_parallel_group"
GLOBAL_RANK = "global_rank"
VOCABULARY_SIZE = "vocabulary_size"
VOCABULARY_SIZE_DEFAULT = None
PIPELINE = "pipeline"
ZERO_OPTIMIZATION = "zero_optimization"
