"""``PipelineEngine``: trains a :class:`PipelineModule` split into stages.

It subclasses the facade and replaces only the training entry points: ``train_batch``
and ``eval_batch`` run a schedule (:mod:`.schedule`) through a small interpreter,
one method per instruction class (``_INSTRUCTIONS``). Everything else is reused:

* data-parallel gradient reduction, precision, clipping and the optimizer step are
  the ZeRO strategy the facade builds, given :class:`.topology.StageMpu` so that its
  data-parallel group is the grid's ``data`` axis and the gradient norm and the fp16
  overflow flag are summed over every stage (an overflow anywhere skips the step
  everywhere). Micro-batch backward passes run with reduction off; ``ReduceGrads``
  is one more (empty or tied-gradient) backward at the boundary, which is where the
  strategies reduce.
* tied weights shared by several stages are read, during a batch, through a detached
  proxy per weight, so their gradients collect outside the strategy. ``ReduceTiedGrads``
  sums them over the holding stages; the owner stage (the lowest) feeds the sum to
  its strategy, the others feed zeros, and after the step the owner's weights are
  broadcast to them. The norm therefore counts a tied weight once.
* activations and gradients move with :class:`.p2p.P2P`; an exception on one stage is
  sent to its neighbours, which raise it too and pass it on.
"""
from __future__ import annotations

import time
from typing import List

import torch
import torch.distributed as dist

from ...utils.logging import log_dist
from ..engine import DeepSpeedEngine
from . import schedule as S
from .module import PipelineModule
from .p2p import P2P, PipelineError
from .topology import StageMpu


def _as_list(x) -> List[torch.Tensor]:
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for t in x if torch.is_tensor(t)]
    raise TypeError(f"pipeline stages must exchange a tensor or a tuple of tensors, got {type(x).__name__}.")


def _grad_tensors(x) -> List[torch.Tensor]:
    return [t for t in _as_list(x) if t.is_floating_point() and t.requires_grad]


def _to_device(x, device):
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(t, device) for t in x)
    return x


def _requiring_grad(x):
    """``x`` with its floating tensors detached and requiring grad (the caller's tensors untouched)."""
    if torch.is_tensor(x):
        return x.detach().requires_grad_(True) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_requiring_grad(t) for t in x)
    return x


class _Backward:
    """What the strategy's ``backward`` calls ``.backward()`` on: autograd from ``tensors``
    with ``grads`` (a loss when ``grads`` is None)."""

    def __init__(self, tensors, grads=None):
        self.tensors, self.grads = tensors, grads

    def backward(self, retain_graph=False):
        if self.tensors:
            torch.autograd.backward(self.tensors, self.grads, retain_graph=retain_graph)


class PipelineEngine(DeepSpeedEngine):
    """A training engine for hybrid pipeline, data and model parallelism (see ``deepspeed.initialize``)."""

    pipeline_parallelism = True   # DeepSpeed's engine attribute (coalesce_grad_reduction refuses it)

    def __init__(self, *super_args, has_bool_tensors=False, **super_kwargs):
        model = super_kwargs.get("model")
        if not isinstance(model, PipelineModule):
            raise TypeError("PipelineEngine needs a deepspeed.pipe.PipelineModule as 'model'.")
        self._pending_grid = model.mpu()
        super_kwargs["mpu"] = StageMpu(self._pending_grid)
        super().__init__(*super_args, **super_kwargs)
        if self.zero_optimization_stage() > 2:
            raise PipelineError("zero_optimization.stage 3 cannot be combined with pipeline parallelism "
                                "(each stage already holds only its layers); use stage 0, 1 or 2.")
        self.grid = self._pending_grid
        self.num_stages = self.grid.pipe_parallel_size
        self.stage_id = self.grid.stage_id
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self.micro_batches = self.gradient_accumulation_steps()
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        pipe_cfg = self.config_obj.pipeline
        timeout = pipe_cfg.p2p_timeout if pipe_cfg is not None else None
        self.chunks = self.module.chunks_per_stage
        p = self.num_stages
        if self.chunks > 1:   # interleaved: activations go round the ring of stages
            prev_rank = self.grid.stage_to_global((self.stage_id - 1) % p)
            next_rank = self.grid.stage_to_global((self.stage_id + 1) % p)
        else:
            prev_rank = self.grid.stage_to_global(self.prev_stage) if not self.is_first_stage() else None
            next_rank = self.grid.stage_to_global(self.next_stage) if not self.is_last_stage() else None
        self.p2p = P2P(prev_rank, next_rank, self.device, timeout_s=timeout, stage_id=self.stage_id)
        self.has_bool_tensors = has_bool_tensors
        # pipeline.use_reentrant picks the module's checkpoint function whatever the interval, so
        # that a later set_checkpoint_interval() uses it too; a positive
        # pipeline.activation_checkpoint_interval overrides the module's own
        if pipe_cfg is not None:
            if pipe_cfg.use_reentrant is False:
                from ..activation_checkpointing.checkpointing import non_reentrant_checkpoint
                self.module.activation_checkpoint_func = non_reentrant_checkpoint
            if pipe_cfg.activation_checkpoint_interval > 0:
                self.module.activation_checkpoint_interval = pipe_cfg.activation_checkpoint_interval
        self.module._precompute_checkpointable_values()

        # tied copies start from the owner's weights; masters follow the module
        self.module.synchronize_tied_weights()
        self.strategy.after_module_load()

        self.train_schedule_cls = S.InterleavedTrainSchedule if self.chunks > 1 else S.TrainSchedule
        self.data_iterator = None
        self.batch_fn = None
        self._programs = {}          # built-in schedule parameters -> instruction list (see _program)
        self._force_grad_boundary = False
        self._proxies = {}           # key -> [(weight, proxy)] during a training batch
        self._tied_grads = None
        self._losses = []
        self._eval_outputs = []
        self._eval_losses = []
        self._compute_loss = True
        self.agg_train_loss = None
        self.idle_time = 0.0         # seconds spent waiting in receives during the last batch
        self.compute_time = 0.0      # seconds in ForwardPass/BackwardPass during the last batch
        self.reduce_step_time = 0.0  # seconds in ReduceTiedGrads/ReduceGrads/OptimizerStep
        if self.training_dataloader is not None:
            from ..dataloader import RepeatingLoader
            self.set_dataiterator(iter(RepeatingLoader(self.training_dataloader)))
        log_dist(f"PipelineEngine: stage {self.stage_id}/{self.num_stages}, "
                 f"{self.micro_batches} micro-batches of {self.micro_batch_size}, "
                 f"dp={self.grid.data_parallel_size} mp={self.grid.model_parallel_size}", ranks=[0])

    # ------------------------------------------------------------------ queries
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._force_grad_boundary

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the module checkpoints activations with the reentrant function (read from the
        module, so set_checkpoint_interval() after initialize counts); the first stage's floating
        inputs then require grad, as in DeepSpeed."""
        if self.module.activation_checkpoint_interval <= 0:
            return False
        from ..activation_checkpointing.checkpointing import non_reentrant_checkpoint
        return self.module.activation_checkpoint_func is not non_reentrant_checkpoint

    def set_dataiterator(self, iterator) -> None:
        self.data_iterator = iterator

    def set_batch_fn(self, fn) -> None:
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """Send the activation description again with the next message (changes of shape are
        detected anyway; DeepSpeed's clients call this when the sequence length changes)."""
        self.p2p.reset_descriptions()

    # ------------------------------------------------------------------ disabled facade calls
    def forward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode (forward is disabled).")

    def backward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode (backward is disabled).")

    def step(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode (step is disabled).")

    # ------------------------------------------------------------------ public batch API
    def train_batch(self, data_iter=None):
        """Run one global batch (gradient_accumulation_steps micro-batches per pipeline),
        step the optimizer and LR schedule; returns the batch's mean loss on every rank."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() requires gradients enabled; use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self._losses = []
        self.timers("train_batch").start()
        self.tput_timer.start()
        self._install_proxies()
        try:
            kw = {"chunks": self.chunks} if self.chunks > 1 else {}
            self.exec_schedule(self.train_schedule_cls(micro_batches=self.micro_batches, stages=self.num_stages,
                                                       stage_id=self.stage_id, **kw))
        finally:
            self._remove_proxies()
        self.agg_train_loss = self._aggregate_loss(self._losses)
        self.timers("train_batch").stop()
        self.tput_timer.stop(global_step=True)
        self._last_loss = self.agg_train_loss
        self.micro_steps += self.micro_batches
        self._write_monitor_events()
        spp = self.config_obj.steps_per_print
        if spp and self.global_steps % spp == 0:
            log_dist(f"step={self.global_steps}, skipped={self.skipped_steps}, "
                     f"loss={self.agg_train_loss.item():.4f}, lr={self.get_lr()}, "
                     f"samples/s={self.tput_timer.avg_samples_per_sec():.2f}", ranks=[0])
            if self.config_obj.wall_clock_breakdown:
                self.timers.log(["train_batch", "pipe_forward", "pipe_backward", "pipe_recv", "pipe_reduce",
                                 "pipe_step"], normalizer=spp)
        return self.agg_train_loss

    def _write_monitor_events(self):
        """Rank 0 (which holds every stage's mean loss after the broadcast) writes the step's
        scalars to the configured monitors, keyed by samples seen."""
        monitor = getattr(self, "monitor", None)
        if monitor is None or not monitor.enabled or self.global_rank != 0:
            return
        s = self.global_samples
        events = [("Train/Samples/train_loss", self.agg_train_loss.item(), s)]
        lr = self.get_lr()
        if lr:
            events.append(("Train/Samples/lr", float(lr[0]), s))
        if self.config_obj.fp16_enabled:
            events.append(("Train/Samples/loss_scale", float(self.loss_scale), s))
        monitor.write_events(events)

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):
        """Forward ``num_micro_batches`` (default gradient_accumulation_steps) micro-batches
        without gradients; returns the mean loss on every rank (``reduce_output=None``: the
        per-micro-batch losses on the last stage), and with ``return_logits`` the last
        stage's outputs too."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got {reduce_output!r}.")
        self.set_dataiterator(data_iter)
        self.module.eval()
        self._eval_outputs, self._eval_losses, self._compute_loss = [], [], compute_loss
        micro = num_micro_batches or self.micro_batches
        try:
            with torch.no_grad():
                if self.chunks > 1:
                    sched = S.InterleavedInferenceSchedule(micro, self.num_stages, self.stage_id, chunks=self.chunks)
                else:
                    sched = S.InferenceSchedule(micro_batches=micro, stages=self.num_stages, stage_id=self.stage_id)
                self.exec_schedule(sched)
        finally:
            self.module.train()
        outputs = self._eval_outputs if self.is_last_stage() else None
        if not compute_loss:
            result = outputs
        elif reduce_output == "avg":
            result = self._aggregate_loss(self._eval_losses) if bcast_loss else (
                torch.stack(self._eval_losses).mean() if self.is_last_stage() else None)
        else:
            result = self._eval_losses if self.is_last_stage() else None
        if return_logits:
            return result, (outputs[0] if outputs is not None and len(outputs) == 1 else outputs)
        return result

    # ------------------------------------------------------------------ interpreter
    def exec_schedule(self, sched: S.PipeSchedule) -> None:
        """Run every instruction of ``sched`` (any :class:`PipeSchedule`, user-written ones too)."""
        n = sched.num_pipe_buffers()
        self.pipe_buffers = {k: [None] * n for k in ("inputs", "labels", "outputs", "output_grads")}
        self._tied_grads = None
        self.idle_time, self.compute_time, self.reduce_step_time = 0.0, 0.0, 0.0
        try:
            # the whole program first: the receives it holds are posted ahead (see P2P.plan)
            cmds, timed, n_act, n_grad, waits_first = self._program(sched)
            methods = {}
            for cls in {type(cmd) for cmd in cmds}:
                methods[cls] = self._method_for_class(cls)
            self.p2p.plan({(self.p2p.prev, self.p2p.act_tag): n_act, (self.p2p.next, self.p2p.grad_tag): n_grad},
                          post_now=waits_first)
            for cmd, step_part in zip(cmds, timed):
                if step_part:
                    t0 = time.perf_counter()
                    methods[type(cmd)](self, **cmd.kwargs)
                    self.reduce_step_time += time.perf_counter() - t0
                else:
                    methods[type(cmd)](self, **cmd.kwargs)
            self.p2p.wait_sends()
        except Exception as err:
            self.p2p.abandon()
            if isinstance(err, PipelineError) and err.src is not None:   # a peer's failure: pass it on
                self.p2p.abort(str(err), skip=err.src)
                raise
            msg = (f"pipeline stage {self.stage_id} (global rank {self.global_rank}) failed: "
                   f"{type(err).__name__}: {err}")
            self.p2p.abort(msg)
            raise

    # the built-in schedules depend on (micro_batches, stages, stage_id, chunks) only: their
    # instruction lists are built once (user-written schedules run their steps() every time)
    _CACHED_SCHEDULES = (S.TrainSchedule, S.InterleavedTrainSchedule, S.InferenceSchedule,
                         S.InterleavedInferenceSchedule)

    def _program(self, sched):
        """(instructions, per instruction: whether it is reduction/step time, number of
        RecvActivation, number of RecvGrad, whether a receive comes before the first compute)
        for ``sched``. A stage that starts with a compute (the first stage) posts its receives
        after its first send: posted before, they would delay that compute."""
        key = None
        if type(sched) in self._CACHED_SCHEDULES:
            key = (type(sched), sched.micro_batches, sched.stages, sched.stage_id, getattr(sched, "chunks", 1))
            hit = self._programs.get(key)
            if hit is not None:
                return hit
        cmds = [cmd for step in sched.steps() for cmd in step]
        first = next((c for c in cmds if isinstance(c, (S.RecvActivation, S.RecvGrad, S.ForwardPass,
                                                          S.BackwardPass))), None)
        program = (cmds, [isinstance(c, (S.ReduceTiedGrads, S.ReduceGrads, S.OptimizerStep)) for c in cmds],
                   sum(isinstance(c, S.RecvActivation) for c in cmds), sum(isinstance(c, S.RecvGrad) for c in cmds),
                   not isinstance(first, (S.ForwardPass, S.BackwardPass)))
        if key is not None:
            self._programs[key] = program
        return program

    def _method_for_class(self, cmd_cls):
        for cls in cmd_cls.__mro__:
            if cls in self._INSTRUCTIONS:
                return self._INSTRUCTIONS[cls]
        raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd_cls.__name__}.")

    def _method_for(self, cmd):
        return self._method_for_class(type(cmd))

    def _next_batch(self):
        if self.data_iterator is None:
            raise PipelineError(f"pipeline stage {self.stage_id} needs data (it is the first or last stage): "
                                f"pass data_iter to train_batch()/eval_batch() or training_data to "
                                f"deepspeed.initialize.")
        batch = next(self.data_iterator)
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise PipelineError("Each pipeline micro-batch must be a pair (inputs, labels); got "
                                f"{type(batch).__name__}" + (f" of length {len(batch)}" if hasattr(batch, '__len__')
                                                             else "") + ".")
        return batch

    def _first_virtual(self, chunk_id) -> bool:
        return self.is_first_stage() and chunk_id == 0

    def _last_virtual(self, chunk_id) -> bool:
        return self.is_last_stage() and chunk_id == self.chunks - 1

    def _exec_load_micro_batch(self, buffer_id, chunk_id=0):
        first, last = self._first_virtual(chunk_id), self._last_virtual(chunk_id)
        if not (first or last):
            return
        inputs, labels = self._next_batch()
        if first:
            x = _to_device(inputs, self.device)
            if torch.is_grad_enabled() and self._reentrant_activation_checkpointing():
                x = _requiring_grad(x)
            self.pipe_buffers["inputs"][buffer_id] = tuple(x) if isinstance(x, list) else x
        if last:
            self.pipe_buffers["labels"][buffer_id] = _to_device(labels, self.device)

    def _exec_forward_pass(self, buffer_id, chunk_id=0):
        t0 = time.perf_counter()
        self.timers("pipe_forward").start()
        inputs = self.pipe_buffers["inputs"][buffer_id]
        outputs = self.module.forward_chunk(chunk_id, inputs) if self.chunks > 1 else self.module(inputs)
        if self._first_virtual(chunk_id):
            self.pipe_buffers["inputs"][buffer_id] = None   # nothing to send back
        if self._last_virtual(chunk_id):
            labels = self.pipe_buffers["labels"][buffer_id]
            self.pipe_buffers["labels"][buffer_id] = None
            if self.module.training:
                loss = self.module.loss_fn(outputs, labels) if self.module.loss_fn is not None else outputs
                if not (torch.is_tensor(loss) and loss.numel() == 1):
                    raise PipelineError("The last stage must produce a scalar loss: give PipelineModule a "
                                        "loss_fn(outputs, labels), or make the last layer return the loss.")
                self._losses.append(loss.detach().float())
                self.pipe_buffers["outputs"][buffer_id] = loss
            else:
                self._eval_outputs.append(outputs)
                if self._compute_loss and self.module.loss_fn is not None:
                    self._eval_losses.append(self.module.loss_fn(outputs, labels).detach().float())
                elif self._compute_loss:
                    self._eval_losses.append(torch.as_tensor(outputs).detach().float())
        else:
            self.pipe_buffers["outputs"][buffer_id] = outputs
        self.timers("pipe_forward").stop()
        self.compute_time += time.perf_counter() - t0

    def _exec_backward_pass(self, buffer_id, chunk_id=0):
        t0 = time.perf_counter()
        self.timers("pipe_backward").start()
        out = self.pipe_buffers["outputs"][buffer_id]
        if self._last_virtual(chunk_id):
            loss = out / self.micro_batches if self.micro_batches > 1 else out
            carrier = _Backward([self.strategy.scale_loss(loss)])
        else:
            carrier = _Backward(_grad_tensors(out), self.pipe_buffers["output_grads"][buffer_id])
        self.strategy.backward(carrier, sync=False)
        self.pipe_buffers["outputs"][buffer_id] = None
        self.pipe_buffers["output_grads"][buffer_id] = None
        self.timers("pipe_backward").stop()
        self.compute_time += time.perf_counter() - t0

    def _exec_send_activations(self, buffer_id, chunk_id=0):
        out = self.pipe_buffers["outputs"][buffer_id]
        self.p2p.send_tensors(_as_list(out), self.p2p.next, is_tuple=not torch.is_tensor(out))
        if not self.module.training:
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id, chunk_id=0):
        t0 = time.perf_counter()
        self.timers("pipe_recv").start()
        self.pipe_buffers["inputs"][buffer_id] = self.p2p.recv_tensors(self.p2p.prev, "activations")
        self.timers("pipe_recv").stop()
        self.idle_time += time.perf_counter() - t0

    def _exec_send_grads(self, buffer_id, chunk_id=0):
        inputs = self.pipe_buffers["inputs"][buffer_id]
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in _grad_tensors(inputs)]
        self.p2p.send_grads(grads, self.p2p.prev)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id, chunk_id=0):
        t0 = time.perf_counter()
        self.timers("pipe_recv").start()
        like = _grad_tensors(self.pipe_buffers["outputs"][buffer_id])
        self.pipe_buffers["output_grads"][buffer_id] = self.p2p.recv_grads(like, self.p2p.next)
        self.timers("pipe_recv").stop()
        self.idle_time += time.perf_counter() - t0

    def _exec_reduce_tied_grads(self):
        self.timers("pipe_reduce").start()
        self._tied_grads = {}
        for key, pairs in self._proxies.items():
            info = self.module._tied_info[key]
            grads = []
            for w, proxy in pairs:
                g = proxy.grad if proxy.grad is not None else torch.zeros_like(w)
                dist.all_reduce(g, group=info["group"])
                grads.append(g)
            self._tied_grads[key] = grads
        self.timers("pipe_reduce").stop()

    def _exec_reduce_grads(self):
        if self._tied_grads is None:
            self._exec_reduce_tied_grads()
        self.timers("pipe_reduce").start()
        tensors, grads = [], []
        for key, pairs in self._proxies.items():
            owner = self.module.is_tied_owner(key)
            for (w, _), g in zip(pairs, self._tied_grads[key]):
                if w.requires_grad:
                    tensors.append(w)
                    grads.append(g.to(w.dtype) if owner else torch.zeros_like(w))
        self._force_grad_boundary = True
        try:
            self.strategy.backward(_Backward(tensors, grads), sync=True)
        finally:
            self._force_grad_boundary = False
        self.timers("pipe_reduce").stop()

    def _exec_optimizer_step(self, lr_kwargs=None):
        self.timers("pipe_step").start()
        self._force_grad_boundary = True
        try:
            self._remove_proxies()
            skipped, norm = False, None
            if self.optimizer is not None:
                outcome = self.strategy.step()
                skipped, norm = outcome.skipped, outcome.grad_norm
                try:
                    self.optimizer.overflow = skipped
                except AttributeError:
                    pass
            self._global_grad_norm = norm
            if skipped:
                self.skipped_steps += 1
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.strategy.zero_grad(set_to_none=True)
            self.module.synchronize_tied_weights()
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        finally:
            self._force_grad_boundary = False
        self.timers("pipe_step").stop()

    _INSTRUCTIONS = {
        S.LoadMicroBatch: _exec_load_micro_batch,
        S.ForwardPass: _exec_forward_pass,
        S.BackwardPass: _exec_backward_pass,
        S.SendActivation: _exec_send_activations,
        S.RecvActivation: _exec_recv_activations,
        S.SendGrad: _exec_send_grads,
        S.RecvGrad: _exec_recv_grads,
        S.ReduceTiedGrads: _exec_reduce_tied_grads,
        S.ReduceGrads: _exec_reduce_grads,
        S.OptimizerStep: _exec_optimizer_step,
    }

    # ------------------------------------------------------------------ tied-weight proxies
    def _install_proxies(self):
        self._proxies = {}
        for key, info in self.module._tied_info.items():
            if info["group"] is None:
                continue
            mod = self.module.tied_modules[key]
            pairs = []
            for attr in self.module.tied_weight_attrs[key]:
                w = mod._parameters[attr]
                proxy = w.detach().requires_grad_(w.requires_grad)
                mod._parameters[attr] = proxy
                pairs.append((w, proxy))
            self._proxies[key] = pairs

    def _remove_proxies(self):
        for key, pairs in self._proxies.items():
            mod = self.module.tied_modules[key]
            for attr, (w, _) in zip(self.module.tied_weight_attrs[key], pairs):
                mod._parameters[attr] = w
        self._proxies = {}

    # ------------------------------------------------------------------ losses
    def _aggregate_loss(self, losses) -> torch.Tensor:
        """Mean over micro-batches and data-parallel ranks, on every stage."""
        t = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage() and losses:
            t = torch.stack([l.to(self.device) for l in losses]).mean()
            if self.grid.data_parallel_size > 1:
                dist.all_reduce(t, group=self.grid.dp_group)
                t /= self.grid.data_parallel_size
        if self.num_stages > 1:
            dist.broadcast(t, src=self.grid.stage_to_global(self.num_stages - 1), group=self.grid.pp_group)
        return t

    # ------------------------------------------------------------------ checkpoints
    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        """Pipeline modules are saved by layer (see save_checkpoint); returns None."""
        return None

    def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False):
        """``checkpoint``: a directory of ``layer_XX-model_states.pt`` files (or a state dict, as
        the facade)."""
        if isinstance(checkpoint, str):
            self.module.load_state_dir(checkpoint, strict=strict)
            self.strategy.after_module_load()
            return
        super().load_module_state_dict(checkpoint, strict=strict, custom_load_fn=custom_load_fn)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        from .checkpoint import save_pipeline_checkpoint
        return save_pipeline_checkpoint(self, save_dir, tag=tag, client_state=client_state or {},
                                        save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        from .checkpoint import load_pipeline_checkpoint
        return load_pipeline_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                                        load_optimizer_states=load_optimizer_states,
                                        load_lr_scheduler_states=load_lr_scheduler_states,
                                        load_module_only=load_module_only)
