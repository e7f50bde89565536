"""DeepSpeed's ``deepspeed.runtime.zero.linear``: a linear layer as one ``autograd.Function``.

``LinearFunctionForZeroStage3.apply(input, weight, bias)`` computes ``input @ weight.T + bias`` and
keeps only its inputs for backward, which computes the three gradients itself (a ZeRO-3 parameter
is gathered again for the backward by the stage-3 hooks, so no gathered copy of the weight is held
by the graph). It is written in the ``setup_context`` form, so ``torch.func`` transforms
(``grad``, ``grad_and_value``, ``vmap``) work through it. Autocast: the forward runs in the
autocast dtype when autocast is on; the backward replays the forward's autocast state (an autocast
region around ``backward()`` does not leak in), and gradients come back in the inputs' dtypes.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...accelerator import get_accelerator


def noop_decorator(func):
    return func


# DeepSpeed's module-level autocast decorators (torch.amp's, bound to the accelerator's device type)
autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=get_accelerator().device_name())
autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=get_accelerator().device_name())


def _device_type(t: torch.Tensor) -> str:
    return t.device.type if t.device.type in ("cpu", "cuda", "xpu", "hpu", "mps") else "cpu"


class LinearFunctionForZeroStage3(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(input, weight, bias=None):
        return F.linear(input, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias = (tuple(inputs) + (None,))[:3]
        device_type = _device_type(input)
        ctx._device_type = device_type
        ctx._fwd_used_autocast = torch.is_autocast_enabled(device_type)
        ctx._dtype = torch.get_autocast_dtype(device_type) if ctx._fwd_used_autocast else input.dtype
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        with torch.autocast(device_type=ctx._device_type, dtype=ctx._dtype, enabled=ctx._fwd_used_autocast):
            dtype = ctx._dtype if ctx._fwd_used_autocast else grad_output.dtype
            g = grad_output.to(dtype)
            w = weight.to(dtype)
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = g.matmul(w)
            if ctx.needs_input_grad[1]:
                g2 = g.reshape(-1, g.shape[-1])
                grad_weight = g2.t().matmul(input.to(dtype).reshape(-1, input.shape[-1]))
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = g.reshape(-1, g.shape[-1]).sum(0)
        # gradients in the inputs' dtypes (fp32 masters under autocast)
        return (None if grad_input is None else grad_input.to(input.dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype))


def zero3_linear_wrap(input, weight, bias=None):
    """``F.linear`` through :class:`LinearFunctionForZeroStage3` (DeepSpeed's name)."""
    if bias is None:
        return LinearFunctionForZeroStage3.apply(input, weight)
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(torch.nn.Module):
    """``torch.nn.Linear`` whose forward is :func:`zero3_linear_wrap` (same parameters, same init)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        ref = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.in_features, self.out_features = in_features, out_features
        self.weight = ref.weight
        self.bias = ref.bias

    def forward(self, input):
        return zero3_linear_wrap(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


__all__ = ["LinearFunctionForZeroStage3", "zero3_linear_wrap", "LinearModuleForZeroStage3", "autocast_custom_fwd",
           "autocast_custom_bwd", "noop_decorator"]
