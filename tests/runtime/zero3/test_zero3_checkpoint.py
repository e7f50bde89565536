"""Stage-3 saving: save_16bit_model output loads into a plain module; checkpoints saved at
one world size and stage resume at other world sizes and stages exactly like uninterrupted
plain PyTorch; zero_to_fp32 consolidates a stage-3 checkpoint."""
from __future__ import annotations

import os

import torch

from tests.helpers.dist import run_distributed
from tests.runtime.zero3._models import TinyLM, lm_batches, make_lm, shard, stage3_config, train_engine

LR = 0.02


def _save_body(rank, ws, out_dir):
    import deepspeed  # noqa: F401
    cfg = stage3_config(gas=1, mb=2, stage3_gather_16bit_weights_on_model_save=True)
    cfg["bf16"] = {"enabled": True}
    eng = train_engine(make_lm(seed=0), cfg, lm_batches(2, 2 * ws), rank, ws, lr=LR)
    ok = eng.save_16bit_model(os.path.join(out_dir, "hf"), "model.bin")
    gathered = eng.module_state_dict()
    eng.destroy()

    cfg = stage3_config(gas=1, mb=2)   # stage3_gather_16bit_weights_on_model_save defaults to false
    eng = train_engine(make_lm(seed=0), cfg, lm_batches(1, 2 * ws), rank, ws, lr=LR)
    refused = eng.save_16bit_model(os.path.join(out_dir, "refused"))
    eng.destroy()

    for stage in (3, 2):   # a stage-3 and a stage-2 checkpoint of the same training
        cfg = stage3_config(gas=1, mb=2)
        cfg["zero_optimization"]["stage"] = stage
        eng = train_engine(make_lm(seed=0), cfg, lm_batches(2, 4), rank, ws, lr=LR)
        eng.save_checkpoint(os.path.join(out_dir, f"ckpt{stage}"), tag="step2")
        eng.destroy()
    return {"ok": ok, "gathered": gathered, "refused": refused}


def _resume_body(rank, ws, out_dir, cases):
    import deepspeed
    out = {}
    for src, stage in cases:
        model = make_lm(seed=123)        # different initial weights: everything must come from the checkpoint
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        cfg = stage3_config(gas=1, mb=4 // ws)
        cfg["zero_optimization"]["stage"] = stage
        eng = deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]
        eng.load_checkpoint(os.path.join(out_dir, f"ckpt{src}"))
        for b in lm_batches(4, 4)[2:]:
            x, y = shard(b, rank, ws, 0, 4 // ws)
            eng.backward(eng(x, y))
            eng.step()
        sd = eng.module_state_dict() if stage == 3 else {k: v.detach().clone() for k, v in
                                                         eng.module.state_dict().items()}
        out[(src, stage)] = {"sd": sd, "steps": eng.global_steps}
        eng.destroy()
    return out


def test_save_16bit_model_and_resume_at_other_world_sizes(tmp_path):
    out = str(tmp_path)
    saved = run_distributed(_save_body, 2, args=(out,), timeout=120)
    assert saved[0]["ok"] is True and saved[1]["ok"] is True
    assert saved[0]["refused"] is False and not os.path.exists(os.path.join(out, "refused"))

    sd = torch.load(os.path.join(out, "hf", "model.bin"), weights_only=True)
    plain = TinyLM()
    plain.load_state_dict(sd, strict=True)           # a plain nn.Module takes it as is
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    for k, v in saved[0]["gathered"].items():
        assert torch.equal(plain.state_dict()[k].to(v.dtype), v), k

    # plain PyTorch reference: 2 steps, then 2 more, on the same global batches
    ref = make_lm(seed=0)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    for i, (x, y) in enumerate(lm_batches(4, 4)):
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
        if i == 1:
            after2 = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    fp32 = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, "ckpt3"))
    for k, v in after2.items():
        torch.testing.assert_close(fp32[k], v, rtol=1e-5, atol=2e-6, msg=f"zero_to_fp32: {k}")

    # (saved stage, loading stage) at world sizes 1 and 4 - the checkpoints were saved at 2
    for ws, cases in ((1, [(3, 3), (2, 3), (3, 0)]), (4, [(3, 3), (3, 2)])):
        res = run_distributed(_resume_body, ws, args=(out, cases), timeout=120)
        for case in cases:
            assert res[0][case]["steps"] == 4
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(res[0][case]["sd"][k], v, rtol=1e-5, atol=2e-6,
                                           msg=f"world size {ws}, (saved stage, loading stage) {case}: {k}")
