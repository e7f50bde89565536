"""Key names, defaults and environment variables of the ``elasticity`` config section.

The names and defaults are DeepSpeed's (the documented config reference and
``deepspeed.elasticity.constants``), so schedulers that read a DeepSpeed config
find the same keys here.
"""

ELASTICITY = "elasticity"

#: Highest elastic-logic version this runtime implements.
LATEST_ELASTICITY_VERSION = 0.2

ENABLED = "enabled"
ENABLED_DEFAULT = False

MAX_ACCEPTABLE_BATCH_SIZE = "max_train_batch_size"
MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT = 2000

MICRO_BATCHES = "micro_batch_sizes"
MICRO_BATCHES_DEFAULT = [2, 4, 6]

MIN_GPUS = "min_gpus"
MIN_GPUS_DEFAULT = 1
MAX_GPUS = "max_gpus"
MAX_GPUS_DEFAULT = 10000

NUM_GPUS_PER_NODE = "num_gpus_per_node"
NUM_GPUS_PER_NODE_DEFAULT = 1

MODEL_PARALLEL_SIZE = "model_parallel_size"
MODEL_PARALLEL_SIZE_DEFAULT = 1

MIN_TIME = "min_time"
MIN_TIME_DEFAULT = 0

#: DeepSpeed's code reads ``prefer_larger_batch``; its config reference documents
#: ``prefer_large_batch``. Both are accepted (the first one present wins, in this order).
PREFER_LARGER_BATCH = "prefer_larger_batch"
PREFER_LARGE_BATCH_DOCUMENTED = "prefer_large_batch"
PREFER_LARGER_BATCH_DEFAULT = True

IGNORE_NON_ELASTIC_BATCH_INFO = "ignore_non_elastic_batch_info"
IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT = False

VERSION = "version"
VERSION_DEFAULT = LATEST_ELASTICITY_VERSION

#: Oldest DeepSpeed release whose runtime understands the elastic config.
MINIMUM_DEEPSPEED_VERSION = "0.3.8"

#: Set by the launcher (``deepspeed --elastic_training``) to the elastic section the
#: scheduler planned with; the runtime refuses a config whose elastic section differs.
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"

FORMAT = '''
Elasticity is enabled as:
"elasticity": {
  "enabled": true,
  "max_train_batch_size": 2000,
  "micro_batch_sizes": [2,4,6],
  "min_gpus": 1,
  "max_gpus" : 10000,
  "min_time": 20,
  "prefer_larger_batch": true,
  "ignore_non_elastic_batch_info": false,
  "version": 0.1
}
'''
