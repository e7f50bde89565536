"""Behaviours that differed from DeepSpeed (issue 12 section 3), single process.

Each test names its reference: "DeepSpeed source" (read as a fact from DeepSpeed's code:
file and function given) or "DeepSpeed docs", or "ours, better" where DeepSpeed fails and
we chose a working behaviour. Multi-process cases are in test_distributed_behaviours.py.
"""
import copy
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import deepspeed
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator, _numa_nodes_with_cores
from deepspeed.config import DeepSpeedConfig, DeepSpeedConfigError
from tests.helpers.models import make_model


@pytest.fixture
def caplog_ds(caplog):
    """Our logger does not propagate to the root logger; attach caplog's handler to it."""
    from deepspeed.utils.logging import logger
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING)
    yield caplog
    logger.removeHandler(caplog.handler)


def _cfg(**kw):
    base = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0}
    base.update(kw)
    return base


# ------------------------------------------------------------------ accelerator / launcher
def test_cpu_device_count_follows_local_size_then_numa(monkeypatch, tmp_path):
    """DeepSpeed source (accelerator/cpu_accelerator.py, device_count): LOCAL_SIZE when
    positive, else the number of NUMA nodes that have cores."""
    acc = CPU_Accelerator()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert acc.device_count() == 3
    monkeypatch.setenv("LOCAL_SIZE", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")   # torchrun's name, honoured next
    assert acc.device_count() == 5
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_SIZE")
    # A fake sysfs: two nodes with cores, one memory-only (HBM flat mode) node.
    for name, cores in (("node0", "0-3"), ("node1", "4-7"), ("node2", "")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cpulist").write_text(cores + "\n")
    assert _numa_nodes_with_cores(str(tmp_path)) == 2
    assert _numa_nodes_with_cores(str(tmp_path / "absent")) == 1
    assert acc.device_count() == _numa_nodes_with_cores()


def test_launcher_sets_local_size_and_cpu_visible_devices():
    """DeepSpeed source (launcher/launch.py main; CPU_Accelerator.visible_devices_envs returns
    ['CUDA_VISIBLE_DEVICES']): the per-node launcher exports LOCAL_SIZE and the selected slots
    (--include localhost:1,3) as CUDA_VISIBLE_DEVICES, on CPU too."""
    from deepspeed.launcher.launch import rank_environments
    envs = rank_environments({"localhost": [1, 3]}, 0, "127.0.0.1", 29500, base_env={})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1,3", "1,3"]
    assert [e["LOCAL_SIZE"] for e in envs] == ["2", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    # Each worker's device_count() then reports the node's process count.
    os.environ["LOCAL_SIZE"] = envs[0]["LOCAL_SIZE"]
    try:
        assert CPU_Accelerator().device_count() == 2
    finally:
        del os.environ["LOCAL_SIZE"]


# ------------------------------------------------------------------ engine
def test_backward_returns_the_loss_not_the_fp16_scaled_loss():
    """DeepSpeed 0.19 source (runtime/engine.py, backward): returns the loss after the gradient
    accumulation division (``loss / gas``, in the loss's dtype), never multiplied by the loss scale."""
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(
        gradient_accumulation_steps=2, fp16={"enabled": True, "initial_scale_power": 10},
        optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    assert engine.loss_scale == 1024
    x = torch.randn(2, 8).half()
    loss = engine(x, torch.randn(2, 4).half())
    out = engine.backward(loss)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, loss.detach() / 2)


def test_backward_return_without_accumulation_is_the_loss_itself():
    engine, *_ = deepspeed.initialize(model=make_model(), config=_cfg(
        optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    loss = engine(torch.randn(2, 8), torch.randn(2, 4))
    assert engine.backward(loss) is loss


def test_client_optimizer_wins_over_config_section(caplog_ds):
    """DeepSpeed source (runtime/engine.py, _configure_optimizer / _configure_lr_scheduler):
    an optimizer (or scheduler) passed to initialize is used and the config section ignored."""
    model = make_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, eopt, _, esched = deepspeed.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=_cfg(
            optimizer={"type": "Adam", "params": {"lr": 1.0}}, gradient_clipping=0.0,
            scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1.0}}))
    assert esched is sched
    text = caplog_ds.text
    assert "using the passed optimizer" in text and "using the passed scheduler" in text
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    engine.backward(engine(x, y))
    engine.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)  # the client's SGD, not the config's Adam
    torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step()
    for a, b in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)  # the client's StepLR stepped


def test_gradient_clipping_default_is_one():
    """DeepSpeed 0.19.3+ (runtime/constants.py GRADIENT_CLIPPING_DEFAULT = 1.0) and the config
    reference: with no `gradient_clipping` key the update clips the global gradient norm to 1.0."""
    model = make_model()
    ref = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    assert engine.gradient_clipping() == 1.0
    x, y = torch.randn(2, 8) * 50, torch.randn(2, 4) * 50   # gradient norm far above 1
    engine.backward(engine(x, y))
    engine.step()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    assert norm > 10
    with torch.no_grad():   # the documented formula: g * min(1, clip / (||g|| + 1e-6))
        for p in ref.parameters():
            p -= 0.1 * p.grad * (1.0 / (norm + 1e-6))
    for a, b in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_gradient_clipping_zero_turns_clipping_off():
    model = make_model()
    ref = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}},
                                                                gradient_clipping=0))
    assert engine.gradient_clipping() == 0.0
    x, y = torch.randn(2, 8) * 50, torch.randn(2, 4) * 50
    engine.backward(engine(x, y))
    engine.step()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for a, b in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def test_dataloader_drop_last():
    """DeepSpeed source (runtime/constants.py DATALOADER_DROP_LAST, default False; the engine
    passes it to DeepSpeedDataLoader)."""
    data = torch.utils.data.TensorDataset(torch.randn(10, 8), torch.randn(10, 4))
    sizes = {}
    for drop in (False, True):
        engine, _, loader, _ = deepspeed.initialize(
            model=make_model(), training_data=data,
            config=_cfg(train_micro_batch_size_per_gpu=4, dataloader_drop_last=drop))
        assert engine.dataloader_drop_last() is drop
        sizes[drop] = [len(b[0]) for b in loader]
    assert sizes == {False: [4, 4, 2], True: [4, 4]}


# ------------------------------------------------------------------ config
def test_legacy_zero_optimization_true_is_stage_1(caplog_ds):
    """DeepSpeed source (runtime/zero/config.py, read_zero_config_deprecated): a boolean
    ``zero_optimization`` means stage 1 (true) or 0 (false), the top-level ``allgather_size``
    is the all-gather bucket (default 5e8), and a deprecation warning is logged."""
    cfg = DeepSpeedConfig(_cfg(zero_optimization=True, allgather_size=4096), world_size=1)
    assert cfg.zero_optimization_stage == 1 and cfg.zero.allgather_bucket_size == 4096
    assert "deprecated" in caplog_ds.text
    assert DeepSpeedConfig(_cfg(zero_optimization=True), world_size=1).zero.allgather_bucket_size == 500_000_000
    assert DeepSpeedConfig(_cfg(zero_optimization=False), world_size=1).zero_optimization_stage == 0
    engine, *_ = deepspeed.initialize(model=make_model(), config=_cfg(
        zero_optimization=True, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    assert engine.zero_optimization_stage() == 1


@pytest.mark.parametrize("stage", [1, 2])
def test_odd_allgather_bucket_size_is_an_assertion(stage):
    """DeepSpeed source (runtime/zero/stage_1_and_2.py: ``assert allgather_bucket_size %
    nccl_start_alignment_factor == 0``; its unit test expects AssertionError)."""
    with pytest.raises(AssertionError, match="allgather_bucket_size must be a multiple of "
                                             "nccl_start_alignment_factor") as info:
        DeepSpeedConfig(_cfg(zero_optimization={"stage": stage, "allgather_bucket_size": 5001}), world_size=1)
    assert isinstance(info.value, DeepSpeedConfigError)
    # Even sizes, and any size at stages 0/3 (which do not use it), are accepted.
    DeepSpeedConfig(_cfg(zero_optimization={"stage": stage, "allgather_bucket_size": 5000}), world_size=1)
    DeepSpeedConfig(_cfg(zero_optimization={"stage": 3, "allgather_bucket_size": 5001}), world_size=1)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_param_below_stage_3_is_ignored(stage, caplog_ds):
    """DeepSpeed source (runtime/zero/config.py parses offload_param at any stage; only the
    stage 3 optimizer reads it). Accelerate writes it for every stage."""
    model = make_model()
    ref = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(
        zero_optimization={"stage": stage, "offload_param": {"device": "cpu"}}, gradient_clipping=0.0,
        optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    assert "ignored at stage" in caplog_ds.text
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    engine.backward(engine(x, y))
    engine.step()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for a, b in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ schedules / optimizers
def test_onecycle_get_mom_is_betas_tuples():
    """DeepSpeed source (runtime/lr_schedules.py, OneCycle._get_cycle_mom / _get_decay_mom):
    one ``(beta1, beta2)`` tuple per parameter group - the betas it writes. beta2 is the
    group's own here (DeepSpeed substitutes 0.99: ours, better)."""
    from deepspeed.runtime.lr_schedules import OneCycle
    model = make_model()
    opt = torch.optim.AdamW([{"params": [model.layers[0].weight]}, {"params": [model.layers[1].weight]}],
                            lr=0.1, betas=(0.9, 0.95))
    s = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                 cycle_min_mom=0.8, cycle_max_mom=0.9)
    for _ in range(2):
        s.step()
    mom = s.get_mom()
    assert isinstance(mom, list) and len(mom) == 2 and all(isinstance(m, tuple) and len(m) == 2 for m in mom)
    # two steps: last_batch_iteration 1, k = 2 of a 4-step rise: 0.9 - (0.9 - 0.8) * 2/4
    assert s.last_batch_iteration == 1
    assert mom[0][0] == pytest.approx(0.85) and mom[0][1] == 0.95
    assert [g["betas"] for g in opt.param_groups] == mom
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    s2 = OneCycle(sgd, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)
    assert all(isinstance(m, float) for m in s2.get_mom())   # SGD-style momentum: floats


def test_cpu_adagrad_sparse_gradients_match_torch_adagrad():
    """DeepSpeed source (ops/adagrad/cpu_adagrad.py, step: a sparse gradient updates the rows
    it holds); reference: torch.optim.Adagrad on the same sparse gradients."""
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    torch.manual_seed(0)
    ours = torch.nn.Embedding(12, 4, sparse=True)
    ref = copy.deepcopy(ours)
    untouched = ours.weight.detach()[[0, 2, 11]].clone()
    o1 = DeepSpeedCPUAdagrad(ours.parameters(), lr=0.1, eps=1e-10)
    o2 = torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=1e-10)
    for idx in ([1, 3, 3, 7], [3, 5, 9], [1, 9, 10]):
        for emb, opt in ((ours, o1), (ref, o2)):
            opt.zero_grad()
            emb(torch.tensor(idx)).pow(2).sum().backward()
            assert emb.weight.grad.is_sparse
            opt.step()
    torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.weight.detach()[[0, 2, 11]], untouched)   # rows never touched
    assert o1.state[ours.weight]["step"].item() == 3


# ------------------------------------------------------------------ zero.Init
def test_zero_init_on_meta_device_modules():
    """Ours, better: DeepSpeed's zero.Init on meta-device parameters fails ("Cannot copy out of
    meta tensor; no data!", its users' reports). Here modules whose tensors are all on meta are
    initialised by their reset_parameters() and partitioned, so the model trains."""
    deepspeed.init_distributed(verbose=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = make_model()
    assert model.layers[0].weight.is_meta
    deepspeed.zero.Init(module=model)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        w = model.layers[0].weight.detach().clone()
        b = model.layers[1].bias.detach().clone()
    assert w.shape == (16, 8) and not w.is_meta and w.abs().sum() > 0
    bound = 1 / 8 ** 0.5   # nn.Linear.reset_parameters: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert w.abs().max() <= bound and b.abs().max() <= 1 / 16 ** 0.5
    # The same inside the context manager, and the result trains at stage 3.
    with deepspeed.zero.Init():
        with torch.device("meta"):
            model2 = make_model()
    engine, *_ = deepspeed.initialize(model=model2, config=_cfg(
        zero_optimization={"stage": 3}, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    losses = []
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    for _ in range(3):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[2] < losses[0]


def test_zero_init_meta_without_reset_parameters_starts_at_zero(caplog_ds):
    class Raw(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(6, 3))

    deepspeed.init_distributed(verbose=False)
    with torch.device("meta"):
        m = Raw()
    deepspeed.zero.Init(module=m)
    with deepspeed.zero.GatheredParameters([m.w]):
        assert torch.equal(m.w.detach(), torch.zeros(6, 3))
    assert "start at zero" in caplog_ds.text


# ------------------------------------------------------------------ init_distributed
def test_dist_init_required_false_without_a_group_is_an_assertion():
    """DeepSpeed source (comm/comm.py init_distributed: ``assert cdb is not None and
    cdb.is_initialized()`` when dist_init_required is False). A fresh interpreter, since this
    test process may already hold a group."""
    code = textwrap.dedent("""
        import deepspeed, torch
        try:
            deepspeed.init_distributed(dist_init_required=False)
        except AssertionError as e:
            assert "dist_init_required" in str(e) and isinstance(e, RuntimeError)
            assert not torch.distributed.is_initialized()
            print("RESULT ASSERTION")
        try:
            deepspeed.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1},
                                 dist_init_required=False)
        except AssertionError:
            print("RESULT ASSERTION")
        deepspeed.init_distributed()  # and with a group, False is accepted
        deepspeed.init_distributed(dist_init_required=False)
        print("RESULT OK", torch.distributed.get_world_size())
    """)
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    results = [line.split(None, 1)[1] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert results == ["ASSERTION", "ASSERTION", "OK 1"]


def test_clean_exit_hook_notes_failing_sys_exit():
    """A rank calling sys.exit(<failure>) must not wait in the exit barrier (its peers may be
    blocked waiting for it); sys.exit(0) still waits."""
    import pytest
    from deepspeed.comm import shutdown
    deepspeed.init_distributed(verbose=False)   # installs the hook
    assert shutdown._installed
    saved = shutdown._exception_seen
    try:
        shutdown._exception_seen = False
        with pytest.raises(SystemExit):
            sys.exit(0)
        assert shutdown._exception_seen is False
        with pytest.raises(SystemExit) as info:
            sys.exit(3)
        assert info.value.code == 3 and shutdown._exception_seen is True
    finally:
        shutdown._exception_seen = saved
