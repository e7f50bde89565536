"""``deepspeed.checkpoint``: helpers for code that saves or inspects checkpoints.

``utils`` (clone_tensors_for_torch_save, the per-rank file names), ``constants``
(DeepSpeed's file-name pieces and state keys), ``deepspeed_checkpoint``
(``DeepSpeedCheckpoint``: a 3-D checkpoint directory described), ``reshape_3d_utils`` /
``reshape_meg_2d`` / ``reshape_utils`` (``model_3d_desc``: which old rank files merge into each
rank of a smaller pipeline x tensor x data-parallel shape), ``zero_checkpoint``
(``ZeROCheckpoint``: a tag's ZeRO optimizer files on that shape, merged onto a smaller one),
``ds_to_universal`` (the metadata check of DeepSpeed's converter; the conversion is not needed here).
"""
from .constants import *  # noqa: F401,F403
from .deepspeed_checkpoint import DeepSpeedCheckpoint  # noqa: F401
from .utils import (clone_tensors_for_torch_save, get_layer_ckpt_name_for_rank,  # noqa: F401
                    get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank)
from .reshape_meg_2d import reshape_meg_2d_parallel  # noqa: F401,E402
from .reshape_utils import merge_state  # noqa: F401,E402
from .reshape_3d_utils import get_model_3d_descriptor, model_3d_desc  # noqa: F401,E402
from .zero_checkpoint import ZeROCheckpoint  # noqa: F401,E402
