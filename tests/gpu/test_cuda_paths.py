"""The CUDA paths, checked on a real GPU against plain PyTorch on the same GPU.

Skipped where no CUDA device is visible (CI). Each test runs its body in a fresh spawned
process (tests/helpers/dist.py, world size 1, NCCL initialised through
``deepspeed.init_distributed``) so one failure - even a CUDA error that poisons the
context - cannot cascade into the next test, and process groups never leak.

Every test compares against an independent reference: plain PyTorch (``torch.optim.AdamW``
/ ``SGD``, ``F.scaled_dot_product_attention``, Hugging Face's ``BertLayer``, a no-offload
or no-checkpointing run, Python file I/O) on the same device and the same data.

``DS_GPU_TESTS_ON_CPU=1`` runs the device-independent bodies on the CPU (gloo) to check
the test logic itself on a machine without a GPU; CUDA-only checks are then skipped.
Run on a GPU box: ``python -m pytest tests/gpu -q -rA -n 4``.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

# Deterministic cuBLAS for the bit-identical resume check; must precede CUDA initialisation
# (spawned bodies import this module before running, so they get it too).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.helpers.dist import free_port, run_distributed  # noqa: E402

HAVE_CUDA = torch.cuda.is_available()
ON_CPU = os.environ.get("DS_GPU_TESTS_ON_CPU") == "1" and not HAVE_CUDA
DEV = "cuda" if HAVE_CUDA else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not (HAVE_CUDA or ON_CPU), reason="needs a CUDA device")
cuda_only = pytest.mark.skipif(not HAVE_CUDA, reason="CUDA-specific checks (dry run on CPU)")


# ============================================================================ helpers
def _spawn(fn, *args, timeout=120):
    """Run ``fn(0, 1, *args)`` in a fresh process; its return value (plain data) comes back."""
    return run_distributed(fn, 1, args=args, timeout=timeout, init_pg=False)[0]


def _init():
    """In the spawned body: exact fp32 matmuls and a world of one on NCCL (gloo on CPU)."""
    import deepspeed
    import torch.distributed as dist
    torch.set_float32_matmul_precision("highest")
    if DEV == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if DEV == "cuda" else "gloo", verbose=False)
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert dist.get_backend() == ("nccl" if DEV == "cuda" else "gloo")
    from deepspeed.accelerator import get_accelerator
    assert get_accelerator().device_name() == DEV, get_accelerator().device_name()


def _close(got, want, atol, rtol, what):
    assert set(got) == set(want), f"{what}: names differ {set(got) ^ set(want)}"
    for k in want:
        g, w = got[k].detach().float().cpu(), want[k].detach().float().cpu()
        assert g.shape == w.shape, f"{what}: {k} shape {tuple(g.shape)} vs {tuple(w.shape)}"
        err = (g - w).abs().max().item() if g.numel() else 0.0
        assert torch.allclose(g, w, atol=atol, rtol=rtol), f"{what}: {k} differs by up to {err:.3g}"


def _max_err(got, want):
    return max((got[k].float().cpu() - want[k].float().cpu()).abs().max().item() for k in want)


# ============================================================================ models
V, D, HEADS, T, NL = 64, 32, 4, 16, 2


class GPTBlock(nn.Module):
    def __init__(self, d=D, heads=HEADS, p=0.0):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1 = nn.LayerNorm(d)
        # no qkv bias: softmax ignores a key bias, so its gradient is rounding noise that
        # Adam would blow up into lr-sized, order-dependent updates
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, c)), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


class TinyGPT(nn.Module):
    """Token + position embeddings, ``layers`` pre-LN blocks, LM head tied to the embedding."""

    def __init__(self, layers=NL, p=0.0):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.1)
        self.blocks = nn.ModuleList(GPTBlock(p=p) for _ in range(layers))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1))


def make_gpt(seed=0, round_to=None, **kw):
    """``round_to`` (a 16-bit dtype): start from weights that dtype represents exactly. ZeRO-3
    builds its fp32 masters from the 16-bit partitions (as DeepSpeed does), stages 0-2 from the
    fp32 weights; on representable weights both equal the fp32 reference's start."""
    torch.manual_seed(seed)
    model = TinyGPT(**kw)
    if round_to is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(round_to).float())
    return model


def param_groups(model):
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    other = [p for _, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]


def lm_batches(n, batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randint(0, V, (batch, T + 1), generator=g)
        out.append((idx[:, :-1].to(DEV), idx[:, 1:].to(DEV)))
    return out


def zero_config(stage, *, gas=2, mb=4, clip=1.0, dtype="fp32", optimizer=None, **zero):
    cfg = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "steps_per_print": 0, "wall_clock_breakdown": False,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096,
                                 "stage3_param_persistence_threshold": 0, **zero}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif isinstance(dtype, dict):   # an fp16 section
        cfg["fp16"] = dtype
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    return cfg


ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}}


def torch_adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)


def torch_sgd(groups):
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def train_engine(engine, batches, overflow_at=None):
    """One optimizer step per global batch; returns (micro losses, grad norms, loss scales)."""
    gas, mb = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    losses, norms, scales = [], [], []
    for i, (x, y) in enumerate(batches):
        for m in range(gas):
            loss = engine(x[m * mb:(m + 1) * mb], y[m * mb:(m + 1) * mb])
            losses.append(loss.item())
            if overflow_at == i and m == gas - 1:
                loss = loss * float("inf")   # forced overflow: every gradient becomes inf/nan
            engine.backward(loss)
            engine.step()
        norms.append(engine.get_global_grad_norm())
        scales.append(float(engine.loss_scale))
    return losses, norms, scales


def train_reference(model, opt, batches, gas, mb, clip, skip=()):
    """Plain PyTorch over the same global batches (mean loss over the micro-batches)."""
    losses, norms = [], []
    params = [p for p in model.parameters() if p.requires_grad]
    for i, (x, y) in enumerate(batches):
        if i in skip:
            continue
        opt.zero_grad(set_to_none=True)
        for m in range(gas):
            loss = model(x[m * mb:(m + 1) * mb], y[m * mb:(m + 1) * mb])
            losses.append(loss.item())
            (loss / gas).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))))
        opt.step()
    return losses, norms


def engine_masters(engine):
    """{name: full fp32 master} (collective at ZeRO 1-3)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).detach().float().cpu() for n, p in engine.module.named_parameters()}


def model_params(model):
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def assert_on_device(engine, stage):
    assert engine.device.type == DEV, engine.device
    for n, p in engine.module.named_parameters():
        home = p.ds_tensor if stage == 3 else p
        assert home.device.type == DEV, f"{n} lives on {home.device}"


def _16bit_dtype(cfg):
    if cfg.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if cfg.get("fp16", {}).get("enabled"):
        return torch.float16
    return None


def build_engine(cfg, seed=0, optimizer=None, **model_kw):
    import deepspeed
    model = make_gpt(seed, round_to=_16bit_dtype(cfg), **model_kw)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg,
                                      optimizer=optimizer)
    return engine


# ============================================================================ accelerator + comm
def _accelerator_body(rank, world):
    _init()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    acc = get_accelerator()
    assert isinstance(acc, CUDA_Accelerator)
    assert acc.device_name() == "cuda" and acc.device_name(0) == "cuda:0"
    assert acc.current_device() == 0 and acc.current_device_name() == "cuda:0"
    assert acc.device(0) == torch.device("cuda", 0)
    assert acc.device_count() == torch.cuda.device_count() >= 1
    assert acc.communication_backend_name() == "nccl"
    assert acc.is_bf16_supported() == torch.cuda.is_bf16_supported()
    assert acc.is_fp16_supported()
    assert "CUDA_VISIBLE_DEVICES" in acc.visible_devices_envs()
    # memory statistics follow torch.cuda's
    acc.synchronize()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    assert before == torch.cuda.memory_allocated()
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")   # 64 MiB
    assert acc.memory_allocated() - before >= 64 << 20
    assert acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.max_memory_allocated() == torch.cuda.max_memory_allocated()
    del big
    acc.empty_cache()
    assert acc.memory_allocated() == before
    assert acc.max_memory_allocated() >= before + (64 << 20)       # the peak remembers
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() < before + (64 << 20)
    assert acc.total_memory() == torch.cuda.get_device_properties(0).total_memory
    assert 0 < acc.available_memory() <= acc.total_memory()
    # pinned host memory
    t = torch.arange(1000, dtype=torch.float32)
    pt = acc.pin_memory(t)
    assert pt.is_pinned() and acc.is_pinned(pt) and not acc.is_pinned(t)
    assert torch.equal(pt, t)
    dev_t = pt.to("cuda", non_blocking=True)
    acc.synchronize()
    assert torch.equal(dev_t.cpu(), t) and acc.on_accelerator(dev_t) and not acc.on_accelerator(t)
    # streams and events: work on a side stream, ordered by an event, timed
    s = acc.Stream()
    assert isinstance(s, torch.cuda.Stream)
    main = acc.current_stream()
    assert main == torch.cuda.current_stream()
    x = torch.randn(512, 512, device="cuda")
    start, done = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    s.wait_stream(main)
    with acc.stream(s):
        assert acc.current_stream() == s
        start.record()
        y = x @ x
        done.record()
    assert acc.current_stream() == main
    main.wait_event(done)
    z = y.sum()
    done.synchronize()
    assert start.elapsed_time(done) >= 0.0
    torch.testing.assert_close(z, (x @ x).sum(), rtol=1e-4, atol=1e-2)
    # RNG: manual_seed reproduces, get/set_rng_state round-trips, default generator is CUDA's
    acc.manual_seed(1234)
    a = torch.randn(16, device="cuda")
    acc.manual_seed(1234)
    assert torch.equal(a, torch.randn(16, device="cuda"))
    st = acc.get_rng_state()
    b = torch.randn(16, device="cuda")
    acc.set_rng_state(st)
    assert torch.equal(b, torch.randn(16, device="cuda"))
    acc.manual_seed_all(7)
    assert acc.default_generator(0).initial_seed() == 7
    assert acc.default_generator(0).device.type == "cuda"
    return True


@cuda_only
@pytest.mark.timeout(150)
def test_accelerator_api_on_cuda():
    assert _spawn(_accelerator_body)


def _comm_body(rank, world):
    _init()
    import torch.distributed as dist

    import deepspeed.comm as dc
    dev = torch.device(DEV)
    assert dc.is_initialized() and dc.get_rank() == 0 and dc.get_world_size() == 1
    assert dc.get_backend() == ("nccl" if DEV == "cuda" else "gloo")
    base = torch.arange(12, dtype=torch.float32, device=dev) - 3.5
    # deepspeed.comm (short-circuits a world of one) ...
    x = base.clone()
    dc.all_reduce(x)
    assert torch.equal(x, base)
    out = torch.empty(12, device=dev)
    dc.all_gather_into_tensor(out, base)
    assert torch.equal(out, base)
    rs = torch.empty(12, device=dev)
    dc.reduce_scatter_tensor(rs, base)
    assert torch.equal(rs, base)
    b = base.clone()
    dc.broadcast(b, 0)
    assert torch.equal(b, base)
    lst = [torch.empty_like(base)]
    dc.all_gather(lst, base)
    assert torch.equal(lst[0], base)
    w = dc.all_reduce(base.clone(), async_op=True)
    assert w is not None, "a short-circuited async_op collective must still return a waitable handle"
    w.wait()
    dc.barrier()
    if DEV != "cuda":   # gloo lacks reduce_scatter_tensor; the part below is about NCCL
        return {"async_returns_work": w is not None}
    # ... and the same collectives straight on the NCCL process group, so NCCL itself runs
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        t = base.to(dtype)
        x = t.clone()
        dist.all_reduce(x)
        assert torch.equal(x, t), dtype
        x = t.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        assert torch.equal(x, t), dtype
        g = torch.empty(12, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(g, t)
        assert torch.equal(g, t), dtype
        r = torch.empty(12, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(r, t)
        assert torch.equal(r, t), dtype
        c = t.clone()
        work = dist.broadcast(c, 0, async_op=True)
        work.wait()
        assert torch.equal(c, t), dtype
    objs = [None]
    dist.all_gather_object(objs, {"rank": 0})
    assert objs == [{"rank": 0}]
    dist.barrier()
    if DEV == "cuda":
        torch.cuda.synchronize()
    return {"async_returns_work": w is not None}


@pytest.mark.timeout(150)
def test_comm_collectives_world_of_one_on_nccl():
    _spawn(_comm_body)


class _WorldMPU:
    """An mpu that claims two model-parallel ranks but whose group is the world of one: the
    model-parallel reductions run (on NCCL) instead of being skipped, and change nothing."""

    def get_model_parallel_world_size(self):
        return 2

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_group(self):
        import torch.distributed as dist
        return dist.group.WORLD


def _host_values_body(rank, world):
    """The helpers that build a flag, count or norm on the host and reduce it: on NCCL each
    must move it to the GPU first (NCCL rejects CPU tensors even in a world of one)."""
    _init()
    import torch.distributed as dist

    import deepspeed.comm as dc
    from deepspeed.comm import comms_logging
    from deepspeed.ops.sparse_attention import DenseSparsityConfig, SparseSelfAttention
    from deepspeed.runtime.utils import CheckOverflow, clip_grad_norm_, get_grad_norm, global_grad_norm
    from deepspeed.runtime.zero.utils import get_lst_from_rank0
    want = torch.device("cuda", torch.cuda.current_device()) if DEV == "cuda" else torch.device("cpu")
    assert dc.comm_device() == want, dc.comm_device()
    assert dc.to_comm_device(torch.ones(2)).device == want
    # overflow check: the flag is a host tensor, reduced over the world (and the mpu's group)
    assert CheckOverflow().check_using_norm([1.0]) is False
    assert CheckOverflow().check_using_norm([float("inf")]) is True
    assert CheckOverflow(mpu=_WorldMPU()).check_using_norm([float("nan")]) is True
    p = torch.nn.Parameter(torch.zeros(4, device=DEV))
    p.grad = torch.full((4,), 3.0, device=DEV)
    assert CheckOverflow([[p]]).check() is False
    p.grad[0] = float("inf")
    assert CheckOverflow([[p]]).has_overflow([p]) is True
    # norms reduced over the model-parallel group: host float64 scalars
    p.grad = torch.full((4,), 3.0, device=DEV)
    assert math.isclose(get_grad_norm([p], mpu=_WorldMPU()), 6.0)
    assert get_grad_norm([p], norm_type=float("inf"), mpu=_WorldMPU()) == 3.0
    assert math.isclose(clip_grad_norm_([p], 100.0, mpu=_WorldMPU()), 6.0)
    assert global_grad_norm([p], mpu=_WorldMPU()) == 6.0
    q = torch.nn.Parameter(torch.zeros(2, device=DEV))   # no gradient: a CPU zero is reduced
    assert global_grad_norm([q], mpu=_WorldMPU(), extra_group=None) == 0.0
    # ZeRO's list check (a broadcast), the comms logger's straggler column (an all-reduce),
    # sparse attention's layout broadcast from a module still on the host
    assert get_lst_from_rank0([3, 1, 4]) == [3, 1, 4]
    dc.configure(enabled=True, prof_all=True)
    try:
        dc.all_reduce(torch.ones(8, device=DEV))
        text = comms_logging.log_summary(show_straggler=True)
    finally:
        dc.configure(enabled=False)
    assert "straggler" in text
    attn = SparseSelfAttention(DenseSparsityConfig(num_heads=2, block=16), max_seq_length=64)
    assert attn.master_layout.device.type == "cpu"
    assert int(attn.get_layout(64).sum()) == 2 * 4 * 4
    # async handles: deepspeed.comm's short-circuited ops and NCCL's own work objects
    x = torch.ones(4, device=DEV)
    w = dc.all_reduce(x, async_op=True)
    assert w is not None and w.wait() is not False and w.is_completed()
    w = dc.broadcast(x, 0, async_op=True)
    w.wait()
    assert torch.equal(x, torch.ones(4, device=DEV))
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    assert torch.equal(x, torch.ones(4, device=DEV))
    if DEV == "cuda":
        torch.cuda.synchronize()
    return True


@pytest.mark.timeout(150)
def test_host_side_values_reduce_on_nccl_world_of_one():
    assert _spawn(_host_values_body)


# ============================================================================ fp32 ZeRO 0-3 == torch AdamW
STEPS, MB, GAS = 4, 4, 2


def _fp32_body(rank, world, stage):
    _init()
    batches = lm_batches(STEPS, MB * GAS)
    engine = build_engine(zero_config(stage, gas=GAS, mb=MB, optimizer=ADAMW))
    assert_on_device(engine, stage)
    losses, norms, _ = train_engine(engine, batches)
    got = engine_masters(engine)
    ref_model = make_gpt(0).to(DEV)
    ref_losses, ref_norms = train_reference(ref_model, torch_adamw(param_groups(ref_model)), batches, GAS, MB, 1.0)
    want = model_params(ref_model)
    assert engine.global_steps == STEPS and engine.skipped_steps == 0
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), f"micro-step {i}: loss {a} vs reference {b}"
    for i, (a, b) in enumerate(zip(norms, ref_norms)):
        assert a is not None and math.isclose(a, b, rel_tol=1e-4), f"step {i}: grad norm {a} vs reference {b}"
    assert ref_norms[0] > 1.0, "clipping should be active for this check to mean anything"
    _close(got, want, atol=1e-5, rtol=1e-5, what=f"fp32 stage {stage}")
    inner = getattr(engine.optimizer, "inner", engine.optimizer)
    return {"max_err": _max_err(got, want), "inner": type(inner).__name__}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_zero_stage_matches_torch_adamw(stage):
    _spawn(_fp32_body, stage)


# ============================================================================ bf16 / fp16
# 16-bit forward/backward, fp32 masters; the reference is fp32 plain PyTorch (SGD with momentum:
# unlike Adam it does not amplify rounding noise in small gradients into lr-sized updates).
# Stated tolerances: masters within 2e-3 absolute of the fp32 reference after 4 steps, and
# the distance to the reference under 2% of the distance the reference moved.
TOL16 = dict(atol=2e-3, rel_update=0.02)


def _check_16bit(engine, got, batches, skip, stage, dtype, what):
    ref_model = make_gpt(0, round_to=dtype).to(DEV)
    init = model_params(ref_model)
    train_reference(ref_model, torch_sgd(param_groups(ref_model)), batches, GAS, MB, 1.0, skip=skip)
    want = model_params(ref_model)
    moved = math.sqrt(sum(((want[k] - init[k]) ** 2).sum().item() for k in want))
    off = math.sqrt(sum(((got[k] - want[k]) ** 2).sum().item() for k in want))
    assert off <= TOL16["rel_update"] * moved, f"{what}: distance to reference {off:.3g} vs update {moved:.3g}"
    _close(got, want, atol=TOL16["atol"], rtol=0, what=what)
    # the module's 16-bit parameters are the masters rounded
    sd = engine.module_state_dict()
    for n in got:
        assert sd[n].dtype == dtype, (n, sd[n].dtype)
        assert torch.equal(sd[n].cpu(), got[n].to(dtype)), f"{what}: 16-bit {n} is not its master rounded"
    return {"off": off, "moved": moved, "max_err": _max_err(got, want)}


def _bf16_body(rank, world, stage):
    _init()
    batches = lm_batches(STEPS, MB * GAS)
    engine = build_engine(zero_config(stage, gas=GAS, mb=MB, dtype="bf16"), optimizer=torch_sgd)
    assert_on_device(engine, stage)
    losses, _, _ = train_engine(engine, batches)
    assert all(math.isfinite(v) for v in losses)
    assert engine.skipped_steps == 0
    return _check_16bit(engine, engine_masters(engine), batches, (), stage, torch.bfloat16, f"bf16 stage {stage}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_zero_stage_matches_fp32_reference(stage):
    _spawn(_bf16_body, stage)


# init 2**8, window 2, hysteresis 1: DeepSpeed 0.19's rule gives these scales after each of 6
# steps when step 2 overflows (a clean step doubles when the clean steps before it since the start
# or the last overflow are a positive multiple of 2; overflow: /2, restart the count).
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1, "min_loss_scale": 1}
FP16_SCALES = [256.0, 256.0, 128.0, 128.0, 128.0, 256.0]
OVERFLOW_AT = 2


def _fp16_body(rank, world, stage):
    _init()
    batches = lm_batches(len(FP16_SCALES), MB * GAS, seed=5)
    engine = build_engine(zero_config(stage, gas=GAS, mb=MB, dtype=dict(FP16)), optimizer=torch_sgd)
    assert_on_device(engine, stage)
    assert engine.loss_scale == 256.0
    before = None
    scales = []
    for i, batch in enumerate(batches):
        if i == OVERFLOW_AT:
            before = engine_masters(engine)
        _, _, sc = train_engine(engine, [batch], overflow_at=0 if i == OVERFLOW_AT else None)
        scales += sc
        if i == OVERFLOW_AT:
            assert not engine.was_step_applied, "the overflowing step was applied"
            after = engine_masters(engine)
            for n in before:
                assert torch.equal(before[n], after[n]), f"skipped step changed {n}"
        else:
            assert engine.was_step_applied
    assert engine.skipped_steps == 1, engine.skipped_steps
    assert scales == FP16_SCALES, scales
    assert engine.global_steps == len(batches)
    return _check_16bit(engine, engine_masters(engine), batches, (OVERFLOW_AT,), stage, torch.float16,
                        f"fp16 stage {stage}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_dynamic_loss_scale_skips_overflow(stage):
    _spawn(_fp16_body, stage)


# ============================================================================ CPU offload
OFFLOAD_CASES = {
    "z2_offload_optimizer": (2, "fp32", {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    "z3_offload_optimizer": (3, "fp32", {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    "z3_offload_optimizer_and_param": (3, "fp32", {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                                                   "offload_param": {"device": "cpu", "pin_memory": True}}),
    "z3_offload_both_bf16": (3, "bf16", {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                                         "offload_param": {"device": "cpu", "pin_memory": True}}),
}


def _offload_body(rank, world, name):
    _init()
    stage, dtype, zero = OFFLOAD_CASES[name]
    batches = lm_batches(STEPS, MB * GAS, seed=3)
    base = build_engine(zero_config(stage, gas=GAS, mb=MB, dtype=dtype, optimizer=ADAMW))
    train_engine(base, batches)
    want = engine_masters(base)
    base.destroy()
    del base
    engine = build_engine(zero_config(stage, gas=GAS, mb=MB, dtype=dtype, optimizer=ADAMW, **zero))
    assert engine.device.type == DEV
    opt = engine.optimizer
    # the fp32 masters (and with offload_param the parameter partitions) live in pinned host memory
    if stage == 3:
        masters = [c.master for c in opt.parts.chunks]
        if "offload_param" in zero:
            for n, p in engine.module.named_parameters():
                assert p.ds_tensor.device.type == "cpu", n
                assert p.ds_tensor.is_pinned() or DEV == "cpu", n
    else:
        masters = [m for m in opt.masters if m is not None]
    assert masters and all(m.device.type == "cpu" and m.dtype == torch.float32 for m in masters)
    if DEV == "cuda":
        assert all(m.is_pinned() for m in masters), "offload_optimizer.pin_memory: masters not pinned"
    assert type(opt.inner).__name__ == "DeepSpeedCPUAdam", type(opt.inner).__name__
    train_engine(engine, batches)
    got = engine_masters(engine)
    # fp32: CPU Adam vs the fused GPU Adam, same math; bf16: the same 16-bit forward/backward,
    # gradients reduced on the host instead of the GPU
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "fp32" else dict(atol=5e-3, rtol=0)
    _close(got, want, what=name, **tol)
    for n, p in engine.module.named_parameters():
        if stage != 3:
            assert p.device.type == DEV
    return {"max_err": _max_err(got, want)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(OFFLOAD_CASES))
def test_cpu_offload_matches_no_offload(name):
    _spawn(_offload_body, name)


# ============================================================================ NVMe offload (ZeRO-Infinity)
NVME_CASES = {
    "z2_optimizer_nvme": (2, "fp32", ("offload_optimizer",)),
    "z3_optimizer_and_param_nvme": (3, "fp32", ("offload_optimizer", "offload_param")),
    "z3_optimizer_and_param_nvme_bf16": (3, "bf16", ("offload_optimizer", "offload_param")),
}


def _nvme_body(rank, world, name):
    """Training on the GPU with state on NVMe equals the same run with that state in (pinned)
    host memory: the same CPU optimizer on the same gradients, so fp32 is bit-identical; the
    checkpoint of the NVMe run resumes to the same masters; swap files are gone after destroy."""
    import tempfile
    _init()
    stage, dtype, where = NVME_CASES[name]
    batches = lm_batches(STEPS, MB * GAS, seed=5)
    root = tempfile.mkdtemp(prefix="gpu_nvme_")
    nvme = os.path.join(root, "swap")
    os.makedirs(nvme)

    def sections(device):
        out = {"sub_group_size": 20000}
        for key in where:
            sec = {"device": device, "pin_memory": True}
            if device == "nvme":
                sec["nvme_path"] = nvme
                if key == "offload_param":
                    sec.update(buffer_count=4, buffer_size=200000, max_in_cpu=0)
            out[key] = sec
        return out

    ref = build_engine(zero_config(stage, gas=GAS, mb=MB, dtype=dtype, optimizer=ADAMW, **sections("cpu")))
    train_engine(ref, batches)
    want = engine_masters(ref)
    ref.destroy()
    del ref
    engine = build_engine(zero_config(stage, gas=GAS, mb=MB, dtype=dtype, optimizer=ADAMW, **sections("nvme")))
    assert engine.device.type == DEV
    train_engine(engine, batches[:2])
    swap_files = [f for _, _, fs in os.walk(nvme) for f in fs]
    assert swap_files, "no swap files under nvme_path while training"
    ck = os.path.join(root, "ck")
    engine.save_checkpoint(ck, tag="t")
    train_engine(engine, batches[2:])
    got = engine_masters(engine)
    engine.destroy()
    assert not [f for _, _, fs in os.walk(nvme) for f in fs], "swap files left after destroy()"
    del engine
    # the same CPU optimizer on the same gradients; the host-memory run's streamed step may
    # order the fp32 arithmetic differently, so: within float rounding (fp32), bf16's tolerance
    _close(got, want, what=name, **(dict(atol=2e-6, rtol=1e-5) if dtype == "fp32" else dict(atol=5e-3, rtol=0)))
    resumed = build_engine(zero_config(stage, gas=GAS, mb=MB, dtype=dtype, optimizer=ADAMW, **sections("nvme")),
                           seed=1)
    resumed.load_checkpoint(ck, tag="t")
    train_engine(resumed, batches[2:])
    again = engine_masters(resumed)
    resumed.destroy()
    for n in got:
        assert torch.equal(again[n], got[n]), f"{name}: resumed {n} differs from the uninterrupted run"
    import shutil
    shutil.rmtree(root, ignore_errors=True)
    return {"swap_files": len(swap_files), "max_err_vs_host_memory": _max_err(got, want)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(NVME_CASES))
def test_nvme_offload_on_cuda_matches_host_memory_offload(name):
    _spawn(_nvme_body, name)


# ============================================================================ activation checkpointing
class DropBlock(nn.Module):
    def __init__(self, d, use_tracker):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.use_tracker = use_tracker

    def forward(self, x):
        h = F.dropout(F.gelu(self.fc1(x)), 0.2, self.training)
        if self.use_tracker:   # Megatron-style: dropout inside a model-parallel region
            from deepspeed.checkpointing import get_cuda_rng_tracker
            with get_cuda_rng_tracker().fork():
                h = F.dropout(h, 0.2, self.training)
        return x + self.fc2(h)


class DropStack(nn.Module):
    def __init__(self, d=64, layers=3, use_tracker=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(DropBlock(d, use_tracker) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x, ckpt=None):
        for b in self.blocks:
            x = ckpt(b, x) if ckpt is not None else b(x)
        return self.head(x).pow(2).mean()


def _ckpt_grads(model, x, ckpt=None, seed=123, x_requires_grad=True):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x_requires_grad)
    torch.manual_seed(seed)            # seeds the CUDA generator too
    loss = model(x, ckpt)
    torch.manual_seed(seed + 1)        # the recompute must not depend on the RNG at backward time
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if x_requires_grad:
        grads["<input>"] = x.grad.detach().clone()
    return loss.detach(), grads


def _reset_ckpt():
    from deepspeed.runtime.activation_checkpointing import checkpointing, settings
    from deepspeed.runtime.activation_checkpointing.rng import get_cuda_rng_tracker
    settings._reset_settings()
    checkpointing.reset()
    get_cuda_rng_tracker().reset()


def _activation_ckpt_body(rank, world):
    _init()
    import deepspeed.checkpointing as ckpt
    variants = [{}, {"partition_activations": True}, {"checkpoint_in_cpu": True},
                {"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 3},
                {"partition_activations": True, "checkpoint_in_cpu": True, "contiguous_checkpointing": True,
                 "num_checkpoints": 3}]
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(7)).to(DEV)
    report = {}
    for use_tracker in (False, True):
        model = DropStack(use_tracker=use_tracker).to(DEV)
        for xg in (True, False):
            _reset_ckpt()
            if use_tracker:
                ckpt.model_parallel_cuda_manual_seed(1234)
            ref_loss, ref = _ckpt_grads(model, x, x_requires_grad=xg)
            _reset_ckpt()
            if use_tracker:
                ckpt.model_parallel_cuda_manual_seed(1234)
            other_loss, _ = _ckpt_grads(model, x, seed=999, x_requires_grad=xg)
            assert not torch.equal(ref_loss, other_loss), "dropout did not use the seeded device generator"
            for v in variants:
                _reset_ckpt()
                if use_tracker:
                    ckpt.model_parallel_cuda_manual_seed(1234)
                ckpt.configure(None, **v)
                loss, got = _ckpt_grads(model, x, ckpt=ckpt.checkpoint, x_requires_grad=xg)
                what = f"tracker={use_tracker} x.requires_grad={xg} {v}"
                assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0), what
                _close(got, ref, atol=1e-6, rtol=1e-5, what=what)
                report[what] = all(torch.equal(got[k], ref[k]) for k in ref)
    # checkpoint_in_cpu keeps a pinned host copy of the input, not the device activation
    _reset_ckpt()
    ckpt.configure(None, checkpoint_in_cpu=True)
    saved = []
    model = DropStack().to(DEV)
    xin = x.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ckpt.checkpoint(model.blocks[0], xin)
    hosts = [t for t in saved if t.device.type == "cpu" and t.numel() == xin.numel()]
    assert hosts, [(t.device, tuple(t.shape)) for t in saved]
    if DEV == "cuda":
        assert hosts[0].is_pinned(), "checkpoint_in_cpu copy is not in pinned memory"
        torch.cuda.synchronize()
    assert torch.equal(hosts[0].view_as(xin), xin.detach().cpu())
    _reset_ckpt()
    return {"bitwise_equal": sum(report.values()), "cases": len(report)}


@pytest.mark.timeout(150)
def test_activation_checkpointing_with_dropout_matches_plain():
    _spawn(_activation_ckpt_body)


# ============================================================================ checkpoint save/load
class DropMLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc1 = nn.Linear(16, d)
        self.fc2 = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x, y):
        h = F.dropout(torch.tanh(self.fc1(x)), 0.1, self.training)
        h = F.dropout(torch.tanh(self.fc2(h)), 0.1, self.training)
        return F.mse_loss(self.out(h).float(), y.float())


RESUME_CASES = {"z2_fp32": (2, "fp32"), "z3_bf16": (3, "bf16"), "z0_fp32": (0, "fp32")}


def _resume_body(rank, world, name, save_dir):
    _init()
    import deepspeed
    torch.use_deterministic_algorithms(True, warn_only=True)
    stage, dtype = RESUME_CASES[name]
    cast = torch.bfloat16 if dtype == "bf16" else torch.float32
    cfg = zero_config(stage, gas=1, mb=8, dtype=dtype, optimizer=ADAMW)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                       "warmup_num_steps": 10}}
    g = torch.Generator().manual_seed(11)
    data = [(torch.randn(8, 16, generator=g).to(DEV, cast), torch.randn(8, 4, generator=g).to(DEV, cast))
            for _ in range(6)]

    def make(seed):
        torch.manual_seed(seed)
        engine, *_ = deepspeed.initialize(model=DropMLP(), config=cfg)
        return engine

    def run(engine, batches):
        out = []
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    a = make(0)
    run(a, data[:3])
    a.save_checkpoint(save_dir, tag="mid", client_state={"data_pos": 3})
    losses_a = run(a, data[3:])
    masters_a, lr_a = engine_masters(a), a.get_lr()
    sd_a = {k: v.detach().cpu() for k, v in a.module_state_dict().items()}
    a.destroy()
    del a
    torch.manual_seed(999)                      # disturb every RNG: the checkpoint must restore them
    torch.randn(100, device=DEV)
    b = make(1)                                 # different initial weights: the load must overwrite them
    path, client = b.load_checkpoint(save_dir, tag="mid")
    assert path is not None and client.get("data_pos") == 3, (path, client)
    assert b.global_steps == 3
    assert_on_device(b, stage)
    losses_b = run(b, data[client["data_pos"]:])
    assert losses_a == losses_b, f"{name}: losses after resume {losses_b} vs uninterrupted {losses_a}"
    masters_b = engine_masters(b)
    for n in masters_a:
        assert torch.equal(masters_a[n], masters_b[n]), f"{name}: master {n} differs after resume"
    sd_b = {k: v.detach().cpu() for k, v in b.module_state_dict().items()}
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), f"{name}: module {k} differs after resume"
    assert b.get_lr() == lr_a and b.global_steps == 6
    return {"losses": losses_b}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_checkpoint_resume_is_bit_identical(name, tmp_path):
    _spawn(_resume_body, name, str(tmp_path / "ckpt"))


# ============================================================================ async I/O
def _aio_body(rank, world, tmp):
    _init()
    from deepspeed.ops.op_builder import AsyncIOBuilder
    aio = AsyncIOBuilder().load()
    h = aio.aio_handle(block_size=1 << 20, queue_depth=8, single_submit=False, overlap_events=False,
                       intra_op_parallelism=4)
    g = torch.Generator().manual_seed(0)

    def file_bytes(path):
        with open(path, "rb") as f:
            return f.read()

    def host_bytes(t):
        return t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()

    results = {}
    # device tensors (staged through host buffers by the handle), odd sizes, several dtypes
    for dtype, numel in ((torch.float32, (3 << 20) + 17), (torch.bfloat16, 4097), (torch.float16, 1),
                         (torch.int64, 100_003), (torch.uint8, (1 << 20) + 3)):
        if dtype.is_floating_point:
            src = (torch.randn(numel, generator=g) * 100).to(dtype).to(DEV)
        else:
            src = torch.randint(0, 250, (numel,), generator=g).to(dtype).to(DEV)
        path = os.path.join(tmp, f"dev_{dtype}_{numel}.bin".replace("torch.", ""))
        assert h.async_pwrite(src, path) == 0
        assert h.wait() == 1
        assert file_bytes(path) == host_bytes(src), f"{dtype}: file differs from the device tensor"
        dst = torch.zeros_like(src)
        assert h.async_pread(dst, path) == 0
        assert h.wait() == 1
        assert dst.device.type == DEV and torch.equal(dst, src), f"{dtype}: device read-back differs"
        dst2 = torch.zeros_like(src)
        assert h.sync_pread(dst2, path) == 1 and torch.equal(dst2, src)
        assert h.pwrite(src, path, True, False) == 1       # validate=True re-reads and compares
        dst3 = torch.zeros_like(src)
        assert h.pread(dst3, path, True, False) == 1 and torch.equal(dst3, src)
    # several overlapping async ops on one handle, at offsets of one file
    parts = [torch.randn(1 << 18, generator=g).to(DEV) for _ in range(4)]
    path = os.path.join(tmp, "multi.bin")
    nbytes = parts[0].numel() * 4
    for i, p in enumerate(parts):
        h.async_pwrite(p, path, i * nbytes) if i else h.sync_pwrite(p, path)
    assert h.wait() == 3
    back = [torch.empty_like(p) for p in parts]
    for i, b in enumerate(back):
        h.async_pread(b, path, i * nbytes)
    assert h.wait() == 4
    assert all(torch.equal(a, b) for a, b in zip(parts, back))
    # page-locked buffers from the handle: direct I/O, and usable as pinned staging for the GPU
    example = torch.empty(0, dtype=torch.float16)
    n = (1 << 20) + 5
    locked = h.new_cpu_locked_tensor(n, example)
    assert locked.dtype == torch.float16 and locked.numel() == n and h.is_pinned(locked)
    results["locked_is_cuda_pinned"] = bool(locked.is_pinned())
    ref = torch.randn(n, generator=g).half()
    locked.copy_(ref)
    path = os.path.join(tmp, "locked.bin")
    assert h.sync_pwrite(locked, path) == 1
    assert file_bytes(path) == host_bytes(ref)
    locked2 = h.new_cpu_locked_tensor(n, example)
    locked2.zero_()
    assert h.sync_pread(locked2, path) == 1 and torch.equal(locked2, ref)
    on_dev = locked2.to(DEV, non_blocking=True)
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(on_dev.cpu(), ref)
    back_host = torch.zeros_like(locked2)
    back_host.copy_(on_dev, non_blocking=True)
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(back_host, ref)
    assert h.free_cpu_locked_tensor(locked) and h.free_cpu_locked_tensor(locked2)
    assert not h.free_cpu_locked_tensor(torch.empty(3))
    # CUDA-pinned tensors (torch's allocator) round-trip too
    if DEV == "cuda":
        pinned = torch.randn(123_457, generator=g).pin_memory()
        assert h.is_pinned(pinned)
        path = os.path.join(tmp, "pinned.bin")
        assert h.sync_pwrite(pinned, path) == 1
        back = torch.empty_like(pinned).pin_memory()
        assert h.sync_pread(back, path) == 1 and torch.equal(back, pinned)
    stats = h.io_stats()
    results["io_stats"] = stats
    h.close()
    return results


@pytest.mark.timeout(150)
def test_aio_handle_round_trips_device_and_locked_tensors(tmp_path):
    _spawn(_aio_body, str(tmp_path))


# ============================================================================ sparse attention
def _sparse_body(rank, world):
    _init()
    import random

    import deepspeed.ops.sparse_attention.block_sparse as bs
    from deepspeed.ops.sparse_attention import (BigBirdSparsityConfig, BSLongformerSparsityConfig,
                                                DenseSparsityConfig, FixedSparsityConfig,
                                                SparseSelfAttention, VariableSparsityConfig)
    from deepspeed.ops.sparse_attention.sparse_self_attention import layout_to_element_mask
    bs.FUSED_CPU = False   # the op-by-op kernels, which are what runs on a GPU (matters for CPU dry runs only)
    H, L, Dh, BLK = 4, 256, 32, 16
    cfgs = [FixedSparsityConfig(H, BLK, different_layout_per_head=True, num_different_global_patterns=2),
            FixedSparsityConfig(H, BLK, attention="unidirectional"),
            VariableSparsityConfig(H, BLK, num_random_blocks=1, local_window_blocks=[1, 2], global_block_indices=[3]),
            BigBirdSparsityConfig(H, BLK, num_random_blocks=2),
            BSLongformerSparsityConfig(H, BLK, global_block_indices=[0, 5]),
            DenseSparsityConfig(H, BLK)]
    g = torch.Generator().manual_seed(5)
    errs = {}
    for ci, cfg in enumerate(cfgs):
        random.seed(11)
        att = SparseSelfAttention(cfg, key_padding_mask_mode="add", attn_mask_mode="mul", max_seq_length=512).to(DEV)
        for dtype, atol in ((torch.float32, 5e-5), (torch.bfloat16, 4e-2), (torch.float16, 8e-3)):
            B = 2
            q, k, v = (torch.randn(B, H, L, Dh, generator=g).to(DEV, dtype).requires_grad_() for _ in range(3))
            kp = torch.zeros(B, 1, 1, L, device=DEV)
            kp[1, ..., -9:] = -10000.0
            keep = torch.rand(L, L, generator=g) > 0.15
            keep.fill_diagonal_(True)
            am = keep.float().to(DEV)
            out = att(q, k, v, key_padding_mask=kp, attn_mask=am)
            assert out.device.type == DEV and out.dtype == dtype and out.shape == q.shape
            layout = att.get_layout(L)
            allowed = layout_to_element_mask(layout, BLK).to(DEV)            # [H, L, L]
            bias = (torch.where(allowed, 0.0, float("-inf"))[None]
                    + torch.where(keep.to(DEV), 0.0, float("-inf"))[None, None] + kp.float())
            # the reference: dense SDPA in fp32 on the same device, on the same (rounded) inputs
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=bias)
            gout = torch.randn(out.shape, generator=g).to(DEV)
            gs = torch.autograd.grad(out, (q, k, v), gout.to(dtype))
            gr = torch.autograd.grad(ref, (qf, kf, vf), gout)
            what = f"config {ci} {type(cfg).__name__} {dtype}"
            err = (out.float() - ref).abs().max().item()
            assert err <= atol, f"{what}: output differs from dense SDPA by {err:.3g}"
            for name, a, b in zip("qkv", gs, gr):
                e = (a.float() - b).abs().max().item()
                assert e <= 4 * atol, f"{what}: d{name} differs by {e:.3g}"
            errs[what] = err
    return errs


@pytest.mark.timeout(150)
def test_sparse_attention_matches_dense_sdpa_with_element_mask():
    _spawn(_sparse_body)


# ============================================================================ transformer layer
def _transformer_body(rank, world):
    _init()
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    from deepspeed.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer
    HID, NH, INTER, B, S = 64, 4, 256, 4, 32
    try:
        hcfg = BertConfig(hidden_size=HID, num_attention_heads=NH, intermediate_size=INTER, hidden_dropout_prob=0.1,
                          attention_probs_dropout_prob=0.1, attn_implementation="sdpa")
    except TypeError:
        hcfg = BertConfig(hidden_size=HID, num_attention_heads=NH, intermediate_size=INTER, hidden_dropout_prob=0.1,
                          attention_probs_dropout_prob=0.1)
    torch.manual_seed(0)
    hf = BertLayer(hcfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    hf = hf.to(DEV)
    a, o = hf.attention, hf.output
    w = [a.self.query.weight, a.self.key.weight, a.self.value.weight, a.output.dense.weight, a.output.LayerNorm.weight,
         hf.intermediate.dense.weight, o.dense.weight, o.LayerNorm.weight]
    b = [a.self.query.bias, a.self.key.bias, a.self.value.bias, a.output.dense.bias, a.output.LayerNorm.bias,
         hf.intermediate.dense.bias, o.dense.bias, o.LayerNorm.bias]

    def ds_cfg(**kw):
        return DeepSpeedTransformerConfig(batch_size=B, hidden_size=HID, intermediate_size=INTER, heads=NH,
                                          attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=2,
                                          initializer_range=0.02, layer_norm_eps=hcfg.layer_norm_eps,
                                          pre_layer_norm=False, **kw)
    ds = DeepSpeedTransformerLayer(ds_cfg(), w, b)
    assert all(p.device.type == DEV for p in ds.parameters())
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(B, S, HID, generator=gen).to(DEV)
    mask = torch.zeros(B, 1, 1, S, device=DEV)
    mask[1, ..., -7:] = -10000.0
    gout = torch.randn(B, S, HID, generator=gen).to(DEV)

    def run(layer, dtype):
        x = x0.detach().to(dtype).clone().requires_grad_()
        out = layer(x, mask.to(dtype))
        out = out[0] if isinstance(out, tuple) else out
        out.backward(gout.to(dtype))
        return out.detach().float(), x.grad.float()

    errs = {}
    for dtype, atol in ((torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 1e-1)):
        hf_d = hf.to(dtype).eval()
        ds_d = DeepSpeedTransformerLayer(ds_cfg(fp16=dtype == torch.float16), [t.to(dtype) for t in w],
                                         [t.to(dtype) for t in b]).eval()
        hf_d.zero_grad(set_to_none=True)
        o_hf, dx_hf = run(hf_d, dtype)
        o_ds, dx_ds = run(ds_d, dtype)
        e_out, e_dx = (o_ds - o_hf).abs().max().item(), (dx_ds - dx_hf).abs().max().item()
        assert e_out <= atol and e_dx <= 4 * atol, f"{dtype}: output err {e_out:.3g}, input-grad err {e_dx:.3g}"
        if dtype == torch.float32:
            hw = [a.self.query.weight, a.self.key.weight, a.self.value.weight]
            for got, ref in zip(ds_d.attn_qkvw.grad.chunk(3), hw):
                torch.testing.assert_close(got, ref.grad, atol=1e-3, rtol=1e-4)
            torch.testing.assert_close(ds_d.inter_w.grad, hf_d.intermediate.dense.weight.grad, atol=1e-3, rtol=1e-4)
        errs[str(dtype)] = (e_out, e_dx)
        hf = hf_d.float()
    # training mode on the device: dropout draws from the CUDA generator (same seed, same output;
    # another seed, another output) and backward gives finite gradients
    ds.train()
    torch.manual_seed(5)
    y1 = ds(x0, mask)
    torch.manual_seed(5)
    y2 = ds(x0, mask)
    torch.manual_seed(6)
    y3 = ds(x0, mask)
    assert torch.equal(y1, y2) and not torch.allclose(y1, y3)
    y1.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ds.parameters())
    # built without initial weights, local_rank 0: parameters are created on the GPU
    fresh = DeepSpeedTransformerLayer(ds_cfg(local_rank=0))
    assert all(p.device.type == DEV for p in fresh.parameters())
    return errs


@pytest.mark.timeout(150)
def test_transformer_layer_matches_hf_bert_layer():
    pytest.importorskip("transformers")
    _spawn(_transformer_body)


# ============================================================================ MoE
class MoENet(nn.Module):
    def __init__(self, d=32, experts=4, k=1, seed=0):
        super().__init__()
        from deepspeed.moe.layer import MoE
        torch.manual_seed(seed)
        self.inp = nn.Linear(16, d)
        expert = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.moe = MoE(d, expert, num_experts=experts, ep_size=1, k=k, capacity_factor=2.0, min_capacity=4,
                       use_rts=False, drop_tokens=True, top2_2nd_expert_sampling=False)
        self.out = nn.Linear(d, 4)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        m, aux, _ = self.moe(h)
        return F.mse_loss(self.out(h + m), y) + 0.01 * aux


def _moe_body(rank, world, stage):
    _init()
    import deepspeed
    g = torch.Generator().manual_seed(2)
    wt = torch.randn(16, 4, generator=g) / 4
    data = []
    for _ in range(40):
        x = torch.randn(8, 6, 16, generator=g)
        data.append((x.to(DEV), torch.tanh(x @ wt).to(DEV)))
    model = MoENet()
    assert any(getattr(p, "allreduce", True) is False for p in model.parameters()), "no expert parameters?"
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, eps=1e-4)
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 0, "gradient_clipping": 0.5,
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    assert all(p.device.type == DEV for p in engine.module.parameters())
    ref = MoENet().to(DEV)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=3e-3, eps=1e-4)
    losses, ref_losses = [], []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref_opt.zero_grad()
        rl = ref(x, y)
        rl.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_losses.append(rl.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, f"MoE stage {stage} did not train: {first:.4f} -> {last:.4f}"
    for i, (a, b) in enumerate(zip(losses[:10], ref_losses[:10])):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), f"step {i}: loss {a} vs plain {b}"
    got, want = engine_masters(engine), model_params(ref)
    _close(got, want, atol=1e-4, rtol=1e-4, what=f"MoE stage {stage}")
    return {"first": first, "last": last, "max_err": _max_err(got, want)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [0, 2])
def test_moe_layer_trains_in_engine_like_plain_pytorch(stage):
    _spawn(_moe_body, stage)


# ============================================================================ launcher
TRAIN_SCRIPT = textwrap.dedent("""
    import argparse, json, os
    import torch
    import deepspeed
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    cfg = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 0, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=g).to(engine.device, torch.bfloat16)
    y = x.float().sum(-1, keepdim=True).tanh().to(torch.bfloat16)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    import torch.distributed as dist
    rec = dict(device=str(engine.device), param_device=str(next(engine.module.parameters()).device),
               backend=dist.get_backend(), world=dist.get_world_size(), rank=dist.get_rank(),
               local_rank_arg=a.local_rank, env={k: os.environ.get(k) for k in
               ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES")},
               first=losses[0], last=losses[-1], deepspeed_file=deepspeed.__file__)
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(rec, f)
""")


@pytest.mark.timeout(150)
def test_launcher_num_gpus_1_runs_a_training_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(free_port()),
           str(script), "--out", str(tmp_path)]
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"launcher did not finish in 120 s: {str(err.stdout)[-2000:]} {str(err.stderr)[-2000:]}")
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    rec = json.loads((tmp_path / "result.json").read_text())
    assert rec["device"].startswith(DEV) and rec["param_device"].startswith(DEV), rec
    assert rec["backend"] == ("nccl" if DEV == "cuda" else "gloo"), rec
    assert rec["world"] == 1 and rec["rank"] == 0 and rec["env"]["LOCAL_RANK"] == "0", rec
    assert rec["local_rank_arg"] == 0, rec
    if DEV == "cuda":
        assert rec["env"]["CUDA_VISIBLE_DEVICES"] is not None, rec
    assert os.path.dirname(os.path.dirname(rec["deepspeed_file"])) == ROOT, rec["deepspeed_file"]
    assert rec["last"] < 0.5 * rec["first"], rec
