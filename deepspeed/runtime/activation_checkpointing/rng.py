"""Named RNG streams for model parallelism, and whole-process RNG snapshots.

Checkpointed code runs its forward twice (once for real, once in backward to
rebuild activations). Dropout must draw the same masks both times, so every RNG
stream the forward may touch is snapshotted before it runs and restored for the
recompute: the CPU generator, the accelerator's generator, and every stream in
the tracker below.

The tracker keeps extra named streams beside the accelerator's default one.
Megatron-style code runs dropout inside model-parallel regions under
``get_cuda_rng_tracker().fork()`` so that each model-parallel rank draws
different masks while data-parallel replicas draw the same. On a CPU-only
machine the "device" generator is the CPU generator, so the same code runs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from deepspeed.accelerator import get_accelerator

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
# Offset between the data-parallel seed and the model-parallel seed (documented formula:
# model-parallel seed = seed + 2718 + model-parallel rank).
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _device_is_cpu() -> bool:
    return get_accelerator().device_name() == "cpu"


def _set_cuda_rng_state(new_state: torch.Tensor, device=None) -> None:
    """Set the accelerator generator's state (the CPU generator on CPU-only machines)."""
    get_accelerator().set_rng_state(new_state, device if isinstance(device, int) and device >= 0 else None)


class CudaRNGStatesTracker:
    """Named RNG states of the accelerator generator.

    ``add(name, seed)`` creates a stream; ``fork(name)`` runs a block with that
    stream's state swapped in, saves the advanced state back, and returns the
    generator to where it was, so the default stream is unaffected.
    """

    def __init__(self):
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()
        self._seed_of: Dict[str, int] = {}

    def reset(self) -> None:
        """Forget every stream and seed."""
        self.states_ = {}
        self.seeds_ = set()
        self._seed_of = {}

    def remove(self, name: str) -> None:
        """Drop stream ``name`` (and free its seed) if it exists."""
        self.states_.pop(name, None)
        self.seeds_.discard(self._seed_of.pop(name, None))

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the name -> state map (safe to keep; later forks do not change it)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the tracked states (e.g. with a snapshot from ``get_states``)."""
        if not isinstance(states, dict):
            raise TypeError(f"CudaRNGStatesTracker.set_states expects a dict name -> state tensor, "
                            f"got {type(states).__name__}")
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; names and seeds must be unique."""
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"CudaRNGStatesTracker.add: seed must be an int, got {seed!r}")
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used by another stream; "
                             "each stream needs its own seed")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: an RNG stream named {name!r} already exists; "
                             "call reset() first to re-seed it")
        self.seeds_.add(seed)
        self._seed_of[name] = seed
        acc = get_accelerator()
        original = acc.get_rng_state()
        try:
            acc.manual_seed(seed)
            self.states_[name] = acc.get_rng_state().clone()
        finally:
            acc.set_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block on stream ``name``, then put the default stream back."""
        if name not in self.states_:
            raise KeyError(f"RNG stream {name!r} is not tracked (known: {sorted(self.states_)}); "
                           "create it with add(name, seed) or model_parallel_cuda_manual_seed(seed)")
        acc = get_accelerator()
        original = acc.get_rng_state()
        acc.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = acc.get_rng_state().clone()
            acc.set_rng_state(original)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide RNG tracker."""
    return _CUDA_RNG_STATE_TRACKER


def _model_parallel_rank(mpu=None) -> int:
    if mpu is None:
        from .settings import current_mpu
        mpu = current_mpu()
    return int(mpu.get_model_parallel_rank()) if mpu is not None else 0


def model_parallel_cuda_manual_seed(seed: int, mpu=None) -> None:
    """Seed the two documented streams.

    * default stream (``seed``): identical on every model-parallel rank; used for
      dropout outside model-parallel regions.
    * ``'model-parallel-rng'`` (``seed + 2718 + model_parallel_rank``): differs
      across model-parallel ranks; used inside ``get_cuda_rng_tracker().fork()``.

    Call after model parallelism is set up (``configure(mpu)``), and do not reseed
    the accelerator afterwards; this call replaces that.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"model_parallel_cuda_manual_seed: seed must be an int, got {seed!r}")
    mp_rank = _model_parallel_rank(mpu)
    model_parallel_seed = seed + _MODEL_PARALLEL_SEED_OFFSET + mp_rank
    get_accelerator().manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER.reset()
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


def model_parallel_reconfigure_tp_seed(seed: int, mpu=None) -> None:
    """Re-seed only the model-parallel stream (same formula), leaving the default stream alone."""
    model_parallel_seed = seed + _MODEL_PARALLEL_SEED_OFFSET + _model_parallel_rank(mpu)
    _CUDA_RNG_STATE_TRACKER.remove(_MODEL_PARALLEL_RNG_TRACKER_NAME)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


@dataclass
class RNGSnapshot:
    """Every RNG stream a checkpointed forward may draw from."""
    cpu: torch.Tensor
    device: Optional[torch.Tensor]
    tracker: Dict[str, torch.Tensor]

    @classmethod
    def capture(cls) -> "RNGSnapshot":
        device = None if _device_is_cpu() else get_accelerator().get_rng_state()
        return cls(torch.get_rng_state(), device, _CUDA_RNG_STATE_TRACKER.get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            get_accelerator().set_rng_state(self.device)
        _CUDA_RNG_STATE_TRACKER.set_states(self.tracker)


@contextlib.contextmanager
def rng_replay(snapshot: RNGSnapshot):
    """Run the block with ``snapshot`` restored, then return every stream to where it was."""
    current = RNGSnapshot.capture()
    snapshot.restore()
    try:
        yield
    finally:
        current.restore()
