"""Names, defaults and the default tuning spaces of the autotuner.

The key names and defaults are DeepSpeed's (``deepspeed/autotuning/constants.py``); the
per-stage tuning spaces are sized for short experiments: a few values of each ZeRO
knob that matters for the stage, so that a grid over one stage is a handful of runs
(``tuner_num_trials`` and ``tuner_early_stopping`` bound it further).
"""
from __future__ import annotations

AUTOTUNING = "autotuning"
AUTOTUNING_METRIC_PATH = "metric_path"
AUTOTUNING_MODEL_INFO_PATH = "model_info_path"

AUTOTUNING_TUNER_GRIDSEARCH = "gridsearch"
AUTOTUNING_TUNER_RANDOM = "random"
AUTOTUNING_TUNER_MODELBASED = "model_based"

AUTOTUNING_METRIC_LATENCY = "latency"
AUTOTUNING_METRIC_THROUGHPUT = "throughput"
AUTOTUNING_METRIC_FLOPS = "flops"
AUTOTUNING_METRIC_DEFAULT = AUTOTUNING_METRIC_THROUGHPUT
#: Metrics where smaller is better; every other metric is maximised.
LOWER_IS_BETTER = (AUTOTUNING_METRIC_LATENCY, )

DS_CONFIG = "ds_config"
ZERO_OPTIMIZATION = "zero_optimization"
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
TRAIN_BATCH_SIZE = "train_batch_size"

#: A larger micro-batch must beat the best so far by this fraction to count as better
#: (DeepSpeed's METRIC_PERCENT_DIFF_CONST): below it, the gain is measurement noise.
METRIC_PERCENT_DIFF_CONST = 0.05

GLOBAL_TUNING_SPACE = "global"
PROFILE_EXP_NAME = "profile_model_info"

#: The configuration of the model-info profile run (DeepSpeed's DEFAULT_MIN_MEM_CONFIG
#: uses stage 3; on one CPU rank the stage does not change what is measured, and
#: stage 0 starts fastest).
DEFAULT_MIN_MEM_CONFIG = {TRAIN_MICRO_BATCH_SIZE_PER_GPU: 1, ZERO_OPTIMIZATION: {"stage": 0}}

#: Per-stage search spaces: lists are the values tried; scalars are fixed.
DEFAULT_TUNING_SPACE_ZERO_0 = {ZERO_OPTIMIZATION: {"stage": 0}}
DEFAULT_TUNING_SPACE_ZERO_1 = {
    ZERO_OPTIMIZATION: {
        "stage": 1,
        "reduce_bucket_size": [5e7, 5e8],
        "allgather_bucket_size": [5e7, 5e8],
    }
}
DEFAULT_TUNING_SPACE_ZERO_2 = {
    ZERO_OPTIMIZATION: {
        "stage": 2,
        "overlap_comm": [True, False],
        "reduce_bucket_size": [5e7, 5e8],
        "allgather_bucket_size": [5e7, 5e8],
    }
}
DEFAULT_TUNING_SPACE_ZERO_3 = {
    ZERO_OPTIMIZATION: {
        "stage": 3,
        "overlap_comm": [True, False],
        "reduce_bucket_size": [5e7, 5e8],
        "stage3_prefetch_bucket_size": [5e7, 5e8],
        "stage3_param_persistence_threshold": [1e4, 1e5],
    }
}
DEFAULT_TUNING_SPACES = {0: DEFAULT_TUNING_SPACE_ZERO_0, 1: DEFAULT_TUNING_SPACE_ZERO_1,
                         2: DEFAULT_TUNING_SPACE_ZERO_2, 3: DEFAULT_TUNING_SPACE_ZERO_3}

#: The prefix of the experiment names of stage z's micro-batch runs (``z2_mbs8``).
TUNING_MICRO_BATCH_SIZE_PREFIX = "z"

#: Seconds one experiment may run before it is killed and recorded as timed out.
DEFAULT_EXPERIMENT_TIMEOUT = 600
