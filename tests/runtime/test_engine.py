"""The engine on one process against a plain PyTorch loop on the same batches."""
import os

import pytest
import torch

import deepspeed
from deepspeed.config.errors import DeepSpeedConfigError
from tests.helpers.models import global_batches, make_model, micro_slice, reference_train


def _train_engine(config, batches, optimizer=None, steps_check=None, **init_kw):
    model = make_model()
    engine, opt, _, sched = deepspeed.initialize(model=model, optimizer=optimizer, config=config, **init_kw)
    gas = engine.gradient_accumulation_steps()
    mb = engine.train_micro_batch_size_per_gpu()
    for batch in batches:
        for m in range(gas):
            x, y = micro_slice(batch, 0, 1, m, mb)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    return engine


@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_matches_plain_pytorch_sgd(gas, clip):
    batches = global_batches(5, 8)
    cfg = {"train_batch_size": 8, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "steps_per_print": 0}
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = _train_engine(cfg, batches, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    ref = reference_train(model, opt, batches, clip=clip)
    for (n, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=n)
    assert engine.global_steps == 5 and engine.micro_steps == 5 * gas
    assert engine.global_samples == 40
    if clip:
        assert engine.get_global_grad_norm() > 0


_TORCH_REFS = {
    "Adam": lambda ps, p: torch.optim.AdamW(ps, lr=p["lr"], weight_decay=p.get("weight_decay", 0.0)),
    "AdamW": lambda ps, p: torch.optim.AdamW(ps, lr=p["lr"], weight_decay=p.get("weight_decay", 0.0)),
    "SGD": lambda ps, p: torch.optim.SGD(ps, lr=p["lr"], momentum=p.get("momentum", 0.0)),
    "Adagrad": lambda ps, p: torch.optim.Adagrad(ps, lr=p["lr"]),
    "RMSprop": lambda ps, p: torch.optim.RMSprop(ps, lr=p["lr"]),
}


@pytest.mark.parametrize("opt_type,params", [
    ("Adam", {"lr": 0.01, "weight_decay": 0.01}),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
    ("SGD", {"lr": 0.05, "momentum": 0.9}),
    ("Adagrad", {"lr": 0.05}),
    ("RMSprop", {"lr": 0.01}),
    ("Lamb", {"lr": 0.01}),
    ("Lion", {"lr": 0.001}),
])
def test_every_optimizer_type_matches_reference(opt_type, params):
    from deepspeed.runtime.optimizers import build_optimizer
    batches = global_batches(4, 8)
    cfg = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "steps_per_print": 0, "optimizer": {"type": opt_type, "params": params}}
    engine = _train_engine(cfg, batches)
    model = make_model()
    if opt_type in _TORCH_REFS:
        ref_opt = _TORCH_REFS[opt_type](model.parameters(), params)
    else:  # our own optimizers: their math is tested against the papers' formulas in tests/ops
        ref_opt = build_optimizer(opt_type, params, [{"params": list(model.parameters())}])
    ref = reference_train(model, ref_opt, batches, clip=1.0)
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sched", [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 3}},
    {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.05, "warmup_num_steps": 2, "total_num_steps": 6}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2}},
    {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.05, "cycle_first_step_size": 2}},
    {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2}},
])
def test_every_scheduler_drives_the_optimizer(sched):
    """The engine steps the schedule once per optimizer step: the LRs it applies equal the
    scheduler's own sequence replayed on a plain optimizer."""
    from deepspeed.runtime.lr_schedules import build_lr_scheduler
    batches = global_batches(6, 4)
    cfg = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, "scheduler": sched}
    model = make_model()
    engine, opt, _, lr_sched = deepspeed.initialize(model=model, config=cfg)
    ref_model = make_model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    ref_sched = build_lr_scheduler(sched["type"], sched["params"], ref_opt)
    seen = []
    for batch in batches:
        seen.append(engine.get_lr()[0])
        for m in range(2):
            x, y = micro_slice(batch, 0, 1, m, 2)
            engine.backward(engine(x, y))
            engine.step()
    reference_train(ref_model, ref_opt, batches, scheduler=ref_sched)
    for p, q in zip(engine.module.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert len(set(round(v, 9) for v in seen)) > 1, f"LR never changed: {seen}"
    assert lr_sched.state_dict() == ref_sched.state_dict()


def _run(engine, batches, start, end):
    losses = []
    for batch in batches[start:end]:
        for m in range(engine.gradient_accumulation_steps()):
            x, y = micro_slice(batch, 0, 1, m, engine.train_micro_batch_size_per_gpu())
            x = x + 0.01 * torch.randn_like(x)  # consumes RNG: resume must restore it
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


CKPT_CFG = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 0,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 5}}}


def test_resume_is_bit_identical(tmp_path):
    batches = global_batches(8, 8)
    torch.manual_seed(123)
    full, *_ = deepspeed.initialize(model=make_model(), config=CKPT_CFG)
    losses_full = _run(full, batches, 0, 8)

    torch.manual_seed(123)
    first, *_ = deepspeed.initialize(model=make_model(), config=CKPT_CFG)
    _run(first, batches, 0, 4)
    first.save_checkpoint(str(tmp_path), client_state={"epoch": 3, "note": "x"})
    assert (tmp_path / "latest").read_text() == "global_step4"

    torch.manual_seed(999)  # different RNG: the checkpoint must restore it
    second, *_ = deepspeed.initialize(model=make_model(seed=7), config=CKPT_CFG)
    path, client = second.load_checkpoint(str(tmp_path))
    assert path.endswith("global_step4") and client == {"epoch": 3, "note": "x"}
    assert second.global_steps == 4 and second.micro_steps == 8 and second.global_samples == 32
    losses_resumed = _run(second, batches, 4, 8)
    assert losses_resumed == losses_full[8:]
    for p, q in zip(full.module.parameters(), second.module.parameters()):
        assert torch.equal(p, q)
    assert second.get_lr() == full.get_lr()


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    batches = global_batches(4, 8)
    eng, *_ = deepspeed.initialize(model=make_model(), config=CKPT_CFG)
    _run(eng, batches, 0, 2)
    eng.save_checkpoint(str(tmp_path))
    saved = {k: v.clone() for k, v in eng.module.state_dict().items()}
    _run(eng, batches, 2, 4)

    import deepspeed.runtime.checkpoint.io as ckio
    real_save = torch.save
    calls = {"n": 0}

    def failing_save(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # fail in the middle of the checkpoint's files
            f.write(b"partial")
            raise OSError("disk full (injected)")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckio.torch, "save", failing_save)
    with pytest.raises(OSError, match="injected"):
        eng.save_checkpoint(str(tmp_path))
    monkeypatch.setattr(ckio.torch, "save", real_save)
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert not (tmp_path / "global_step4").exists()
    fresh, *_ = deepspeed.initialize(model=make_model(seed=5), config=CKPT_CFG)
    path, _ = fresh.load_checkpoint(str(tmp_path))
    assert path.endswith("global_step2")
    for k, v in fresh.module.state_dict().items():
        assert torch.equal(v, saved[k])
    # a later save succeeds and cleans the temporary directory
    eng.save_checkpoint(str(tmp_path))
    assert (tmp_path / "latest").read_text() == "global_step4"
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_load_without_latest_returns_none(tmp_path, caplog):
    eng, *_ = deepspeed.initialize(model=make_model(), config=CKPT_CFG)
    assert eng.load_checkpoint(str(tmp_path)) == (None, None)


def test_mismatched_checkpoint_names_keys(tmp_path):
    eng, *_ = deepspeed.initialize(model=make_model(), config=CKPT_CFG)
    eng.save_checkpoint(str(tmp_path))
    other, *_ = deepspeed.initialize(model=make_model(layers=3), config=CKPT_CFG)
    with pytest.raises(Exception, match=r"layers\.2\.weight"):
        other.load_checkpoint(str(tmp_path))


def test_checkpoint_files_are_weights_only(tmp_path):
    eng, *_ = deepspeed.initialize(model=make_model(), config=CKPT_CFG)
    eng.save_checkpoint(str(tmp_path), tag="t1")
    for f in (tmp_path / "t1").iterdir():
        if f.suffix == ".pt":
            torch.load(f, weights_only=True)  # raises if anything but data was pickled


def test_config_sources(tmp_path):
    import argparse
    cfg_path = tmp_path / "ds.json"
    cfg_path.write_text('{"train_batch_size": 4}')
    with pytest.raises(DeepSpeedConfigError, match="more than one config source"):
        deepspeed.initialize(model=make_model(), config={"train_batch_size": 4},
                             config_params={"train_batch_size": 4})
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(cfg_path)])
    with pytest.raises(DeepSpeedConfigError, match=r"args.deepspeed_config, config"):
        deepspeed.initialize(args=args, model=make_model(), config={"train_batch_size": 4})
    eng, *_ = deepspeed.initialize(args=args, model=make_model())
    assert eng.train_batch_size() == 4
    eng, *_ = deepspeed.initialize(model=make_model(), config_params={"train_micro_batch_size_per_gpu": 3})
    assert eng.train_batch_size() == 3
    with pytest.raises(DeepSpeedConfigError, match="needs a config"):
        deepspeed.initialize(model=make_model())
    old = parser.parse_args(["--deepscale", "--deepscale_config", str(cfg_path)])
    assert old.deepscale and old.deepscale_config == str(cfg_path)


def test_engine_surface_and_fallthrough():
    m = make_model()
    m.custom_attr = 42
    eng, opt, loader, sched = deepspeed.initialize(
        model=m, config={"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        training_data=torch.utils.data.TensorDataset(torch.randn(10, 8), torch.randn(10, 4)))
    assert isinstance(eng, deepspeed.DeepSpeedEngine)
    assert eng.custom_attr == 42 and eng.layers is m.layers
    assert opt is eng.optimizer and opt.overflow is False
    assert sched is None
    assert len(loader) == 3 and next(iter(loader))[0].shape == (4, 8)
    assert eng.config["train_batch_size"] == 4 and eng.config["gradient_accumulation_steps"] == 1
    eng.set_gradient_accumulation_boundary(False)
    assert not eng.is_gradient_accumulation_boundary()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    before = [p.clone() for p in eng.parameters()]
    eng.backward(eng(x, y))
    eng.step()  # not a boundary: no update
    assert all(torch.equal(a, b) for a, b in zip(before, eng.parameters()))
    eng.set_gradient_accumulation_boundary(True)
    eng.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, eng.parameters()))
    eng.eval()
    assert not eng.module.training
    eng.train()
    assert eng.module.training
    eng.destroy()


def test_repeating_loader():
    from deepspeed.utils import RepeatingLoader
    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


def test_wall_clock_breakdown_logs(caplog):
    eng, *_ = deepspeed.initialize(model=make_model(), config={
        "train_batch_size": 2, "steps_per_print": 1, "wall_clock_breakdown": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    eng.backward(eng(x, y))
    eng.step()
    out = caplog.text
    assert "step=1" in out and "loss=" in out and "samples/s=" in out
    assert "forward" in out and "backward" in out
