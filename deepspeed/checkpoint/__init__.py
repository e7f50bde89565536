"""``deepspeed.checkpoint``: helpers for code that saves or inspects checkpoints."""
from .utils import clone_tensors_for_torch_save  # noqa: F401
