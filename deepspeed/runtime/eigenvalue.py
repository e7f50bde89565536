"""The ``eigenvalue`` estimator: the dominant Hessian eigenvalue of each layer block.

For block ``k`` of the module list at ``layer_name`` (``layer_num`` blocks), power iteration
on Hessian-vector products ``H v = d(g . v)/dp`` (``g`` the loss gradient w.r.t. the
block's parameters, with its graph):

    v <- random normal, normalised;  repeat:  lambda <- <H v, v>;  v <- H v / (|H v| + stability)

until ``max_iter`` iterations or the relative change of ``lambda`` falls below ``tol``.
:meth:`Eigenvalue.compute_eigenvalue` returns DeepSpeed's form, ``{id(param): (value, block)}``
with each block's value divided by the largest magnitude (so in [0, 1]; a block whose
estimate is 0 gets 1.0); the raw estimates are in ``last_eigenvalues``.

In the engine (config section ``eigenvalue``), every ``gas_boundary_resolution``-th
accumulation boundary the estimate is computed from the boundary micro-batch's loss
before its backward (one extra double-backward per iteration; the training gradients
are not touched), kept in ``engine.block_eigenvalue`` and written to the monitors as
``Train/Eigenvalues/ModelBlockParam_{k}``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..utils.logging import log_dist, logger
from .engine_features import EngineFeature, register_feature


class Eigenvalue:

    def __init__(self, verbose=False, max_iter=100, tol=1e-2, stability=0, gas_boundary_resolution=1,
                 layer_name="", layer_num=0):
        if not layer_name or layer_num < 1:
            raise ValueError(f"eigenvalue: 'layer_name' must name the model's list of blocks and 'layer_num' must be "
                             f">= 1 (got layer_name={layer_name!r}, layer_num={layer_num}).")
        self.verbose = verbose
        self.max_iter = max_iter
        self.tol = tol
        self.stability = stability
        self.gas_boundary_resolution = gas_boundary_resolution
        self.layer_name = layer_name
        self.layer_num = layer_num
        self.last_eigenvalues: List[float] = []
        log_dist(f"enabled eigenvalue with verbose={verbose}, max_iter={max_iter}, tol={tol}, stability={stability}, "
                 f"gas_boundary_resolution={gas_boundary_resolution}, layer_name={layer_name}, layer_num={layer_num}",
                 ranks=[0])

    @staticmethod
    def nan_to_num(x: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    @staticmethod
    def inner_product(xs, ys):
        return sum(torch.sum(x * y) for x, y in zip(xs, ys))

    def normalize(self, v):
        norm = self.inner_product(v, v) ** 0.5 + self.stability
        return [self.nan_to_num(x / norm) for x in v]

    def get_layers(self, module):
        m = module
        for name in self.layer_name.split("."):
            if not hasattr(m, name):
                raise ValueError(f"eigenvalue.layer_name {self.layer_name!r}: {type(m).__name__} has no attribute "
                                 f"{name!r}; name the model's list of blocks (e.g. 'bert.encoder.layer').")
            m = getattr(m, name)
        try:
            n = len(m)
        except TypeError:
            raise ValueError(f"eigenvalue.layer_name {self.layer_name!r} is a {type(m).__name__}, not a list of "
                             f"blocks (a ModuleList or Sequential).") from None
        if n < self.layer_num:
            raise ValueError(f"eigenvalue.layer_num is {self.layer_num} but {self.layer_name!r} has {n} blocks.")
        return m

    def _power_iteration(self, grads, params, device, scale: float) -> Tuple[float, int]:
        gen = torch.Generator().manual_seed(0)  # same start on every rank and every call
        v = [torch.randn(p.size(), generator=gen).to(device if device is not None else p.device) for p in params]
        v = self.normalize(v)
        i, current, previous = 0, 1.0, 0.0
        while i < self.max_iter and abs(current) > 0 and abs((current - previous) / current) >= self.tol:
            previous = current
            hv = torch.autograd.grad(grads, params, grad_outputs=v, only_inputs=True, retain_graph=True,
                                     allow_unused=True)
            hv = [self.nan_to_num(h).float() if h is not None else torch.zeros_like(p, dtype=torch.float32)
                  for h, p in zip(hv, params)]
            current = self.inner_product(hv, v).item()
            v = [x / scale for x in self.normalize(hv)]
            i += 1
        return current * scale, i

    def _finish(self, raw: List[float], param_keys) -> Dict[int, Tuple[float, int]]:
        self.last_eigenvalues = list(raw)
        values = self.post_process(raw)
        if self.verbose:
            log_dist(f"eigenvalues per block: {raw}; post-processed: {values}", ranks=[0])
        out = {}
        for k, (keys, value) in enumerate(zip(param_keys, values)):
            out.update(dict.fromkeys(keys, (value, k)))
        return out

    def compute_eigenvalue(self, module, device=None, scale=1.0):
        """DeepSpeed's entry: the blocks' parameters must hold gradients with their graph
        (a backward with ``create_graph=True``)."""
        layers = self.get_layers(module)
        raw, keys = [], []
        for k in range(self.layer_num):
            block = layers[k]
            pairs = [(p, p.grad) for p in block.parameters() if p.grad is not None and p.grad.grad_fn is not None]
            keys.append([id(p) for p in block.parameters()])
            if not pairs:
                log_dist("The model does NOT support eigenvalue computation (no gradient graph; run the backward "
                         "with create_graph=True).", ranks=[0])
                return {}
            ev, _ = self._power_iteration([g for _, g in pairs], [p for p, _ in pairs], device, scale)
            raw.append(ev)
        return self._finish(raw, keys)

    def compute_eigenvalue_from_loss(self, loss: torch.Tensor, module, device=None):
        """The same, from a loss whose graph is still alive (the graph is kept for the caller's backward)."""
        layers = self.get_layers(module)
        raw, keys = [], []
        for k in range(self.layer_num):
            params = [p for p in layers[k].parameters() if p.requires_grad]
            keys.append([id(p) for p in layers[k].parameters()])
            grads = torch.autograd.grad(loss, params, create_graph=True, retain_graph=True, allow_unused=True)
            used = [(p, g) for p, g in zip(params, grads) if g is not None]
            if not used:
                raw.append(0.0)
                continue
            ev, iters = self._power_iteration([g for _, g in used], [p for p, _ in used], device, 1.0)
            if self.verbose:
                log_dist(f"block: {k}, power iteration: {iters}, eigenvalue: {ev}", ranks=[0])
            raw.append(ev)
        return self._finish(raw, keys)

    @staticmethod
    def post_process(value_list):
        """Map the estimates to [0, 1] by the largest magnitude; a 0 estimate becomes 1.0."""
        if not value_list:
            return []
        biggest = max(abs(v) for v in value_list)
        return [abs(v) / biggest if v != 0.0 and biggest > 0 else 1.0 for v in value_list]


class _EigenvalueFeature(EngineFeature):
    name = "eigenvalue"

    def __init__(self, engine, ev: Eigenvalue):
        self.ev = ev
        self.gas_boundary_ctr = 0
        self.fresh: Optional[dict] = None

    def before_backward(self, engine, loss):
        if not engine.is_gradient_accumulation_boundary():
            return
        if (self.gas_boundary_ctr + 1) % self.ev.gas_boundary_resolution:
            return
        with torch.enable_grad():
            engine.block_eigenvalue = self.ev.compute_eigenvalue_from_loss(loss, engine.module, engine.device)
        self.fresh = engine.block_eigenvalue

    def on_boundary(self, engine):
        self.gas_boundary_ctr += 1
        if self.fresh is None:
            return
        if engine.monitor.enabled and engine.global_rank == 0:
            samples = engine.global_samples + engine.train_batch_size()  # as logged after the step
            engine.monitor.write_events([(f"Train/Eigenvalues/ModelBlockParam_{k}", v, samples)
                                         for k, v in enumerate(self.ev.post_process(self.ev.last_eigenvalues))])
        self.fresh = None


def _factory(engine):
    s = engine.config_obj.model.eigenvalue
    engine.eigenvalue = None
    engine.block_eigenvalue = None
    if s is None or not s.enabled:
        return None
    if engine.zero_optimization_partition_weights():
        raise ValueError("eigenvalue: not available with zero_optimization.stage 3 (the blocks' parameters are "
                         "partitioned outside the forward); use stage 0-2 or disable the 'eigenvalue' section.")
    ev = Eigenvalue(verbose=s.verbose, max_iter=s.max_iter, tol=s.tol, stability=s.stability,
                    gas_boundary_resolution=s.gas_boundary_resolution, layer_name=s.layer_name,
                    layer_num=s.layer_num)
    ev.get_layers(engine.module)  # a wrong layer_name / layer_num fails now, before training
    engine.eigenvalue = ev
    logger.debug("eigenvalue estimator attached")
    return _EigenvalueFeature(engine, ev)


register_feature("eigenvalue", _factory)
