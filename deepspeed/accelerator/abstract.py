"""The accelerator interface. CPU is a first-class device, not a fallback."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch


class DeepSpeedAccelerator(ABC):
    _name: str = ""
    _communication_backend_name: str = ""

    # -- identity -----------------------------------------------------------
    def device_name(self, device_index=None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        """True where work runs synchronously with the host (the CPU): no streams, nothing to
        overlap. DeepSpeed's name; code that offloads asynchronously checks it."""
        return False

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def current_device(self) -> int: ...

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    @abstractmethod
    def set_device(self, device_index) -> None: ...

    def synchronize(self, device_index=None) -> None:
        return None

    # -- RNG -------------------------------------------------------------------
    @abstractmethod
    def get_rng_state(self, device_index=None) -> torch.Tensor: ...

    @abstractmethod
    def set_rng_state(self, new_state, device_index=None) -> None: ...

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index=None):
        return torch.default_generator

    # -- memory ----------------------------------------------------------------
    @abstractmethod
    def memory_allocated(self, device_index=None) -> int: ...

    @abstractmethod
    def max_memory_allocated(self, device_index=None) -> int: ...

    def reset_peak_memory_stats(self, device_index=None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def total_memory(self, device_index=None) -> int:
        import psutil
        return psutil.virtual_memory().total

    def available_memory(self, device_index=None) -> int:
        import psutil
        return psutil.virtual_memory().available

    # -- dtypes / features -------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self):
        return [torch.float32, torch.float16, torch.bfloat16]

    # Pinning. DS_PIN_MEMORY_BACKEND=native sends these three calls to the process-wide manager in
    # deepspeed/utils/pin_memory.py (page-locked copies, with or without a device); otherwise the
    # device's torch pinning, _torch_pin_memory / _torch_is_pinned (nothing to pin on the CPU).
    def pin_memory(self, tensor, make_copy=True, match_shape=True, align_bytes=1):
        """A pinned version of ``tensor``. Native backend: a page-locked copy (``make_copy=False``:
        contents undefined; ``match_shape=False``: flat); torch backend: ``_torch_pin_memory``."""
        from ..utils.pin_memory import get_active_native_pinned_memory
        native = get_active_native_pinned_memory()
        if native is None:
            return self._torch_pin_memory(tensor)
        from ..utils.pin_memory_tracker import track_pinned_memory
        track_pinned_memory(tensor.nbytes)
        return native.pin(tensor, make_copy=make_copy, match_shape=match_shape)

    def _torch_pin_memory(self, tensor):
        return tensor

    def is_pinned(self, tensor) -> bool:
        from ..utils.pin_memory import get_active_native_pinned_memory
        native = get_active_native_pinned_memory()
        return self._torch_is_pinned(tensor) if native is None else native.is_pinned(tensor)

    def _torch_is_pinned(self, tensor) -> bool:
        return False

    def unpin_memory(self, tensor):
        """Release pinning done by :meth:`pin_memory`. Native backend: frees the page-locked
        allocation, True (False if already freed); torch backend: None, as DeepSpeed's
        (torch-pinned memory is freed when the tensor is garbage collected)."""
        from ..utils.pin_memory import get_active_native_pinned_memory
        native = get_active_native_pinned_memory()
        return None if native is None else native.unpin(tensor)

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == self._name

    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's spelling
        return None

    def stream(self, stream):
        import contextlib
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return None

    def Event(self, **kwargs):  # noqa: N802
        return None

    def visible_devices_envs(self):
        return []

    def set_visible_devices_envs(self, current_env, local_accelerator_ids):
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    # -- op builders (DeepSpeed's accelerator interface) -----------------------------------------
    def op_builder_dir(self) -> str:
        """The package holding the op builders."""
        return "deepspeed.ops.op_builder"

    def get_op_builder(self, class_name: str):
        """The op-builder class named ``class_name`` (``"CPUAdamBuilder"``, ``"FusedAdamBuilder"``,
        ...), or None when DeepSpeed has no such builder. Ours load PyTorch-native
        implementations; ``builder.is_compatible()`` says whether one is built here."""
        from ..ops.op_builder.builders import BUILDERS
        return BUILDERS.get(class_name)

    def create_op_builder(self, class_name: str):
        """An instance of :meth:`get_op_builder`'s class (None when there is none)."""
        cls = self.get_op_builder(class_name)
        return cls() if cls is not None else None
