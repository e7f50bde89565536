"""Random layerwise token dropping ops (DeepSpeed's import path), in PyTorch ops."""
from .dropping_utils import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens  # noqa: F401
