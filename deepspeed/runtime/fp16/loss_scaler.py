"""Re-export of :mod:`deepspeed.runtime.precision.loss_scaler` at DeepSpeed's import path."""
from ..precision.loss_scaler import (DynamicLossScaler, LossScaler, LossScalerBase,  # noqa: F401
                                     create_loss_scaler, has_inf_or_nan)
