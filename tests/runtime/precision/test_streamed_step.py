"""The streamed 16-bit step (host-memory masters, 16-bit gradients, the config's Adam):
gradients are cast chunk by chunk into a small staging buffer instead of a whole fp32 copy.

Checked against independent references: ``FusedAdam.step_streamed`` against
``torch.optim.AdamW`` / ``Adam`` on the same tensors; the engine's streamed step at ZeRO
stages 0, 1, 2 (world size 2, bf16 and fp16, clipping on) against the whole-buffer step
of the same engine and against plain fp32 PyTorch AdamW on the same global batches. The
chunk is shrunk to 7 elements so chunks straddle buckets, fragments and partitions.
"""
import pytest
import torch

from deepspeed.ops.adam import FusedAdam
from tests.helpers.dist import run_distributed
from tests.helpers.models import global_batches
from tests.runtime.zero._common import build_engine, ds_config, full_fp32, make_net, param_groups, run_steps

N_STEPS, MB, GAS, CHUNK = 3, 2, 2, 7
# eps comparable to the gradients makes Adam's update depend on the gradient's scale, so a
# missing unscale, average or clip in the streamed path would show against the reference
ADAM = {"lr": 0.01, "eps": 0.05}


@pytest.mark.parametrize("adamw", [True, False])
def test_step_streamed_equals_torch_adam(adamw):
    torch.manual_seed(0)
    p0 = torch.randn(50)
    grads = [torch.randn(50) for _ in range(3)]
    ours = torch.nn.Parameter(p0.clone())
    ref = torch.nn.Parameter(p0.clone())
    opt = FusedAdam([ours], lr=0.01, weight_decay=0.1, adam_w_mode=adamw)
    ref_opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref], lr=0.01, weight_decay=0.1)
    assert opt.supports_streamed_step()
    staging = torch.empty(CHUNK)
    for g in grads:
        seen = []
        opt.step_streamed(lambda p, lo, hi, out: out.copy_(g[lo:hi]), staging,
                          lambda p, lo, hi: seen.append((lo, hi)))
        ref.grad = g.clone()
        ref_opt.step()
        assert seen == [(lo, min(50, lo + CHUNK)) for lo in range(0, 50, CHUNK)]  # each chunk once, in order
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert float(opt.state[ours]["step"]) == 3.0
    torch.testing.assert_close(opt.state[ours]["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"], rtol=1e-6, atol=0)


def test_streamed_step_needs_matching_state_dtype():
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    assert not DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]).supports_streamed_step()
    assert not FusedAdam([torch.nn.Parameter(torch.zeros(2, 2))]).supports_streamed_step()   # not flat


CASES = [(stage, dtype) for stage in (0, 1, 2) for dtype in ("bf16", "fp16")]


def _config(stage, dtype):
    return dict(ds_config(stage, GAS, MB, dtype), optimizer={"type": "AdamW", "params": dict(ADAM)})


def _reference(global_batch, clip=0.5):
    """Plain fp32 PyTorch AdamW on the same global batches (same groups and clipping)."""
    model = make_net(0)
    opt = torch.optim.AdamW(param_groups(model), **ADAM)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for x, y in global_batches(N_STEPS, global_batch):
        opt.zero_grad()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(trainable, clip)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _body(rank, world_size):
    out = {}
    for stage, dtype in CASES:
        for streamed in (True, False):
            engine = build_engine(_config(stage, dtype))
            opt = engine.optimizer
            if streamed:
                opt.stream_chunk = CHUNK
            else:
                opt._streamed = False  # the whole-buffer path, for comparison
            run_steps(engine, rank, world_size, global_batches(N_STEPS, MB * GAS * world_size), dtype)
            out[(stage, dtype, streamed)] = {
                "used": opt._use_streamed_step(), "fp32": full_fp32(engine), "inner": type(opt.inner).__name__,
                "module": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
                "skipped": engine.skipped_steps, "norm": opt.last_grad_norm}
            engine.destroy()
    return out


def test_streamed_step_matches_whole_buffer_and_plain_pytorch():
    res = run_distributed(_body, 2, timeout=240)
    ref = _reference(MB * GAS * 2)
    for stage, dtype in CASES:
        s, w = res[0][(stage, dtype, True)], res[0][(stage, dtype, False)]
        assert s["used"] and not w["used"], (stage, dtype)
        assert s["inner"] == "FusedAdam" and s["skipped"] == w["skipped"] == 0
        # same step, only the gradient's route differs (the norm's summation order too)
        assert s["norm"] == pytest.approx(w["norm"], rel=1e-5)
        for name, want in ref.items():
            torch.testing.assert_close(s["fp32"][name], w["fp32"][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=(stage, dtype, name): f"{k} streamed vs whole: {m}")
            torch.testing.assert_close(s["fp32"][name], want, rtol=0, atol=5e-4 if dtype == "bf16" else 2e-4,
                                       msg=lambda m, k=(stage, dtype, name): f"{k} vs plain fp32 PyTorch: {m}")
        for r in res:  # the 16-bit parameters are the masters rounded, on every rank
            for name, p in r[(stage, dtype, True)]["module"].items():
                if name in s["fp32"]:
                    assert torch.equal(p, s["fp32"][name].to(p.dtype)), (stage, dtype, name)
