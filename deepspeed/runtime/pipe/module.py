"""``PipelineModule``: a model described as a sequence of layers, built split into stages.

Each rank builds only the layers of its own stage (a :class:`LayerSpec` is a recipe,
so a model too big for one process can still be described in full). Parameter
names are global and stage-independent (``"<layer index>.<param>"``; tied modules
``"tied_modules.<key>.<param>"``), which is what lets a checkpoint saved with one
number of stages load with another.

Tied layers (:class:`TiedLayerSpec`, e.g. the token embedding reused as the LM head)
are built on every stage that uses them. The lowest such stage *owns* the weights:
its copy is the one updated with the gradient summed over all holding stages, and
after each step it is broadcast to the others (see :mod:`.engine`).
"""
from __future__ import annotations

import os
import re
from functools import partial
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...utils.logging import log_dist, logger
from .partition import partition_layers
from .topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology


class PipelineError(Exception):
    """Errors related to the use of ``deepspeed.runtime.pipe``."""


class LayerSpec:
    """Recipe for one layer: ``LayerSpec(torch.nn.Linear, 4, 8, bias=False)`` builds
    ``torch.nn.Linear(4, 8, bias=False)`` only on the stage that owns it."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}.")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log=False):
        if log:
            logger.info(f"building {self!r}")
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self):
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights (``tied_weight_attr``) are shared by every occurrence of ``key``.
    ``forward_fn(module, x)`` replaces ``module(x)`` at an occurrence when given."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr="weight", **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = str(key)
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _layer_name(spec) -> str:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", type(spec).__name__)


class _SkipRandomInit(torch.overrides.TorchFunctionMode):
    """Random in-place initialisers become no-ops (meta tensors hold no values anyway; this
    also keeps the meta build off the slow reference-op path)."""

    _SKIP = {"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
             "cauchy_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self._SKIP:
            target = next((t for t in list(args) + list(kwargs.values()) if torch.is_tensor(t)), None)
            if target is not None and target.is_meta:
                return target
        return func(*args, **kwargs)


def _count_params(spec) -> int:
    if isinstance(spec, LayerSpec):
        with torch.device("meta"), _SkipRandomInit():
            mod = spec.build()
        return sum(p.numel() for p in mod.parameters() if p.requires_grad)
    if isinstance(spec, nn.Module):
        return sum(p.numel() for p in spec.parameters() if p.requires_grad)
    return 0


class PipelineModule(nn.Module):
    """Modules to be parallelized with pipeline parallelism (see ``docs/pipeline.md``)."""

    def __init__(self, layers, num_stages: Optional[int] = None, topology: Optional[ProcessTopology] = None,
                 loss_fn: Optional[Callable] = None, seed_layers: bool = False, seed_fn: Optional[Callable] = None,
                 base_seed: int = 1234, partition_method="parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func=None, checkpointable_layers=None, chunks_per_stage: int = 1):
        super().__init__()
        if int(chunks_per_stage) < 1:
            raise ValueError(f"PipelineModule: chunks_per_stage must be >= 1, got {chunks_per_stage}.")
        if num_stages is None and topology is None:
            raise RuntimeError("PipelineModule: give num_stages or topology.")
        if not (dist.is_available() and dist.is_initialized()):
            from ... import comm
            comm.init_distributed(verbose=False)
        world = dist.get_world_size()
        if topology is None:
            if num_stages < 1 or world % num_stages:
                raise RuntimeError(f"PipelineModule: num_stages={num_stages} must divide the world size {world}.")
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        elif num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise RuntimeError(f"PipelineModule: num_stages={num_stages} differs from the topology's pipe "
                               f"dimension {topology.get_dim('pipe')}.")
        if activation_checkpoint_interval < 0:
            raise ValueError("PipelineModule: activation_checkpoint_interval must be >= 0.")
        self._topo = topology
        self._grid = PipelineParallelGrid(topology)
        self.num_stages = self._grid.pipe_parallel_size
        self.stage_id = self._grid.stage_id
        self.global_rank = dist.get_rank()
        self.world_size = world
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        if activation_checkpoint_func is None:
            from ..activation_checkpointing.checkpointing import checkpoint
            activation_checkpoint_func = checkpoint
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError(f"PipelineModule: checkpointable_layers must be a list of layer class names, got "
                            f"{type(checkpointable_layers).__name__}.")
        # per block of activation_checkpoint_interval layers (from this stage's first layer):
        # checkpointed or not; rebuilt whenever the interval changes (set_checkpoint_interval)
        self.is_checkpointable_results: List[bool] = []
        self.is_checkpointable_results_interval = None
        self.partition_method = partition_method
        # interleaved pipelines: the layers are split into num_stages * chunks_per_stage
        # virtual stages; stage s holds virtual stages s, s + p, s + 2p, ...
        self.chunks_per_stage = int(chunks_per_stage)

        if isinstance(layers, nn.Sequential):
            layers = list(layers.children())
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        names = [_layer_name(s) for s in self._layer_specs]
        counts = [_count_params(s) for s in self._layer_specs]
        self.num_virtual_stages = self.num_stages * self.chunks_per_stage
        self.parts = partition_layers(partition_method, self.num_virtual_stages, names, counts)
        self._log_partition(names, counts)
        p = self.num_stages
        self._chunk_ranges = [(self.parts[c * p + self.stage_id], self.parts[c * p + self.stage_id + 1])
                              for c in range(self.chunks_per_stage)]
        self._local_layer_ids = [i for a, b in self._chunk_ranges for i in range(a, b)]
        self._local_start, self._local_stop = self._chunk_ranges[0][0], self._chunk_ranges[-1][1]
        self._chunk_funcs = []        # (start, end) into forward_funcs per chunk
        pos = 0
        for a, b in self._chunk_ranges:
            self._chunk_funcs.append((pos, pos + b - a))
            pos += b - a

        self.forward_funcs: List[Callable] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs = {}
        self._build()
        self._tied_info = self._index_tied_modules()

    # ------------------------------------------------------------------ construction
    def _log_partition(self, names, counts):
        lines = [f"Partitioning pipeline stages with method {self.partition_method}"]
        for vs in range(self.num_virtual_stages):
            a, b = self.parts[vs], self.parts[vs + 1]
            chunk = f" chunk={vs // self.num_stages}" if self.chunks_per_stage > 1 else ""
            lines.append(f"stage={vs % self.num_stages}{chunk} layers={b - a} [{a}, {b}) params={sum(counts[a:b])}")
            for i in range(a, b):
                lines.append(f"    {i:2d}: {names[i]}")
        if self.loss_fn is not None:
            lines.append(f"  loss: {getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}")
        self.partition_log = "\n".join(lines)
        log_dist(self.partition_log, ranks=[0])

    def _seed(self, idx):
        if self.seed_layers:
            (self.seed_fn or torch.manual_seed)(self.base_seed + idx)

    def _build(self):
        for idx in self._local_layer_ids:
            spec = self._layer_specs[idx]
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self._seed(idx)
                    self.tied_modules[spec.key] = spec.build()
                    self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                mod = self.tied_modules[spec.key]
                self.forward_funcs.append(partial(spec.forward_fn, mod) if spec.forward_fn else mod)
            elif isinstance(spec, LayerSpec):
                self._seed(idx)
                mod = spec.build()
                self.add_module(str(idx), mod)
                self.forward_funcs.append(mod)
            elif isinstance(spec, nn.Module):
                self.add_module(str(idx), spec)
                self.forward_funcs.append(spec)
            elif callable(spec):
                self.forward_funcs.append(spec)
            else:
                raise TypeError(f"PipelineModule: layer {idx} is {type(spec).__name__}; layers must be "
                                f"LayerSpec, TiedLayerSpec, torch.nn.Module or callables.")

    def _index_tied_modules(self):
        """Per tied key: holding stages, owner, and a process group per (data, model)
        coordinate. Every rank creates every group, in the same order."""
        info = {}
        stages_of = {}
        for vs in range(self.num_virtual_stages):
            s = vs % self.num_stages
            for idx in range(self.parts[vs], self.parts[vs + 1]):
                spec = self._layer_specs[idx]
                if isinstance(spec, TiedLayerSpec):
                    stages_of.setdefault(spec.key, [])
                    if s not in stages_of[spec.key]:
                        stages_of[spec.key].append(s)
        topo = self._topo
        dp, mp = max(topo.get_dim("data"), 1), max(topo.get_dim("model"), 1)
        for key in sorted(stages_of):
            stages = stages_of[key]
            entry = {"stages": stages, "owner": min(stages), "group": None, "ranks": None}
            if len(stages) > 1:
                for d in range(dp):
                    for m in range(mp):
                        coords = {"data": d} if "data" in topo.axes else {}
                        if "model" in topo.axes:
                            coords["model"] = m
                        ranks = [topo.get_rank(pipe=s, **coords) for s in stages]
                        g = dist.new_group(ranks=ranks)
                        if self.global_rank in ranks:
                            entry["group"], entry["ranks"] = g, ranks
            if key in self.tied_modules:
                info[key] = entry
        return info

    def tied_weights(self, key):
        mod = self.tied_modules[key]
        return [getattr(mod, a) for a in self.tied_weight_attrs[key]]

    def is_tied_owner(self, key) -> bool:
        return self._tied_info[key]["owner"] == self.stage_id

    def synchronize_tied_weights(self):
        """Copy the owner stage's tied weights to the other holding stages."""
        for key, info in self._tied_info.items():
            if info["group"] is None:
                continue
            src = info["ranks"][info["stages"].index(info["owner"])]
            for w in self.tied_weights(key):
                dist.broadcast(w.data, src=src, group=info["group"])

    def allreduce_tied_weight_gradients(self):
        """Sum the gradients of tied weights over the stages that hold them."""
        for key, info in self._tied_info.items():
            if info["group"] is None:
                continue
            for w in self.tied_weights(key):
                if w.grad is not None:
                    dist.all_reduce(w.grad, group=info["group"])

    # ------------------------------------------------------------------ forward
    def _is_checkpointable(self, funcs) -> bool:
        """Whether a block of layers is checkpointed: with ``checkpointable_layers``, when every
        layer's class is listed; otherwise when some layer holds parameters. Megatron's GPT pipes
        (``GPTModelPipe``/``GPT2ModelPipe``) under the reentrant function checkpoint only their
        transformer layers (and listed classes), as in DeepSpeed."""
        from ..activation_checkpointing.checkpointing import non_reentrant_checkpoint
        if (self.activation_checkpoint_func is not non_reentrant_checkpoint
                and type(self).__name__ in ("GPTModelPipe", "GPT2ModelPipe")):
            listed = self.checkpointable_layers or ()
            return all("ParallelTransformerLayerPipe" in type(f).__name__ or type(f).__name__ in listed
                       for f in funcs)
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def _precompute_checkpointable_values(self) -> None:
        """Fill ``is_checkpointable_results`` (one entry per block of ``activation_checkpoint_interval``
        layers of this stage) for the current interval; nothing to do when it is 0 or already done."""
        interval = self.activation_checkpoint_interval
        if interval > 0 and self.is_checkpointable_results_interval != interval:
            n = len(self.forward_funcs)
            self.is_checkpointable_results = [self._is_checkpointable(self.forward_funcs[a:min(a + interval, n)])
                                              for a in range(0, n, interval)]
            self.is_checkpointable_results_interval = interval

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint activations every ``interval`` layers from now on (0: off)."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"PipelineModule.set_checkpoint_interval: interval must be an int >= 0 "
                             f"(0 disables activation checkpointing), got {interval!r}.")
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def _exec_range(self, start, end):
        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for f in self.forward_funcs[start:end]:
                x = f(x)
            return x
        return run

    def forward(self, forward_input):
        if self.chunks_per_stage > 1:
            raise PipelineError("This PipelineModule is interleaved (chunks_per_stage > 1): call "
                                "forward_chunk(chunk_id, x) for one chunk (the engine does).")
        return self._forward_range(0, len(self.forward_funcs), forward_input)

    def forward_chunk(self, chunk_id: int, forward_input):
        """Run this stage's layers of chunk ``chunk_id`` (virtual stage ``chunk_id * p + stage``)."""
        return self._forward_range(*self._chunk_funcs[chunk_id], forward_input)

    def _forward_range(self, lo, hi, forward_input):
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return self._exec_range(lo, hi)(forward_input)
        x = forward_input
        whole = lo == 0 and hi == len(self.forward_funcs)   # one chunk per stage: the cached blocks
        if whole:
            self._precompute_checkpointable_values()
        for k, start in enumerate(range(lo, hi, interval)):
            end = min(start + interval, hi)
            funcs = self.forward_funcs[start:end]
            args = x if isinstance(x, tuple) else (x,)
            if self.is_checkpointable_results[k] if whole else self._is_checkpointable(funcs):
                x = self.activation_checkpoint_func(self._exec_range(start, end), *args)
            else:
                x = self._exec_range(start, end)(*args)
        return x

    # ------------------------------------------------------------------ queries
    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer index {layer_idx} outside 0..{self._num_layers - 1}")
        for vs in range(self.num_virtual_stages):
            if self.parts[vs] <= layer_idx < self.parts[vs + 1]:
                return vs % self.num_stages
        raise AssertionError("unreachable")

    def local_layers(self):
        """(global layer index, layer object) for this stage's layers."""
        return list(zip(self._local_layer_ids, self.forward_funcs))

    # ------------------------------------------------------------------ checkpoints by layer
    def ckpt_prefix(self, checkpoints_path, tag):
        """Prefix of the checkpoint files this module writes."""
        return os.path.join(checkpoints_path, str(tag))

    def ckpt_layer_path(self, ckpt_dir, local_layer_idx):
        """File of local layer ``local_layer_idx``: ``layer_XX[-model_YY]-model_states.pt``."""
        idx = self._local_layer_ids[local_layer_idx]
        path = os.path.join(ckpt_dir, f"layer_{idx:02d}")
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        if rank_repr:
            path += f"-{rank_repr}"
        return path + "-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx):
        idx = self._local_layer_ids[local_layer_idx]
        rx = re.compile(rf"^layer_{idx:02d}(-model_\d+)?-model_states\.pt$")
        return sorted(os.path.join(ckpt_dir, n) for n in os.listdir(ckpt_dir) if rx.match(n))

    def _layer_module(self, func):
        if isinstance(func, partial) and isinstance(func.args[0], nn.Module):
            return func.args[0]
        return func if isinstance(func, nn.Module) else None

    def save_state_dict(self, save_dir, checkpoint_engine=None, exclude_frozen_params=False):
        """Write one file per layer of this stage (data-parallel rank 0 only), atomically."""
        from ...checkpoint.utils import clone_tensors_for_torch_save
        from ..checkpoint.io import atomic_torch_save
        if self._grid.data_parallel_id != 0:
            return
        os.makedirs(save_dir, exist_ok=True)
        for local, func in enumerate(self.forward_funcs):
            mod = self._layer_module(func)
            if mod is None:
                continue
            sd = mod.state_dict()
            if exclude_frozen_params:
                frozen = {n for n, p in mod.named_parameters() if not p.requires_grad}
                sd = {k: v for k, v in sd.items() if k not in frozen}
            if not sd:
                continue
            sd = clone_tensors_for_torch_save(sd)
            path = self.ckpt_layer_path(save_dir, local)
            if checkpoint_engine is not None:
                checkpoint_engine.save(sd, path)
            else:
                atomic_torch_save(sd, path)

    def load_state_dir(self, load_dir, checkpoint_engine=None, strict=True):
        """Load this stage's layers from ``layer_XX-model_states.pt`` files (written with any
        number of stages)."""
        from ..checkpoint.errors import CheckpointError
        for local, func in enumerate(self.forward_funcs):
            mod = self._layer_module(func)
            if mod is None or not mod.state_dict():
                continue
            path = self.ckpt_layer_path(load_dir, local)
            if not os.path.isfile(path):
                raise CheckpointError(f"Pipeline checkpoint '{load_dir}' has no file '{os.path.basename(path)}' "
                                      f"for layer {self._local_layer_ids[local]}; was it saved from this model?")
            from ..checkpoint.io import load_file   # the one verified weights-only reader
            sd = (checkpoint_engine.load(path, map_location="cpu") if checkpoint_engine is not None
                  else load_file(path))
            try:
                mod.load_state_dict(sd, strict=strict)
            except RuntimeError as err:
                raise CheckpointError(f"'{path}' does not match layer {self._local_layer_ids[local]}: {err}") from None
