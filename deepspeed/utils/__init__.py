"""``deepspeed.utils``: logger, timers, RepeatingLoader and partitioned-state helpers."""
from .logging import log_dist, logger, set_log_level_from_string  # noqa: F401
from .timer import SynchronizedWallClockTimer, ThroughputTimer  # noqa: F401
from .z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,  # noqa: F401
                             set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules,
                             z3_leaf_module, z3_leaf_parameter)


def __getattr__(name):  # lazy, to keep ``import deepspeed.utils`` free of import cycles
    if name in ("is_initialized", "init_distributed"):  # older DeepSpeed spellings (ESMFold calls the first)
        from .. import comm
        return getattr(comm, name)
    if name == "RepeatingLoader":
        from ..runtime.dataloader import RepeatingLoader
        return RepeatingLoader
    if name in ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
                "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_local_fp32_param",
                "safe_set_local_optimizer_state", "safe_set_full_grad", "safe_set_local_grad",
                "safe_update_full_grad_vectorized"):
        from . import tensor_fragment
        return getattr(tensor_fragment, name)
    raise AttributeError(f"module 'deepspeed.utils' has no attribute '{name}'")
