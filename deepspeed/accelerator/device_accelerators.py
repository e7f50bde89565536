"""Accelerators for the other device types DeepSpeed ships (xpu, npu, mps, hpu, mlu, sdaa).

One shared base, ``TorchDeviceAccelerator``, implements the whole
:class:`~deepspeed.accelerator.abstract.DeepSpeedAccelerator` interface by delegating to
PyTorch's device module for the type (``torch.xpu``, ``torch.mps``, or the ``torch.npu``
/ ``torch.hpu`` / ``torch.mlu`` / ``torch.sdaa`` a vendor plugin registers). Each class
only names its device, its communication backend and its visible-devices variable.

Where the device (or its plugin) is absent, as on this machine, the accelerator says so:
``is_available()`` is False and ``device_count()`` 0; a call that needs the device raises
:class:`AcceleratorUnavailableError` naming the device and what to install. Only CPU and
CUDA are verified end to end in this version.
"""
from __future__ import annotations

import contextlib

import torch

from .abstract import DeepSpeedAccelerator


class AcceleratorUnavailableError(RuntimeError):
    """An accelerator call that needs a device this machine does not have."""


class TorchDeviceAccelerator(DeepSpeedAccelerator):
    _name = ""
    _communication_backend_name = ""
    _visible_devices_env = ""
    _plugin_hint = ""  # what provides torch.<name> when PyTorch itself does not

    def _module(self):
        return getattr(torch, self._name, None)

    def is_available(self) -> bool:
        mod = self._module()
        try:
            return bool(mod is not None and mod.is_available())
        except Exception:  # a half-installed plugin must not break a capability probe
            return False

    def _need(self, attr: str = None):
        mod = self._module()
        if mod is None or not self.is_available():
            why = (f"torch.{self._name} is not present" + (f" (it comes with {self._plugin_hint})" if self._plugin_hint
                                                            else "")) if mod is None else \
                f"torch.{self._name}.is_available() is False on this machine"
            raise AcceleratorUnavailableError(
                f"the '{self._name}' accelerator is not available: {why}. Use DS_ACCELERATOR=cpu or cuda, "
                f"or run on a machine with a {self._name} device.")
        if attr is None:
            return mod
        fn = getattr(mod, attr, None)
        if fn is None:
            raise AcceleratorUnavailableError(f"torch.{self._name} has no '{attr}'; this accelerator call is not "
                                              f"supported by the installed PyTorch / plugin.")
        return fn

    # -- the abstract interface ------------------------------------------------
    def device(self, device_index=None):
        if self._module() is None:  # PyTorch does not even know the device type without the plugin
            self._need()
        return super().device(device_index)

    def device_count(self) -> int:
        return int(self._module().device_count()) if self.is_available() else 0

    def current_device(self) -> int:
        return self._need("current_device")()

    def set_device(self, device_index) -> None:
        self._need("set_device")(device_index)

    def synchronize(self, device_index=None) -> None:
        return self._need("synchronize")(device_index) if device_index is not None else self._need("synchronize")()

    def get_rng_state(self, device_index=None):
        fn = self._need("get_rng_state")
        return fn() if device_index is None else fn(device_index)

    def set_rng_state(self, new_state, device_index=None) -> None:
        fn = self._need("set_rng_state")
        fn(new_state) if device_index is None else fn(new_state, device_index)

    def manual_seed(self, seed: int) -> None:
        self._need("manual_seed")(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._need("manual_seed_all")(seed)

    def memory_allocated(self, device_index=None) -> int:
        fn = self._need("memory_allocated")
        return fn() if device_index is None else fn(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        fn = self._need("max_memory_allocated")
        return fn() if device_index is None else fn(device_index)

    def reset_peak_memory_stats(self, device_index=None) -> None:
        fn = self._need("reset_peak_memory_stats")
        fn() if device_index is None else fn(device_index)

    def empty_cache(self) -> None:
        if self.is_available():
            self._need("empty_cache")()

    def total_memory(self, device_index=None) -> int:
        return self._need("get_device_properties")(device_index or 0).total_memory

    def available_memory(self, device_index=None) -> int:
        return self._need("mem_get_info")(device_index or 0)[0]

    def is_bf16_supported(self) -> bool:
        return self.is_available()

    def is_fp16_supported(self) -> bool:
        return self.is_available()

    def supported_dtypes(self):
        return [torch.float32, torch.float16, torch.bfloat16] if self.is_available() else []

    def _torch_pin_memory(self, tensor):
        if not self.is_available():
            return tensor
        from ..utils.pin_memory_tracker import track_pinned_memory
        track_pinned_memory(tensor.nbytes)
        return tensor.pin_memory()

    def _torch_is_pinned(self, tensor) -> bool:
        return tensor.is_pinned() if self.is_available() else False

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == self._name

    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's spelling
        return self._need("Stream")(*args, **kwargs)

    def stream(self, stream):
        return self._need("stream")(stream) if stream is not None else contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return self._need("current_stream")(device_index)

    def Event(self, **kwargs):  # noqa: N802
        return self._need("Event")(**kwargs)

    def visible_devices_envs(self):
        return [self._visible_devices_env] if self._visible_devices_env else []


class XPU_Accelerator(TorchDeviceAccelerator):  # noqa: N801 - DeepSpeed's class names
    _name, _communication_backend_name, _visible_devices_env = "xpu", "xccl", "ZE_AFFINITY_MASK"


class NPU_Accelerator(TorchDeviceAccelerator):  # noqa: N801
    _name, _communication_backend_name, _visible_devices_env = "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES"
    _plugin_hint = "Huawei's torch_npu"


class MPS_Accelerator(TorchDeviceAccelerator):  # noqa: N801
    _name, _communication_backend_name = "mps", ""  # no distributed backend on Apple GPUs

    def current_device(self) -> int:
        self._need()
        return 0  # one Apple GPU

    def set_device(self, device_index) -> None:
        self._need()
        if device_index not in (0, None):
            raise AcceleratorUnavailableError(f"mps has one device (0), got {device_index}")


class HPU_Accelerator(TorchDeviceAccelerator):  # noqa: N801
    _name, _communication_backend_name, _visible_devices_env = "hpu", "hccl", "HABANA_VISIBLE_MODULES"
    _plugin_hint = "Intel Gaudi's habana_frameworks.torch"


class MLU_Accelerator(TorchDeviceAccelerator):  # noqa: N801
    _name, _communication_backend_name, _visible_devices_env = "mlu", "cncl", "MLU_VISIBLE_DEVICES"
    _plugin_hint = "Cambricon's torch_mlu"


class SDAA_Accelerator(TorchDeviceAccelerator):  # noqa: N801
    _name, _communication_backend_name, _visible_devices_env = "sdaa", "tccl", "SDAA_VISIBLE_DEVICES"
    _plugin_hint = "Tecorigin's torch_sdaa"


class SUPA_Accelerator(TorchDeviceAccelerator):  # noqa: N801
    _name, _communication_backend_name, _visible_devices_env = "supa", "bccl", "SUPA_VISIBLE_DEVICES"
    _plugin_hint = "Biren's torch_supa"


OTHER_ACCELERATORS = {cls._name: cls for cls in (XPU_Accelerator, NPU_Accelerator, MPS_Accelerator, HPU_Accelerator,
                                                 MLU_Accelerator, SDAA_Accelerator, SUPA_Accelerator)}
