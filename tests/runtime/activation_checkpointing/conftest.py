"""Every test starts from unconfigured checkpointing, empty buffers and an empty RNG tracker."""
import pytest

from deepspeed.runtime.activation_checkpointing import checkpointing, settings
from deepspeed.runtime.activation_checkpointing.rng import get_cuda_rng_tracker


@pytest.fixture(autouse=True)
def _fresh_checkpointing_state():
    settings._reset_settings()
    checkpointing.reset()
    get_cuda_rng_tracker().reset()
    yield
    settings._reset_settings()
    checkpointing.reset()
    get_cuda_rng_tracker().reset()
