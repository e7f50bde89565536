"""fp16 overflow on one rank skips the step on every rank, at stages 0, 1 and 2 (2 ranks);
then a checkpoint taken after the overflows resumes bit-identically (scaler included).
Run with torch's AdamW (the whole-buffer step) and with DeepSpeed's FusedAdam (the
streamed step, see ``flat_master.py``)."""
import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import global_batches, make_model, micro_slice

MB = 2


def _engine(stage, seed=0, opt="torch"):
    import deepspeed
    from deepspeed.ops.adam import FusedAdam
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": 2, "steps_per_print": 0,
           "gradient_clipping": 1.0,
           "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 2, "loss_scale_window": 1000},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 40}}
    engine, *_ = deepspeed.initialize(
        model=make_model(seed=seed), config=cfg,
        optimizer=((lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if opt == "torch"
                   else (lambda ps: FusedAdam(ps, lr=1e-2))),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    return engine


def _inf_hook(g):
    return g.index_fill(0, torch.tensor([0]), float("inf"))


def _step(engine, rank, world_size, batch, inject):
    for m in range(engine.gradient_accumulation_steps()):
        h = engine.module.layers[1].weight.register_hook(_inf_hook) if inject and m == 1 else None
        x, y = micro_slice(batch, rank, world_size, m, MB)
        engine.backward(engine(x.half(), y.half()))
        if h is not None:
            h.remove()
        engine.step()
    return {"params": [p.detach().clone() for p in engine.module.parameters()],
            "masters": [m.clone() for m in engine.optimizer.masters], "lr": engine.get_lr()[0],
            "scale": engine.loss_scale, "skipped": engine.skipped_steps, "applied": engine.was_step_applied,
            "epoch": engine.lr_scheduler.last_epoch}


def _body(rank, world_size, ckpt_root, opt):
    out = {}
    batches = global_batches(8, MB * 2 * world_size)
    for stage in (0, 1, 2):
        engine = _engine(stage, opt=opt)
        assert engine.optimizer._use_streamed_step() == (opt == "fused")
        inject_on = [(i, rank == 0 and i in (1, 2)) for i in range(6)]   # rank 0 only, steps 2 and 3
        trace = [_step(engine, rank, world_size, batches[i], inj) for i, inj in inject_on[:4]]
        d = f"{ckpt_root}/stage{stage}"
        engine.save_checkpoint(d)
        trace += [_step(engine, rank, world_size, batches[i], False) for i in range(4, 8)]
        resumed = _engine(stage, seed=5, opt=opt)
        resumed.load_checkpoint(d)
        again = [_step(resumed, rank, world_size, batches[i], False) for i in range(4, 8)]
        out[stage] = {"trace": trace, "again": again,
                      "scaler": (engine.optimizer.scaler.state_dict(), resumed.optimizer.scaler.state_dict())}
    return out


@pytest.mark.parametrize("opt", ["torch", "fused"])
def test_overflow_on_one_rank_skips_everywhere_and_resume_is_exact(tmp_path, opt):
    res = run_distributed(_body, 2, args=(str(tmp_path), opt), timeout=240)
    for stage in (0, 1, 2):
        for r in res:
            t = r[stage]["trace"]
            s1, s2, s3, s4 = t[:4]
            assert (s1["scale"], s1["skipped"], s1["applied"]) == (256.0, 0, True), stage
            if stage == 0:   # DeepSpeed's stage-0 fp16 optimizers ignore hysteresis: each overflow halves
                assert (s2["scale"], s2["skipped"], s2["applied"]) == (128.0, 1, False), stage
                assert (s3["scale"], s3["skipped"], s3["applied"]) == (64.0, 2, False), stage
            else:
                # overflow 1: skipped, hysteresis (2) absorbs it: scale kept; nothing moved
                assert (s2["scale"], s2["skipped"], s2["applied"]) == (256.0, 1, False), stage
                # overflow 2: hysteresis used up -> the scale halves
                assert (s3["scale"], s3["skipped"], s3["applied"]) == (128.0, 2, False), stage
            for s in (s2, s3):
                assert all(torch.equal(a, b) for a, b in zip(s["params"], s1["params"])), stage
                assert all(torch.equal(a, b) for a, b in zip(s["masters"], s1["masters"])), stage
                assert (s["lr"], s["epoch"]) == (s1["lr"], s1["epoch"]), stage   # schedule not advanced
            # a clean step moves again, the schedule advances once
            assert s4["applied"] and s4["scale"] == s3["scale"] and s4["epoch"] == s1["epoch"] + 1
            assert s4["lr"] == s1["lr"] * 0.5
            assert not all(torch.equal(a, b) for a, b in zip(s4["params"], s1["params"]))
            # resume from the checkpoint taken after the overflows: bit-identical
            for a, b in zip(t[4:], r[stage]["again"]):
                assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), stage
                assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"])), stage
                assert (a["lr"], a["scale"], a["skipped"]) == (b["lr"], b["scale"], b["skipped"]), stage
            assert r[stage]["scaler"][0] == r[stage]["scaler"][1]
        for a, b in zip(res[0][stage]["trace"], res[1][stage]["trace"]):   # ranks agree
            assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
