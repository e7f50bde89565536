"""What an autotuning experiment's engine does: measure, write, stop.

Registered with the runtime's feature registry (``runtime/engine_features.py``), so the
engine never names the autotuner. Active when the config's ``autotuning.enabled`` is
true (the autotuner writes that into every experiment's config):

* **metric run** - every optimizer step's wall time is taken at the step boundary (the
  first step from the first training forward). Steps ``start_profile_step`` ..
  ``end_profile_step`` (0-based, inclusive; the ones before are warm-up) are the
  measurement window. After step ``end_profile_step`` (when ``global_steps`` reaches
  ``end_profile_step + 1``, DeepSpeed's exit point) rank 0 writes ``metric_path``
  (default ``./autotuning_metric.json``) and every rank exits with status 0. The file
  holds ``latency`` (ms per optimizer step, the window's mean), ``throughput``
  (``train_batch_size`` samples per second) and, when ``autotuning.metric`` is ``flops``,
  ``flops`` (= ``FLOPS_per_gpu``: this rank's floating-point operations per second, 3x the
  forward FLOPs counted by ``torch.utils.flop_counter`` on the first micro-batch, as
  DeepSpeed's engine takes forward + backward as 3x forward; counted only then because the
  counter's first use costs seconds of start-up).
* **model-info run** (``autotuning.model_info.profile: true``) - on the first training
  micro-batch it counts the parameters and the bytes of the tensors the forward saves for
  backward (the activation memory, parameters excluded), writes ``model_info_path``
  (default ``./autotuning_model_info.json``) and exits before the backward.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from ..runtime.engine_features import EngineFeature, register_feature


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fd:
        json.dump(data, fd, indent=2)
    os.replace(tmp, path)


def _leave() -> None:
    """End the experiment: every rank reaches this at the same step."""
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(0)


class AutotuningProbe(EngineFeature):
    name = "autotuning"

    def __init__(self, engine, section):
        self.rank = engine.global_rank
        self.start = section.start_profile_step
        self.end = section.end_profile_step
        self.metric_path = section.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")
        self.model_info_path = section.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json")
        self.profile_model_info = bool(section.model_info and section.model_info.get("profile", False))
        self.count_flops = section.metric == "flops"
        self.t_prev = None
        self.durations = []
        self.fwd_flops = None
        self._flop_mode = None
        self._saved_ctx = None
        self._saved_bytes = 0

    # ---------------------------------------------------------------- hooks
    def forward_kwargs(self, engine, kwargs) -> None:
        if self.t_prev is None:
            self.t_prev = time.perf_counter()
        if self.profile_model_info and self._saved_ctx is None:
            self._count_saved_tensors(engine)
        elif self.count_flops and self.fwd_flops is None and self._flop_mode is None:
            from torch.utils.flop_counter import FlopCounterMode
            self._flop_mode = FlopCounterMode(display=False)
            self._flop_mode.__enter__()

    def before_backward(self, engine, loss) -> None:
        if self._flop_mode is not None:
            self._flop_mode.__exit__(None, None, None)
            self.fwd_flops = self._flop_mode.get_total_flops()
            self._flop_mode = None
        if self.profile_model_info and self._saved_ctx is not None:
            self._saved_ctx.__exit__(None, None, None)
            self._write_model_info(engine)
            _leave()

    def after_step(self, engine) -> None:
        now = time.perf_counter()
        step = engine.global_steps - 1          # the step that just finished, 0-based
        if self.start <= step <= self.end and self.t_prev is not None:
            self.durations.append(now - self.t_prev)
        self.t_prev = now
        if engine.global_steps == self.end + 1:
            if self.rank == 0:
                _write_json(self.metric_path, self.metrics(engine))
            _leave()

    # ---------------------------------------------------------------- measurements
    def metrics(self, engine) -> dict:
        if not self.durations:
            raise RuntimeError("autotuning: no step fell in the profiling window "
                               f"[start_profile_step={self.start}, end_profile_step={self.end}]")
        mean_s = sum(self.durations) / len(self.durations)
        gas = engine.gradient_accumulation_steps()
        out = {"latency": mean_s * 1000.0, "throughput": engine.train_batch_size() / mean_s}
        if self.fwd_flops is not None:
            out["flops"] = out["FLOPS_per_gpu"] = 3.0 * self.fwd_flops * gas / mean_s
        return {**out, "step_times_s": self.durations, "train_batch_size": engine.train_batch_size(),
                "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
                "gradient_accumulation_steps": gas, "world_size": engine.world_size,
                "start_profile_step": self.start, "end_profile_step": self.end}

    def _count_saved_tensors(self, engine) -> None:
        param_storages = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
        seen = set()

        def pack(t):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in param_storages and ptr not in seen:
                    seen.add(ptr)
                    self._saved_bytes += t.untyped_storage().nbytes()
            return t

        self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._saved_ctx.__enter__()

    def _write_model_info(self, engine) -> None:
        if self.rank != 0:
            return
        params = list(engine.module.parameters())
        count = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)
        mbs = engine.train_micro_batch_size_per_gpu()
        _write_json(self.model_info_path, {
            "num_params": count, "trainable_num_params": trainable,
            "activation_mem_per_gpu": self._saved_bytes, "activation_mem_per_sample": self._saved_bytes / mbs,
            "train_micro_batch_size_per_gpu": mbs,
            "param_dtype_bytes": params[0].element_size() if params else 4})


def _factory(engine):
    s = getattr(engine.config_obj.model, "autotuning", None)
    if s is None or not s.enabled:
        return None
    return AutotuningProbe(engine, s)


register_feature("autotuning", _factory)
