"""User-driven backward: ``loss = engine(x); loss.backward(); engine.step()`` (DeepSpeed 0.19).

``engine.backward(loss)`` divides the loss by the accumulation steps, applies the fp16 loss
scale and brackets ``loss.backward()`` with the strategy's ``begin_backward`` /
``end_backward`` (gradient reduction, bucket flushes). A user who calls ``.backward()``
themselves skips all of that, so the engine watches its forward outputs:

* :meth:`TorchBackward.watch` (called by ``engine.forward`` only in training mode with grad
  enabled) puts one tensor hook on each output tensor that requires grad. Nothing else is
  registered; in a backward that ``engine.backward`` started the hooks return at once.
* The first hook to fire in a backward the engine did not start is the **prologue**: it
  refuses an fp16 backward whose loss was not scaled with :meth:`scale` (the gradients would
  underflow), opens the strategy's backward (``begin_backward(sync=boundary)``) and queues
  the **epilogue** (``end_backward``) on autograd's execution engine, which runs it when the
  whole pass has finished - after the last gradient was accumulated.
* Each hook divides the gradient reaching its output by ``gradient_accumulation_steps`` (and
  applies the sequence-parallel factor), as ``engine.backward`` divides the loss. When one
  output is computed from another (a model returning ``loss`` and the ``logits`` it was
  computed from), the gradient reaching the inner one through the outer one is already
  divided, so the inner one is left alone (found by a short walk of the graph between the
  two, bounded by the nodes' creation order). If a loss uses the inner output both directly
  and through the outer one, its direct part is not divided: backprop such a sum with
  ``engine.backward``.

:class:`TorchBackwardMethods` is mixed into ``DeepSpeedEngine``: ``engine.scale(loss)``,
``engine._backward_prologue()`` / ``engine._backward_epilogue()`` (for backward passes that
do not go through the engine's outputs: call the epilogue after them, as DeepSpeed's own
tests do with several engines and one loss) and ``engine.coalesce_grad_reduction()``.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

_BACKWARD_TIMER = "backward"


class TorchBackward:
    """One engine's state for backward passes it did not start (see the module docstring)."""

    __slots__ = ("engine", "engine_running", "task", "token", "is_open", "queued", "gas", "sp", "scale_called",
                 "coalescing")

    def __init__(self, engine):
        self.engine = engine
        self.engine_running = False   # engine.backward is inside the strategy's backward
        self.task = None              # autograd graph task the open pass belongs to
        self.token = None             # what strategy.begin_backward returned
        self.is_open = False
        self.queued = False           # the epilogue waits on autograd's engine
        self.gas = 1                  # the open pass divides output gradients by gas ...
        self.sp = 1.0                 # ... and multiplies them by the sequence-parallel factor
        self.scale_called = False     # engine.scale() was called since the last pass
        self.coalescing = False       # inside engine.coalesce_grad_reduction()

    # ---------------------------------------------------------------- forward side
    def watch(self, out) -> None:
        if _functorch_transforming():   # torch.func.grad / vmap over the engine: not a training backward
            return
        tensors = []
        _collect(out, tensors, 0)
        if tensors:
            group = _OutputGroup(self, tensors)
            for i, t in enumerate(tensors):
                t.register_hook(group.hook_for(i))

    # ---------------------------------------------------------------- pass bracketing
    def open(self, task) -> None:
        eng = self.engine
        eng.timers(_BACKWARD_TIMER).start()
        self.gas, self.sp = eng.gradient_accumulation_steps(), eng._sp_grad_factor
        if not eng.config_obj.managed_gradient_accumulation:   # one micro-batch of the caller's window
            from .unmanaged_accumulation import count_backward
            count_backward(eng)
        self.token = eng.strategy.begin_backward(eng.is_gradient_accumulation_boundary())
        self.task, self.is_open = task, True

    def close(self) -> None:
        eng = self.engine
        token, self.token = self.token, None
        self.is_open, self.queued, self.task = False, False, None
        eng.strategy.end_backward(token)
        eng._unreduced_grads = False
        eng.timers(_BACKWARD_TIMER).stop()

    def prologue(self, task) -> None:
        """First gradient of a user-driven pass reached one of the outputs."""
        if self.is_open:
            if self.task is None:     # engine._backward_prologue() opened it: adopt this pass
                self.task = task
            if self.task == task or not self.queued:
                return
            # a pass whose backward raised before its epilogue ran: abandon it, open this one
            self.is_open = self.queued = False
            self.engine.timers(_BACKWARD_TIMER).stop()
        eng = self.engine
        if eng.eigenvalue_enabled():
            raise RuntimeError("The eigenvalue section needs the loss itself: with eigenvalue.enabled, call "
                               "engine.backward(loss) instead of loss.backward().")
        if eng.strategy.needs_scaler() and not self.scale_called:
            raise RuntimeError("Loss scaling is required for this configuration (fp16.enabled), but backward() was "
                               "called directly without scaling the loss. Use engine.backward(loss), or "
                               "engine.scale(loss).backward().")
        self.scale_called = False
        self.open(task)
        self.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._epilogue_callback)

    def _epilogue_callback(self) -> None:
        if self.is_open and self.queued:
            self.close()


class _OutputGroup:
    """The hooked outputs of one forward call. Holds them weakly (the hooks live on the tensors'
    autograd nodes: a strong reference here would be a cycle through C++ that keeps the graph,
    saved activations included, alive when no backward runs) and their nodes' keys."""

    __slots__ = ("state", "refs", "keys", "task", "divide")

    def __init__(self, state: TorchBackward, tensors):
        self.state = state
        self.refs = [weakref.ref(t) for t in tensors] if len(tensors) > 1 else None
        self.keys = [_key(t.grad_fn) if t.grad_fn is not None else None for t in tensors] \
            if len(tensors) > 1 else None
        self.task = None
        self.divide = (True,)

    def hook_for(self, i):
        def hook(grad):
            st = self.state
            if st.engine_running or _functorch_transforming():
                return None
            task = torch._C._current_graph_task_id()
            if st.task != task or not st.is_open:
                st.prologue(task)
            if st.gas == 1 and st.sp == 1.0:
                return None
            if self.task != task and self.refs is not None:
                self.task, self.divide = task, _dividing_outputs(self.refs, self.keys, i)
            if not self.divide[i]:
                return None
            if st.gas != 1:   # as engine.backward: (loss / gas) * sp
                grad = grad / st.gas
            return grad * st.sp if st.sp != 1.0 else grad
        return hook


def _functorch_transforming() -> bool:
    """Inside torch.func.grad / vmap / jacrev (DeepSpeed skips its backward hooks there too)."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _collect(out, acc, depth) -> None:
    if isinstance(out, torch.Tensor):
        if out.requires_grad and not any(t is out for t in acc):   # one hook per tensor, however often returned
            acc.append(out)
    elif depth < 4:
        if isinstance(out, (tuple, list)):
            for v in out:
                _collect(v, acc, depth + 1)
        elif isinstance(out, dict):   # HF ModelOutput is an OrderedDict
            for v in out.values():
                _collect(v, acc, depth + 1)


def _dividing_outputs(refs, keys, firing):
    """Which outputs' gradients to divide in this pass: all of them, except one that another
    output taking part in this pass was computed from (its gradient arrives divided).
    ``firing``: the output whose hook runs now (it takes part; a backward's root output is not
    among the nodes autograd reports as pending). An output the caller dropped can still be
    found (by its key) from one that is alive, but not start a search."""
    n = len(keys)
    divide = [True] * n
    will_run = torch._C._will_engine_execute_node
    live = {}
    for i, r in enumerate(refs):
        t = r()
        node = t.grad_fn if t is not None else None
        if node is not None and (i == firing or will_run(node)):
            live[i] = node
    for a in range(n):
        if keys[a] is None:
            continue
        for b, node in live.items():
            if b != a and keys[b][0] > keys[a][0] and _reaches(node, keys[a], keys[a][0]):
                divide[a] = False
                break
    return divide


def _key(node):
    # Python wrappers of autograd nodes are made afresh on each access (no identity): a node
    # is its creation number (unique per thread) and its name
    return node._sequence_nr(), node.name()


def _reaches(start, target, floor) -> bool:
    """Is the node ``target`` (a :func:`_key`) an input-side ancestor of ``start``? Nodes created
    before it (sequence number below ``floor``) cannot lead to it: the walk stays between the two."""
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            key = _key(nxt)
            if key == target:
                return True
            if key in seen or key[0] < floor:
                continue
            seen.add(key)
            stack.append(nxt)
    return False


class TorchBackwardMethods:
    """DeepSpeed 0.19's engine methods for backward passes the user drives (mixed into
    ``DeepSpeedEngine``; the state is ``engine._torch_backward``)."""

    #: True on the pipeline engine (DeepSpeed's attribute name)
    pipeline_parallelism = False

    def scale(self, loss):
        """Apply the fp16 loss scale for a manual ``engine.scale(loss).backward()``. Returns
        ``loss`` unchanged without fp16. The accumulation division happens in the backward."""
        if self.optimizer is None:
            raise AssertionError("engine.scale(loss): must provide an optimizer during init in order to use scale.")
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn is not None):
            raise AssertionError("engine.scale(loss): loss must be a scalar tensor with grad_fn. For non-scalar "
                                 "tensors, use tensor.backward(grad).")
        self._torch_backward.scale_called = True
        return self.strategy.scale_loss(loss)

    def _backward_prologue(self):
        """Open a backward pass by hand (the strategy's ``begin_backward`` at the current
        boundary); close it with :meth:`_backward_epilogue` after the backward."""
        st = self._torch_backward
        if not st.is_open:
            st.open(None)

    def _backward_epilogue(self):
        """Finish a backward pass that did not go through ``engine.backward``: reduce the
        gradients it produced (at the accumulation boundary), flush ZeRO buckets. Call it after
        a ``loss.backward()`` whose graph did not pass through this engine's forward outputs
        (e.g. over ``engine.module``); a pass through the outputs finishes by itself."""
        st = self._torch_backward
        if not st.is_open:
            st.open(None)
        st.close()

    @property
    def _is_gradient_accumulation_boundary(self):
        """DeepSpeed's attribute: the boundary set with ``set_gradient_accumulation_boundary``
        (``None``: the micro-step counter decides)."""
        return self._boundary_override

    @_is_gradient_accumulation_boundary.setter
    def _is_gradient_accumulation_boundary(self, value):
        self._boundary_override = None if value is None else bool(value)

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """Several backward passes, one gradient reduction: inside the block every backward
        keeps its gradients local to the rank; leaving it reduces them once. One block is one
        optimizer step: call ``engine.step()`` after it (inside it raises), set the boundary
        with ``set_gradient_accumulation_boundary`` as usual, do not spread one accumulation
        window over several blocks. ZeRO stages 1-3; not under pipeline parallelism; not
        nested with ``engine.no_sync()``; not with ``managed_gradient_accumulation: false``. If the
        block raises, nothing is reduced."""
        if not self.config_obj.managed_gradient_accumulation:
            from .unmanaged_accumulation import refuse
            refuse("coalesce_grad_reduction")
        stage = self.zero_optimization_stage()
        if stage not in (1, 2, 3):
            raise NotImplementedError(f"coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage {stage} "
                                      f"(zero_optimization.stage); use engine.no_sync() at stage 0.")
        if self.pipeline_parallelism:
            raise NotImplementedError("coalesce_grad_reduction is not supported under pipeline parallelism.")
        st = self._torch_backward
        if st.coalescing or not self.strategy._sync_enabled:
            raise AssertionError("coalesce_grad_reduction cannot be nested inside another no_sync context "
                                 "(engine.no_sync() or coalesce_grad_reduction() is active).")
        st.coalescing = True
        try:
            with self.strategy.no_sync():
                yield
        finally:
            st.coalescing = False
        # one reduction of everything the block accumulated, as a boundary backward would
        strategy = self.strategy
        strategy.end_backward(strategy.begin_backward(True))
        self._unreduced_grads = False

    def _refuse_inside_coalesce(self, what: str) -> None:
        raise AssertionError(f"{what} cannot be called inside engine.coalesce_grad_reduction() (a no_sync "
                             f"context): the gradients are reduced when the block exits; call it after the block.")
