"""Checkpoints load at any world size and ZeRO stage, and consolidate to fp32.

Every run uses the same global batches (8 samples per step) and AdamW, so whatever
world size or stage trains steps 1-2, saves, and whichever loads and trains steps 3-4,
the parameters must equal plain PyTorch after 4 steps. Covered: 4->2 (stage 1->2),
1->2 (stage 1->2), 2->1 (stage 2->1), stage 2->stage 0, and zero_to_fp32 (functions and
the script written into the checkpoint) against the live model's fp32 masters.
"""
import os
import subprocess
import sys

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import global_batches
from tests.runtime.zero._common import build_engine, ds_config, full_fp32, full_state, reference, run_steps

GLOBAL = 8
BATCHES = global_batches(4, GLOBAL)
KEYS = ("exp_avg", "exp_avg_sq")


def _cfg(stage, world_size):
    mb = 2
    return ds_config(stage, GLOBAL // (mb * world_size), mb)


def _snapshot(engine):
    return {"fp32": full_fp32(engine), **{k: full_state(engine, k) for k in KEYS},
            "step": [float(s["step"]) for s in engine.optimizer.state.values()] if hasattr(engine.optimizer, "inner")
            else None}


def _train_and_save(rank, world_size, stage, save_dir):
    engine = build_engine(_cfg(stage, world_size), opt_name="adamw")
    run_steps(engine, rank, world_size, BATCHES[:2])
    engine.save_checkpoint(save_dir)
    return _snapshot(engine)


def _resume(rank, world_size, stage, load_dir):
    engine = build_engine(_cfg(stage, world_size), opt_name="adamw")
    engine.load_checkpoint(load_dir)
    loaded = _snapshot(engine) if stage > 0 else None
    assert engine.global_steps == 2
    run_steps(engine, rank, world_size, BATCHES[2:])
    final = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    engine.destroy()
    return loaded, final


def _g4(rank, world_size, dir_a):
    return _train_and_save(rank, world_size, 1, dir_a)


def _g2(rank, world_size, dir_a, dir_b, dir_c):
    out = {"from_4": _resume(rank, world_size, 2, dir_a), "from_1": _resume(rank, world_size, 2, dir_c)}
    engine = build_engine(_cfg(2, world_size), opt_name="adamw")
    run_steps(engine, rank, world_size, BATCHES[:2])
    engine.save_checkpoint(dir_b)
    live = full_fp32(engine)
    if rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        out["consolidated"] = get_fp32_state_dict_from_zero_checkpoint(dir_b)
        out["live"] = live
    engine.destroy()
    out["stage0"] = _resume(rank, world_size, 0, dir_b)
    return out


def _assert_state(snap, ref_params, ref_opt, ref_model, tol=dict(rtol=1e-5, atol=1e-6)):
    by_param = {id(p): n for n, p in ref_model.named_parameters()}
    for n, want in ref_params.items():
        torch.testing.assert_close(snap["fp32"][n], want, **tol, msg=n)
    for p, st in ref_opt.state.items():
        for k in KEYS:
            torch.testing.assert_close(snap[k][by_param[id(p)]], st[k], **tol, msg=f"{by_param[id(p)]} {k}")


def _assert_same(a, b):
    for k in ("fp32",) + KEYS:
        for n in a[k]:
            assert torch.equal(a[k][n], b[k][n]), (k, n)


def test_resume_across_world_sizes_and_stages(tmp_path):
    dir_a, dir_b, dir_c = (str(tmp_path / d) for d in "abc")
    ref2, ref2_opt, ref2_model = reference(2, GLOBAL, "adamw")
    ref4, _, _ = reference(4, GLOBAL, "adamw")

    saved_a = run_distributed(_g4, 4, args=(dir_a,), timeout=240)[0]        # stage 1, 4 ranks
    _assert_state(saved_a, ref2, ref2_opt, ref2_model)
    saved_c = _train_and_save(0, 1, 1, dir_c)                               # stage 1, 1 rank (this process)
    _assert_state(saved_c, ref2, ref2_opt, ref2_model)

    res = run_distributed(_g2, 2, args=(dir_a, dir_b, dir_c), timeout=240)
    r = res[0]
    loaded_4, final_4 = r["from_4"]
    _assert_same(loaded_4, saved_a)                     # 4 -> 2 restores exactly the saved state
    assert loaded_4["step"] and all(s == 2.0 for s in loaded_4["step"])
    loaded_1, final_1 = r["from_1"]
    _assert_same(loaded_1, saved_c)                     # 1 -> 2
    _, final_0 = r["stage0"]                            # stage 2 -> stage 0
    loaded_21, final_21 = _resume(0, 1, 1, dir_b)        # 2 -> 1 (this process)
    for final in (final_4, final_1, final_0, final_21):
        for n, want in ref4.items():
            torch.testing.assert_close(final[n], want, rtol=1e-5, atol=1e-6, msg=n)

    # consolidation equals the live model's fp32 masters, exactly
    live, cons = r["live"], r["consolidated"]
    for n, t in live.items():
        assert torch.equal(cons[n], t), n
    assert "layers.0.bias" in cons and cons["layers.0.bias"].dtype == torch.float32   # frozen: from the module file
    tag_dir = os.path.join(dir_b, "global_step2")
    script = os.path.join(tag_dir, "zero_to_fp32.py")
    assert os.access(script, os.X_OK) and os.access(os.path.join(dir_b, "zero_to_fp32.py"), os.X_OK)   # as DeepSpeed
    out_file = str(tmp_path / "consolidated.bin")
    proc = subprocess.run([sys.executable, script, tag_dir, out_file], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from_script = torch.load(out_file, weights_only=True)
    assert list(from_script) == list(cons)
    for n, t in cons.items():
        assert torch.equal(from_script[n], t), n


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) * 1024
    return 0


def test_consolidation_streams_tensor_by_tensor(tmp_path):
    """A 2-rank checkpoint of 40 MB of fp32 masters converts with far less anonymous memory
    than the model (parameters are assembled into a file-backed buffer one at a time)."""
    import threading
    import time
    from deepspeed.runtime.checkpoint.universal import make_rank_state, optim_file_name
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    shapes = {f"w{i}": (1000, 1000) for i in range(10)}
    full = {n: torch.randn(s) for n, s in shapes.items()}
    for r in range(2):
        params = {n: {"shape": list(t.shape), "fragments": [
            {"offset": r * 500_000, "numel": 500_000, "fp32": t.reshape(-1)[r * 500_000:(r + 1) * 500_000]}]}
            for n, t in full.items()}
        torch.save(make_rank_state(zero_stage=2, dp_world_size=2, dp_rank=r, mp_rank=0, dtype="bf16", params=params,
                                   param_groups=[{"params": list(shapes), "lr": 0.1}], group_state=[{}],
                                   optimizer_class=None, loss_scaler=None), tmp_path / optim_file_name(r, 0))
    model_bytes = 10 * 1_000_000 * 4
    base, peak, stop = _rss_anon(), [0], []

    def sample():
        while not stop:
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.001)
    t = threading.Thread(target=sample)
    t.start()
    try:
        out = convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path), str(tmp_path / "out.bin"))
    finally:
        stop.append(True)
        t.join()
    assert peak[0] - base < 0.25 * model_bytes, (peak[0] - base, model_bytes)
    sd = torch.load(out, weights_only=True)
    assert list(sd) == list(shapes)
    for n, t in full.items():
        assert torch.equal(sd[n], t), n
