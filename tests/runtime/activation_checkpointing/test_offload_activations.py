"""CheckpointHiddenStatesOffload: marked checkpoint inputs go to host memory until backward.

The reference is plain PyTorch: the same layers, no checkpointing and no offload, on the same
input. On a CPU machine the accelerator is synchronized (the tensors already live in host
memory), so the engine rightly moves nothing; there the ``dev`` fixture presents the CPU as an
asynchronous accelerator, which runs the real offload path: copies into separate host buffers,
the originals released, copies back in backward. On a GPU machine ``dev`` is the GPU itself
(pinned buffers, side-stream copies), and the CUDA tests at the end add the stream and stash cases.
"""
from __future__ import annotations

import gc
import sys
import types
import weakref
from functools import partial

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import hidden_states_marker
from deepspeed.runtime.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload, get_checkpoint_hidden_states_offloading_ctx_manager)

D, LAYERS = 16, 4


@pytest.fixture
def dev(monkeypatch):
    """The device whose tensors the engine offloads: the accelerator's; on a CPU machine the CPU,
    with the accelerator reporting itself as not synchronized so the engine offloads."""
    accel = get_accelerator()
    if accel.device_name() == "cpu":
        monkeypatch.setattr(accel, "is_synchronized_device", lambda: False)
    return accel.device_name()


def _layers(device="cpu", seed=3):
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Dropout(0.25)) for _ in range(LAYERS)).to(device)


def _run(layers, x, offload=None, checkpointed=True, keep=None):
    """Loss of one forward; with ``offload``, each layer's input is marked before its checkpoint."""
    h = x
    for layer in layers:
        if offload is not None:
            offload.mark(h)
        if keep is not None:
            keep.append(weakref.ref(h))
        h = checkpoint(layer, h, use_reentrant=False) if checkpointed else layer(h)
    return h.square().mean()


def _reference(layers, x, seed=7):
    """Plain PyTorch: no checkpoint, no offload."""
    layers.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    loss = _run(layers, xr, checkpointed=False)
    loss.backward()
    return loss.detach(), xr.grad.clone(), [p.grad.clone() for p in layers.parameters()]


def _assert_same(loss, x, layers, ref, atol=1e-6):
    ref_loss, ref_xgrad, ref_grads = ref
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=0, atol=atol)
    torch.testing.assert_close(x.grad, ref_xgrad, rtol=0, atol=atol)
    for g, rg in zip((p.grad for p in layers.parameters()), ref_grads):
        torch.testing.assert_close(g, rg, rtol=0, atol=atol)


@pytest.mark.parametrize("keep_last_count", [0, 1])
def test_loss_and_gradients_equal_plain_pytorch(dev, keep_last_count):
    layers = _layers(dev)
    x0 = torch.randn(8, D, device=dev)
    ref = _reference(layers, x0)
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=keep_last_count)
    for step in range(2):  # the second step reuses the pooled host buffers
        layers.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        with offload:
            torch.manual_seed(7)
            loss = _run(layers, x, offload)
            loss.backward()
        _assert_same(loss, x, layers, ref)
        assert offload.stats.marked_tensors == LAYERS
        assert offload.stats.offloaded_tensors == LAYERS - keep_last_count
        assert offload.stats.restored_tensors == LAYERS - keep_last_count
        assert offload.stats.kept_last_tensors == keep_last_count
        assert offload.stats.offloaded_bytes == (LAYERS - keep_last_count) * 8 * D * 4
    # All offloaded tensors have one shape, so one step's buffers serve the next: nothing new allocated.
    assert offload._cpu_buffer_pool_count == LAYERS - keep_last_count


def test_offloaded_inputs_live_in_separate_host_buffers_and_originals_are_released(dev):
    layers = _layers(dev)
    x = torch.randn(8, D, device=dev, requires_grad=True)

    # Control: without offload, autograd keeps every checkpoint input alive until backward.
    kept = []
    loss = _run(layers, x, keep=kept)
    gc.collect()
    assert all(r() is not None for r in kept[1:])
    loss.backward()
    del loss, kept

    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0, max_fwd_stash_count=0)
    kept = []
    with offload:
        loss = _run(layers, x, offload, keep=kept)
        gc.collect()
        # The layer outputs fed to the next checkpoint are gone: only the host copies hold their values.
        assert [r() is None for r in kept[1:]] == [True] * (LAYERS - 1)
        get_accelerator().synchronize()  # the copies to host may still be in flight on a GPU
        hosts = [record.host for record in offload._tracker.values()]
        assert len(hosts) == LAYERS
        assert len({h.untyped_storage().data_ptr() for h in hosts}) == LAYERS
        assert x.untyped_storage().data_ptr() not in {h.untyped_storage().data_ptr() for h in hosts}
        torch.testing.assert_close(hosts[0], x.detach().cpu(), rtol=0, atol=0)
        assert all(h.device.type == "cpu" and h.is_contiguous() for h in hosts)
        loss.backward()
        assert not offload._tracker  # every offloaded tensor was restored
        # ...one checkpoint at a time: nothing restored is still held on the device after backward
        # (a strong cache would have put every checkpoint input back by now).
        restored = list(offload._restored.values())
        assert len(restored) == LAYERS and all(r() is None for r in restored)
    assert offload.stats.restored_tensors == LAYERS


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_works_with_deepspeed_checkpoint(dev, use_reentrant):
    import deepspeed.checkpointing as ds_checkpointing
    layers = _layers(dev)
    x0 = torch.randn(8, D, device=dev)
    ref = _reference(layers, x0)
    layers.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0)
    with offload:
        torch.manual_seed(7)
        h = x
        for layer in layers:
            offload.mark(h)
            h = ds_checkpointing.checkpoint(layer, h, use_reentrant=use_reentrant)
        loss = h.square().mean()
        loss.backward()
    _assert_same(loss, x, layers, ref)
    assert offload.stats.offloaded_tensors == LAYERS and offload.stats.restored_tensors == LAYERS


def test_unmarked_saved_tensors_pass_through(dev):
    layers = _layers(dev)
    x = torch.randn(8, D, device=dev, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0)
    with offload:
        _run(layers, x).backward()
    assert offload.stats.saved_tensors_seen >= LAYERS
    assert offload.stats.offloaded_tensors == 0 and offload.stats.marked_tensors == 0


def test_small_overlapping_and_parameter_tensors_stay(dev):
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=4 * 8 * D)  # one [8, D] fp32 tensor passes
    assert offload.offload_input(torch.randn(2, D, device=dev)) is None                 # below min_offload_bytes
    assert offload.offload_input(torch.randn(1, D, device=dev).expand(8, D)) is None     # stride 0: aliased storage
    assert offload.offload_input(nn.Parameter(torch.randn(8, D, device=dev))) is None
    assert offload.offload_input(torch.randn(8, D, device=dev)) == 1
    assert offload.stats.skipped_marked_tensors == 3


def test_synchronized_device_moves_nothing():
    # The CPU accelerator as it is: tensors already live in host memory, so marks are counted and skipped.
    layers = _layers()
    x = torch.randn(8, D, requires_grad=True)
    ref = _reference(layers, x)
    layers.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0)
    with offload:
        torch.manual_seed(7)
        loss = _run(layers, x, offload)
        loss.backward()
    _assert_same(loss, x, layers, ref)
    assert offload.stats.skipped_marked_tensors == LAYERS and offload.stats.offloaded_tensors == 0


def test_retained_graph_runs_backward_twice(dev):
    layers = _layers(dev)
    x = torch.randn(8, D, device=dev, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0)
    with offload:
        loss = _run(layers, x, offload)
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        x.grad = None
        loss.backward()
    torch.testing.assert_close(x.grad, first, rtol=0, atol=0)
    assert offload.stats.restored_tensors == LAYERS  # the second backward reused the restored tensors


def test_backward_after_the_block_is_a_clear_error(dev):
    layers = _layers(dev)
    x = torch.randn(8, D, device=dev, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0)
    with offload:
        loss = _run(layers, x, offload)
    with pytest.raises(RuntimeError, match="inside the same `with` block"):
        loss.backward()


def test_manager_is_not_reentrant_and_nests_as_separate_instances():
    outer, inner = CheckpointHiddenStatesOffload(), CheckpointHiddenStatesOffload()
    with outer:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            outer.__enter__()
        with inner:
            assert hidden_states_marker.current_manager() is inner
        assert hidden_states_marker.current_manager() is outer
    assert hidden_states_marker.current_manager() is None


@pytest.mark.parametrize("name, value, valid", [
    ("keep_last_count", -1, "int >= 0"),
    ("min_offload_bytes", "1k", "int >= 0"),
    ("max_fwd_stash_count", 1.5, "int >= 0"),
    ("max_cpu_buffer_pool_count", True, "int >= 0"),
    ("use_pin_memory", "yes", "True or False"),
    ("use_streams", 1, "True or False"),
])
def test_bad_options_name_the_option_and_what_is_valid(name, value, valid):
    with pytest.raises(ValueError, match=f"{name} must be .*{valid}.*got {value!r}"):
        get_checkpoint_hidden_states_offloading_ctx_manager(**{name: value})


def test_host_buffers_are_pinned_through_the_accelerator(monkeypatch):
    calls = []
    accel = get_accelerator()
    pin = accel.pin_memory
    monkeypatch.setattr(accel, "pin_memory", lambda t, *a, **k: calls.append(t.shape) or pin(t, *a, **k))
    pinned = CheckpointHiddenStatesOffload(use_pin_memory=True)
    buf, _ = pinned._empty_cpu_like(torch.randn(6, 8)[:, ::2])
    assert calls == [torch.Size([6, 4])] and buf.is_contiguous()
    CheckpointHiddenStatesOffload(use_pin_memory=False)._empty_cpu_like(torch.randn(3))
    assert len(calls) == 1


# -- the Transformers marker ------------------------------------------------------------------------

def _fake_transformers(monkeypatch):
    """A stand-in ``transformers`` whose GradientCheckpointingLayer checkpoints ``forward`` with its first
    positional argument, as Transformers' does (the real one is checked in the slow test below)."""

    class GradientCheckpointingLayer(nn.Module):
        gradient_checkpointing = False

        def __init_subclass__(cls, **kw):
            super().__init_subclass__(**kw)
            forward = cls.forward

            def wrapped(self, *args, **kwargs):
                if self.gradient_checkpointing and self.training:
                    return self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)
                return forward(self, *args, **kwargs)
            cls.forward = wrapped

    module = types.ModuleType("transformers")
    module.GradientCheckpointingLayer = GradientCheckpointingLayer
    monkeypatch.setitem(sys.modules, "transformers", module)
    return GradientCheckpointingLayer


def _hf_stack(base, device="cpu"):
    class Layer(base):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, hidden_states, scale=1.0):
            return torch.tanh(self.fc(hidden_states)) * scale

    torch.manual_seed(5)
    layers = nn.ModuleList(Layer() for _ in range(LAYERS)).to(device)
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    return layers


def _hf_loss(layers, x):
    h = x
    for layer in layers:
        h = layer(h, scale=0.5)
    return h.square().mean()


def _check_marker(base, device="cpu"):
    layers = _hf_stack(base, device)
    x = torch.randn(8, D, device=device, requires_grad=True)
    with torch.no_grad():
        plain = [layer.fc.weight.clone() for layer in layers]
    _hf_loss(layers, x).backward()
    ref_x, ref = x.grad.clone(), [layer.fc.weight.grad.clone() for layer in layers]
    layers.zero_grad(set_to_none=True)
    x.grad = None

    original, owned = base.__call__, base.__dict__.get("__call__")
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=1)
    with offload:
        assert base.__call__ is not original  # the marker is installed while a manager is active
        _hf_loss(layers, x).backward()
    assert base.__call__ is original and base.__dict__.get("__call__") is owned
    torch.testing.assert_close(x.grad, ref_x, rtol=1e-5, atol=1e-8)
    for layer, g in zip(layers, ref):
        torch.testing.assert_close(layer.fc.weight.grad, g, rtol=1e-5, atol=1e-8)
    assert offload.stats.marked_tensors == LAYERS
    assert offload.stats.offloaded_tensors == LAYERS - 1 and offload.stats.restored_tensors == LAYERS - 1
    # Outside a manager (or in eval) nothing is marked.
    layers.eval()
    with offload:
        _hf_loss(layers, x)
    assert offload.stats.marked_tensors == 0
    assert all(torch.equal(layer.fc.weight, w) for layer, w in zip(layers, plain))


def test_marker_offloads_layer_hidden_states_and_is_removed_on_exit(monkeypatch, dev):
    _check_marker(_fake_transformers(monkeypatch), dev)


def test_marker_removed_on_exception_and_when_the_last_manager_exits(monkeypatch):
    base = _fake_transformers(monkeypatch)
    original = base.__call__
    with pytest.raises(ValueError, match="boom"):
        with CheckpointHiddenStatesOffload():
            raise ValueError("boom")
    assert base.__call__ is original
    outer, inner = CheckpointHiddenStatesOffload(), CheckpointHiddenStatesOffload()
    with outer:
        patched = base.__call__
        with inner:
            assert base.__call__ is patched
        assert base.__call__ is patched
    assert base.__call__ is original


@pytest.mark.slow
def test_marker_with_real_transformers(dev):
    transformers = pytest.importorskip("transformers")
    _check_marker(transformers.GradientCheckpointingLayer, dev)


# -- on a GPU: pinned buffers, the side stream, the stash ------------------------------------------

_CUDA = torch.cuda.is_available() and get_accelerator().device_name() == "cuda"


@pytest.mark.skipif(not _CUDA, reason="needs a CUDA accelerator")
@pytest.mark.parametrize("use_streams, keep_last_count, stash", [(True, 0, 2), (True, 1, 0), (False, 0, 2)])
def test_cuda_offload_equals_plain_and_frees_device_memory(use_streams, keep_last_count, stash):
    layers = _layers("cuda")
    x0 = torch.randn(64, D, device="cuda")
    ref = _reference(layers, x0)
    offload = CheckpointHiddenStatesOffload(use_streams=use_streams, min_offload_bytes=0,
                                            keep_last_count=keep_last_count, max_fwd_stash_count=stash)
    assert offload.use_streams is use_streams
    for _ in range(2):
        layers.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        kept = []
        with offload:
            torch.manual_seed(7)
            loss = _run(layers, x, offload, keep=kept)
            gc.collect()
            hosts = [r.host for r in offload._tracker.values()]
            assert len(hosts) == LAYERS - keep_last_count
            assert all(h.device.type == "cpu" and h.is_pinned() for h in hosts)
            held = sum(r() is not None for r in kept[1:])
            # Device tensors still held: the newest keep_last_count and up to `stash` in flight.
            assert held <= keep_last_count + (stash if use_streams else 0)
            assert len(offload._fwd_stash) == (min(stash, LAYERS - keep_last_count) if use_streams else 0)
            loss.backward()
        torch.cuda.synchronize()
        _assert_same(loss, x, layers, ref, atol=1e-5)
        assert offload.stats.offloaded_tensors == LAYERS - keep_last_count
        assert offload.stats.restored_tensors == LAYERS - keep_last_count
