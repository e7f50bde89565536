"""Pipeline schedules: generators of :class:`PipeInstruction` lists, one list per step.

A schedule says *what* a stage does and in which order; the engine
(:mod:`.engine`) maps each instruction class to one method. Steps are in lockstep
across stages: every stage of a schedule yields the same number of steps, and data
sent in step ``t`` is received in step ``t + 1`` (sends never block), so a barrier
between successive steps cannot deadlock.

``TrainSchedule`` is 1F1B. With ``p`` stages and ``m`` micro-batches, stage ``s``
runs the forward of micro-batch ``i`` at step ``2i + s`` and its backward at step
``2i + 2p - 1 - s``; forwards and backwards fall on steps of opposite parity, the
whole batch takes ``2(m + p - 1)`` steps, and at most ``p - s`` micro-batches are
in flight on stage ``s`` (its ``num_pipe_buffers``). In time units of one
forward+backward per micro-batch each stage is busy ``m`` of ``m + p - 1`` units:
the bubble fraction is ``(p - 1) / (m + p - 1)``.
"""
from __future__ import annotations

from typing import Iterator, List


class PipeSchedule:
    """Base class: ``steps()`` yields one list of instructions per step."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        if micro_batches < 1:
            raise ValueError(f"{type(self).__name__}: micro_batches must be >= 1, got {micro_batches}.")
        if not 0 <= stage_id < stages:
            raise ValueError(f"{type(self).__name__}: stage_id {stage_id} is outside 0..{stages - 1}.")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    def steps(self) -> Iterator[List["PipeInstruction"]]:
        raise NotImplementedError(f"{type(self).__name__} must implement steps()")

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def _valid_micro_batch(self, i: int) -> bool:
        return 0 <= i < self.micro_batches

    def _valid_stage(self, s: int) -> bool:
        return 0 <= s < self.stages

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _buffer_idx(self, micro_batch_id: int) -> int:
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self):
        self.it = None
        return self

    def __next__(self):
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


def _forward_cmds(sched: PipeSchedule, buf: int) -> list:
    cmds = []
    if not sched.is_first_stage:
        cmds.append(RecvActivation(buf))
    if sched.is_first_stage or sched.is_last_stage:
        cmds.append(LoadMicroBatch(buf))
    cmds.append(ForwardPass(buf))
    if not sched.is_last_stage:
        cmds.append(SendActivation(buf))
    return cmds


class InferenceSchedule(PipeSchedule):
    """Forward only, DeepSpeed's step layout: micro-batch ``i`` runs its forward on stage
    ``s`` at step ``i + s``, and the activation it produced is sent to stage ``s + 1`` at
    the next step (which receives it in that same step, right before its forward).

    Two buffers alternate: a stage forwards into one while the other holds the activation
    being sent. Within a step, even stages send before they receive and odd stages receive
    before they send, so adjacent stages never both wait on a receive."""

    def steps(self):
        even = self.stage_id % 2 == 0
        for t in range(self.micro_batches + self.stages - 1):
            i = t - self.stage_id
            recv_buf, send_buf = (t % 2, (t + 1) % 2) if even else ((t + 1) % 2, t % 2)
            cmds = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(i):
                cmds.append(LoadMicroBatch(recv_buf))
            send = [SendActivation(send_buf)] if (
                self._valid_stage(self.next_stage) and self._valid_micro_batch(i - 1)) else []
            recv = [RecvActivation(recv_buf)] if (
                self._valid_stage(self.prev_stage) and self._valid_micro_batch(i)) else []
            cmds += send + recv if even else recv + send
            if self._valid_micro_batch(i):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class TrainSchedule(PipeSchedule):
    """1F1B training schedule (see the module docstring for the step formula)."""

    def steps(self):
        p, s, m = self.stages, self.stage_id, self.micro_batches
        total = 2 * (m + p - 1)
        for t in range(total):
            cmds = []
            if (t - s) % 2 == 0:                      # forward parity for this stage
                i = (t - s) // 2
                if self._valid_micro_batch(i):
                    cmds = _forward_cmds(self, self._buffer_idx(i))
            else:
                i = (t - (2 * p - 1 - s)) // 2
                if self._valid_micro_batch(i):
                    buf = self._buffer_idx(i)
                    if not self.is_last_stage:
                        cmds.append(RecvGrad(buf))
                    cmds.append(BackwardPass(buf))
                    if not self.is_first_stage:
                        cmds.append(SendGrad(buf))
            if t == total - 1:
                cmds.extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
            yield cmds

    def num_pipe_buffers(self) -> int:
        """As many buffers as the distance from this stage to the last stage."""
        return max(1, min(self.stages - self.stage_id, self.micro_batches))


class DataParallelSchedule(PipeSchedule):
    """Plain data parallelism with gradient accumulation (one stage)."""

    def steps(self):
        for step_id in range(self.micro_batches):
            cmds = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0), BackwardPass(buffer_id=0)]
            if step_id == self.micro_batches - 1:
                cmds.extend([ReduceGrads(), OptimizerStep()])
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1


class PipeInstruction:
    """Base class of the instructions a schedule yields; keyword arguments become attributes."""

    def __init__(self, **kwargs):
        self.name = type(self).__name__
        self.kwargs = kwargs
        for k, v in kwargs.items():
            setattr(self, k, v)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other):
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self):
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Performs one step with the optimizer and zeros gradients (after ReduceGrads and ReduceTiedGrads)."""


class ReduceGrads(PipeInstruction):
    """Reduce the computed gradients among data-parallel processes within the stage."""


class ReduceTiedGrads(PipeInstruction):
    """Reduce the gradients of tied modules among the stages that hold them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction that operates on pipeline buffer ``buffer_id``."""

    def __init__(self, buffer_id: int, **kwargs):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """``buffers['inputs'][buffer_id] = next(data_iter)`` (first stage: inputs, last: labels)."""


class ForwardPass(BufferOpInstruction):
    """``buffers['outputs'][buffer_id] = forward(buffers['inputs'][buffer_id])``."""


class BackwardPass(BufferOpInstruction):
    """``torch.autograd.backward(outputs[buffer_id], gradients[buffer_id])`` (loss on the last stage)."""


class SendActivation(BufferOpInstruction):
    """Send ``buffers['outputs'][buffer_id]`` to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive activations from the previous stage into ``buffers['inputs'][buffer_id]``."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of ``buffers['inputs'][buffer_id]`` to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of ``buffers['outputs'][buffer_id]`` from the next stage."""


class InterleavedTrainSchedule(PipeSchedule):
    """Interleaved 1F1B (virtual stages), beyond DeepSpeed's schedules.

    Each stage holds ``chunks`` model chunks; chunk ``c`` of stage ``s`` is virtual stage
    ``c * p + s``, so activations go round the ring of stages ``chunks`` times (the last
    stage sends chunk ``c``'s output to stage 0's chunk ``c + 1``). Work is ordered in
    units of one chunk of one micro-batch: forward unit ``k`` is chunk ``(k // p) % chunks``
    of micro-batch ``(k // (p * chunks)) * p + k % p``; backward units run the chunks in
    reverse. Stage ``s`` first runs ``min(m * chunks, 2(p - s - 1) + (chunks - 1) p)``
    forward units, then alternates one forward and one backward unit, then drains.
    Each unit costs ``1 / chunks`` of a whole stage, so the bubble shrinks to
    ``(p - 1) / (chunks * m + p - 1)``. Needs ``m`` to be a multiple of ``p`` and ``p >= 2``.

    Instructions carry ``chunk_id``; buffer ``chunk_id * m + i`` holds micro-batch ``i`` of
    a chunk. Steps are not in lockstep across stages (a stage yields one unit per step).
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 2):
        super().__init__(micro_batches, stages, stage_id)
        if stages < 2:
            raise ValueError("InterleavedTrainSchedule needs at least 2 pipeline stages.")
        if chunks < 1:
            raise ValueError(f"InterleavedTrainSchedule: chunks must be >= 1, got {chunks}.")
        if micro_batches % stages:
            raise ValueError(f"InterleavedTrainSchedule: the number of micro-batches "
                             f"(gradient_accumulation_steps={micro_batches}) must be a multiple of the number "
                             f"of pipeline stages ({stages}).")
        self.chunks = chunks

    def _unit(self, k: int, forward: bool):
        p, v = self.stages, self.chunks
        in_group = k % (p * v)
        c = in_group // p
        if not forward:
            c = v - 1 - c
        return c, (k // (p * v)) * p + in_group % p

    def _first_virtual(self, c):
        return self.stage_id == 0 and c == 0

    def _last_virtual(self, c):
        return self.stage_id == self.stages - 1 and c == self.chunks - 1

    def _forward(self, k):
        c, i = self._unit(k, True)
        buf = c * self.micro_batches + i
        cmds = [] if self._first_virtual(c) else [RecvActivation(buf, chunk_id=c)]
        if self._first_virtual(c) or self._last_virtual(c):
            cmds.append(LoadMicroBatch(buf, chunk_id=c))
        cmds.append(ForwardPass(buf, chunk_id=c))
        if not self._last_virtual(c):
            cmds.append(SendActivation(buf, chunk_id=c))
        return cmds

    def _backward(self, k):
        c, i = self._unit(k, False)
        buf = c * self.micro_batches + i
        cmds = [] if self._last_virtual(c) else [RecvGrad(buf, chunk_id=c)]
        cmds.append(BackwardPass(buf, chunk_id=c))
        if not self._first_virtual(c):
            cmds.append(SendGrad(buf, chunk_id=c))
        return cmds

    def steps(self):
        p, s, v, m = self.stages, self.stage_id, self.chunks, self.micro_batches
        total = m * v
        warm = min(total, 2 * (p - s - 1) + (v - 1) * p)
        out = [self._forward(k) for k in range(warm)]
        for j in range(total - warm):
            out.append(self._forward(warm + j))
            out.append(self._backward(j))
        out += [self._backward(k) for k in range(total - warm, total)]
        out[-1] = out[-1] + [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        yield from out

    def num_pipe_buffers(self) -> int:
        return self.chunks * self.micro_batches


class InterleavedInferenceSchedule(InterleavedTrainSchedule):
    """Forward units of :class:`InterleavedTrainSchedule` only (eval of an interleaved model)."""

    def steps(self):
        for k in range(self.micro_batches * self.chunks):
            yield self._forward(k)
