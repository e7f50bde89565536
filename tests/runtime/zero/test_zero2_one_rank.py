"""ZeRO-2 on one rank: nothing to reduce, so a gradient is added straight into the rank's
gradient partition (no staging bucket), with the same result as plain PyTorch. (A gradient on
another device than its partition - offload on a GPU machine - still goes through the staging
bucket; that branch needs a GPU: tests/gpu's ZeRO-2 offload case.)"""
from __future__ import annotations

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import global_batches
from tests.runtime.zero._common import build_engine, ds_config, full_fp32, reference, run_steps

N_STEPS, MB = 3, 2
TOL = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=0, atol=5e-4)}
CASES = {"fp32_gas4": (ds_config(2, 4, MB), "fp32", 4), "bf16_gas1": (ds_config(2, 1, MB, "bf16"), "bf16", 1)}


def _body(rank, ws):
    out = {}
    for name, (cfg, dtype, gas) in CASES.items():
        engine = build_engine(cfg)
        red = engine.optimizer.reducer
        staged = []
        orig = red._staging

        def spy(b, _orig=orig, _staged=staged):
            _staged.append(b.order)
            return _orig(b)
        red._staging = spy
        run_steps(engine, rank, ws, global_batches(N_STEPS, MB * gas * ws), dtype)
        out[name] = {"fp32": full_fp32(engine), "direct": red.direct, "staged": len(staged),
                     "n_buckets": len(engine.optimizer.buckets), "gas": gas, "dtype": dtype}
        engine.destroy()
    return out


def test_one_rank_stage2_adds_gradients_into_the_partition_and_matches_plain_pytorch():
    res = run_distributed(_body, 1, timeout=180)[0]
    for name, r in res.items():
        ref, _, _ = reference(N_STEPS, MB * r["gas"])
        for pname, want in ref.items():
            torch.testing.assert_close(r["fp32"][pname], want, **TOL[r["dtype"]], msg=f"{name} {pname}")
    assert res["fp32_gas4"]["direct"] and res["fp32_gas4"]["staged"] == 0
    assert res["bf16_gas1"]["direct"] and res["bf16_gas1"]["staged"] == 0
    assert res["fp32_gas4"]["n_buckets"] > 1   # several buckets, each skipped
