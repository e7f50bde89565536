"""Checkpointed gradients equal plain PyTorch's, in every storage mode, on one process."""
from __future__ import annotations

import logging

import pytest
import torch

import deepspeed
import deepspeed.checkpointing as ckpt
from deepspeed.runtime.activation_checkpointing.storage import CONTIGUOUS_BUFFERS

from ._models import SavedBytes, Stack, grads_of


def _assert_same(ref, got, exact=True):
    loss_r, grads_r, gx_r = ref
    loss_g, grads_g, gx_g = got
    check = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    assert check(loss_r, loss_g)
    for name in grads_r:
        assert check(grads_r[name], grads_g[name]), name
    assert check(gx_r, gx_g)


@pytest.fixture
def model_and_input():
    model = Stack(d=8, layers=3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    return model, x


def test_reentrant_matches_plain_with_dropout(model_and_input):
    model, x = model_and_input
    ref = grads_of(model, x)
    got = grads_of(model, x, ckpt=ckpt.checkpoint)
    _assert_same(ref, got)
    # Dropout really fired: a different seed changes the loss, so matching masks was not a given.
    assert not torch.equal(ref[0], grads_of(model, x, rng_seed=999)[0])


def test_documented_import_paths():
    import deepspeed.checkpointing as via_import
    assert deepspeed.checkpointing is via_import
    assert via_import.checkpoint is deepspeed.runtime.activation_checkpointing.checkpoint
    for name in ("configure", "is_configured", "checkpoint", "reset", "get_cuda_rng_tracker",
                 "model_parallel_cuda_manual_seed", "CheckpointFunction", "CudaRNGStatesTracker"):
        assert callable(getattr(via_import, name)), name


def test_is_configured():
    assert not ckpt.is_configured()
    ckpt.configure(None)
    assert ckpt.is_configured()


def test_cpu_checkpointing_same_grads_and_host_copies(model_and_input):
    model, x = model_and_input
    ref = grads_of(model, x)
    ckpt.configure(None, checkpoint_in_cpu=True)
    got = grads_of(model, x, ckpt=ckpt.checkpoint)
    _assert_same(ref, got)
    # What is kept is a separate host copy, not the activation itself.
    xin = x.clone().requires_grad_(True)
    with SavedBytes() as meter:
        ckpt.checkpoint(model.blocks[0], xin)
    assert len(meter.tensors) == 1
    kept = meter.tensors[0]
    assert kept.device.type == "cpu" and kept.data_ptr() != xin.data_ptr()
    assert torch.equal(kept.view_as(xin), xin.detach())


def test_partition_single_rank_and_contiguous_buffer(model_and_input):
    model, x = model_and_input
    ref = grads_of(model, x)
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3)
    got = grads_of(model, x, ckpt=ckpt.checkpoint)
    _assert_same(ref, got)
    buf = CONTIGUOUS_BUFFERS.buffers[0]
    assert tuple(buf.shape) == (3, x.numel())  # one slot per checkpoint, whole tensor at P=1
    assert CONTIGUOUS_BUFFERS.live == set()   # backward handed every slot back
    # A second step reuses the same buffer rather than allocating a new one.
    _assert_same(ref, grads_of(model, x, ckpt=ckpt.checkpoint))
    assert CONTIGUOUS_BUFFERS.buffers[0].data_ptr() == buf.data_ptr()


def test_contiguous_kept_tensors_live_in_the_buffer(model_and_input):
    model, x = model_and_input
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3)
    with SavedBytes() as meter:
        loss = model(x.clone().requires_grad_(True), ckpt.checkpoint)
    buf = CONTIGUOUS_BUFFERS.buffers[0]
    assert len(meter.tensors) >= 3
    ckpt_saved = meter.tensors[:3]
    for slot, t in enumerate(ckpt_saved):
        assert t.data_ptr() == buf[slot].data_ptr()
    loss.backward()


def test_contiguous_overflow_and_reset(model_and_input):
    model, x = model_and_input
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3)
    xin = x.clone().requires_grad_(True)
    model(xin, ckpt.checkpoint)  # evaluation-style forward with grad on, never backpropagated
    with pytest.raises(RuntimeError, match="number_checkpoints"):
        model(xin, ckpt.checkpoint)
    ckpt.reset()
    loss = model(xin, ckpt.checkpoint)
    loss.backward()
    # Under no_grad nothing is kept, so eval loops do not fill the buffer at all.
    with torch.no_grad():
        for _ in range(3):
            model(xin, ckpt.checkpoint)
    assert CONTIGUOUS_BUFFERS.live == set()


def test_contiguous_needs_homogeneous_inputs():
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4)
    a = torch.randn(4, 8, requires_grad=True)
    ckpt.checkpoint(torch.tanh, a)
    with pytest.raises(RuntimeError, match="homogeneous"):
        ckpt.checkpoint(torch.tanh, torch.randn(4, 9, requires_grad=True))


def test_non_tensor_args_multiple_outputs_and_outputs_without_grad():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)

    def fn(x, scale, mode, mask):
        h = lin(x) * scale
        h = h.masked_fill(mask, 0.0) if mode == "mask" else h
        return h, h.detach().sum(), (h > 0).long(), "tag"

    x = torch.randn(3, 6, requires_grad=True)
    mask = torch.rand(3, 6) > 0.5
    h_ref, s_ref, i_ref, _ = fn(x, 2.0, "mask", mask)
    (h_ref.sum() * 3 + s_ref).backward()  # s_ref is detached: it adds nothing to the gradients
    ref_w, ref_x = lin.weight.grad.clone(), x.grad.clone()
    lin.weight.grad, x.grad = None, None

    h, s, i, tag = ckpt.checkpoint(fn, x, 2.0, "mask", mask)
    assert tag == "tag" and not i.requires_grad and i.dtype == torch.long
    assert torch.equal(h, h_ref) and torch.equal(s, s_ref) and torch.equal(i, i_ref)
    # As in torch's reentrant checkpoint, a float output computed without grad still looks
    # differentiable after the forward; the recompute finds it is not and sends nothing back.
    (h.sum() * 3 + s).backward()
    assert torch.equal(lin.weight.grad, ref_w) and torch.equal(x.grad, ref_x)


def test_reentrant_inputs_without_grad_still_reach_parameters():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 5)
    x = torch.randn(2, 5)  # e.g. frozen embeddings: no grad on the input
    lin(x).pow(2).sum().backward()
    ref = lin.weight.grad.clone()
    lin.weight.grad = None
    ckpt.checkpoint(lin, x).pow(2).sum().backward()
    assert torch.equal(lin.weight.grad, ref)


def test_reentrant_rejects_autograd_grad_with_clear_error():
    x = torch.randn(3, requires_grad=True)
    y = ckpt.checkpoint(torch.sin, x)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        torch.autograd.grad(y.sum(), x)


def test_reentrant_passes_kwargs_and_rejects_non_callables():
    x = torch.randn(3, 2, requires_grad=True)   # DeepSpeed 0.19: keyword arguments reach the function
    out = ckpt.checkpoint(torch.sum, x, dim=0)
    assert torch.equal(out, torch.sum(x.detach(), dim=0))
    out.pow(2).sum().backward()
    assert torch.equal(x.grad, 2 * torch.sum(x.detach(), dim=0).expand(3, 2))
    with pytest.raises(TypeError, match="callable"):
        ckpt.checkpoint(3, torch.randn(3))


@pytest.mark.parametrize("entry", ["use_reentrant_false", "function"])
def test_non_reentrant_with_autograd_grad(model_and_input, entry):
    model, x = model_and_input
    fn = ((lambda f, *a: ckpt.checkpoint(f, *a, use_reentrant=False)) if entry == "use_reentrant_false"
          else ckpt.non_reentrant_checkpoint)
    params = list(model.parameters())

    def grads(ckpt_fn):
        xin = x.clone().requires_grad_(True)
        torch.manual_seed(5)
        loss = model(xin, ckpt_fn)
        torch.manual_seed(6)
        return torch.autograd.grad(loss, params + [xin])

    for a, b in zip(grads(None), grads(fn)):
        assert torch.equal(a, b)


def test_non_reentrant_inputs_without_grad_kwargs_and_cpu_offload():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 5)
    drop = torch.nn.Dropout(0.5)
    x = torch.randn(4, 5)

    def fn(t, *, shift):
        return drop(lin(t)) + shift

    torch.manual_seed(1)
    (g_ref,) = torch.autograd.grad(fn(x, shift=1.0).sum(), [lin.weight])
    ckpt.configure(None, checkpoint_in_cpu=True)
    torch.manual_seed(1)
    out = ckpt.non_reentrant_checkpoint(fn, x, shift=1.0)
    torch.manual_seed(2)
    (g,) = torch.autograd.grad(out.sum(), [lin.weight])
    assert torch.equal(g, g_ref)


def test_tracker_stream_replayed_in_recompute():
    """Dropout drawn from the model-parallel stream inside fork() gets the same mask in recompute."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    drop = torch.nn.Dropout(0.5)
    tracker = ckpt.get_cuda_rng_tracker()

    def fn(t):
        with tracker.fork():
            return drop(lin(t))

    x = torch.randn(4, 8, requires_grad=True)

    def run(use_ckpt):
        tracker.reset()
        tracker.add("model-parallel-rng", 4242)
        lin.weight.grad, x.grad = None, None
        out = ckpt.checkpoint(fn, x) if use_ckpt else fn(x)
        with tracker.fork():
            torch.rand(100)  # advance the stream between forward and backward
        out.sum().backward()
        return lin.weight.grad.clone(), x.grad.clone()

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_autocast_is_replayed():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = lin(x)
    ref_out.float().sum().backward()
    ref = lin.weight.grad.clone()
    lin.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ckpt.checkpoint(lin, x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert torch.equal(lin.weight.grad, ref)


def test_synchronize_at_both_boundaries(monkeypatch):
    calls = []
    acc = deepspeed.get_accelerator()
    monkeypatch.setattr(type(acc), "synchronize", lambda self, device_index=None: calls.append(1))
    ckpt.configure(None, synchronize=True)
    x = torch.randn(3, requires_grad=True)
    y = ckpt.checkpoint(torch.sin, x)
    assert len(calls) == 2  # start and end of forward
    y.sum().backward()
    assert len(calls) == 6  # start and end of recompute, and of the backward through it
    ckpt.configure(None, synchronize=False)
    ckpt.checkpoint(torch.sin, x).sum().backward()
    assert len(calls) == 6


def test_profile_logs_forward_and_recompute_times():
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    deepspeed.utils.logger.addHandler(handler)
    try:
        ckpt.configure(None, profile=True)
        x = torch.randn(3, requires_grad=True)

        def my_layer(t):
            return t.sin()

        ckpt.checkpoint(my_layer, x).sum().backward()
    finally:
        deepspeed.utils.logger.removeHandler(handler)
    mine = [m for m in records if "my_layer" in m]
    assert any("forward" in m and " ms" in m for m in mine), records
    assert any("recompute" in m and " ms" in m for m in mine), records


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("options", [
    {}, {"checkpoint_in_cpu": True},
    {"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 3, "checkpoint_in_cpu": True},
])
def test_cuda_gradients_match_plain(options):
    model = Stack(d=8, layers=3).cuda()
    x = torch.randn(4, 8, device="cuda")
    ref = grads_of(model, x)
    ckpt.configure(None, **options)
    _assert_same(ref, grads_of(model, x, ckpt=ckpt.checkpoint))
    with SavedBytes() as meter:
        ckpt.checkpoint(model.blocks[0], x.clone().requires_grad_(True))
    expected = "cpu" if options.get("checkpoint_in_cpu") else "cuda"
    assert {t.device.type for t in meter.tensors} == {expected}


def test_non_reentrant_with_partition_config_warns_and_stays_correct(monkeypatch):
    from deepspeed.runtime.activation_checkpointing import checkpointing as impl
    monkeypatch.setattr(impl, "_warned_reentrant_only", False)
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    deepspeed.utils.logger.addHandler(handler)
    try:
        ckpt.configure(None, partition_activations=True)
        x = torch.randn(3, requires_grad=True)
        (g,) = torch.autograd.grad(ckpt.non_reentrant_checkpoint(torch.sin, x).sum(), x)
    finally:
        deepspeed.utils.logger.removeHandler(handler)
    assert torch.equal(g, torch.cos(x.detach()))
    assert any("reentrant checkpoint only" in m for m in records), records


def test_retain_graph_backward_twice():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    lin(x).sum().backward()
    once = lin.weight.grad.clone()
    lin.weight.grad = None
    y = ckpt.checkpoint(lin, x).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert torch.equal(lin.weight.grad, 2 * once)
    # With the contiguous buffer the slot is reused after the first backward: refused, not silently wrong.
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    y = ckpt.checkpoint(lin, x).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()
