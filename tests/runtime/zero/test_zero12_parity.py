"""ZeRO stages 1 and 2 at world sizes 2 and 4 against single-process plain PyTorch.

One spawned group per world size runs every configuration in turn (stage 1/2 x
accumulation 1/4 x fp32/bf16, clipping on, two parameter groups, a frozen parameter,
several buckets), so the processes start once. The reference is torch.optim.SGD with
momentum on an fp32 model over the same global batches: SGD (unlike Adam) is
sensitive to the gradient's scale, so a wrong average or clip would show.
"""
import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.models import global_batches
from tests.runtime.zero._common import build_engine, ds_config, full_fp32, make_net, reference, run_steps

N_STEPS, MB = 3, 2
CONFIGS = [(stage, gas, dtype) for stage in (1, 2) for gas in (1, 4) for dtype in ("fp32", "bf16")]
# world size 4: a covering subset (every stage x gas, stage x dtype and gas x dtype pair once)
CONFIGS_4 = [(1, 1, "fp32"), (1, 4, "bf16"), (2, 1, "bf16"), (2, 4, "fp32")]
# bf16: forward/backward in bf16 (8 mantissa bits); the fp32 masters follow the fp32
# reference within 5e-4 absolute after 3 steps (parameters are O(0.3); ~1e-4 observed).
TOL = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=0, atol=5e-4)}

VARIANTS = {  # ws=2 only: each must still equal the reference exactly like its base config
    "offload_s1": (ds_config(1, 2, MB, offload_optimizer={"device": "cpu", "pin_memory": True}), "sgd"),
    "offload_s2": (ds_config(2, 2, MB, offload_optimizer={"device": "cpu"}), "sgd"),
    "s2_sync_reduce_noncontig": (ds_config(2, 2, MB, overlap_comm=False, contiguous_gradients=False,
                                           reduce_scatter=False), "sgd"),
    "s1_reduce": (ds_config(1, 2, MB, reduce_scatter=False), "sgd"),
    "s2_config_adamw_offload": (dict(ds_config(2, 2, MB, offload_optimizer={"device": "cpu"}),
                                     optimizer={"type": "AdamW", "params": {"lr": 0.01}}), "adamw"),
    "s0_bf16": (ds_config(0, 2, MB, "bf16"), "sgd"),      # stage 0 in 16 bits: flat masters, all-reduce
    "s2_bf16_accum_fp32": (dict(ds_config(2, 2, MB, "bf16"), data_types={"grad_accum_dtype": "fp32"}), "sgd"),
    "s1_fp16": (ds_config(1, 2, MB, "fp16"), "sgd"),
    "s2_predivide": (dict(ds_config(2, 2, MB), prescale_gradients=True, gradient_predivide_factor=2.0), "sgd"),
    "s1_bf16_comm_fp32": (dict(ds_config(1, 2, MB, "bf16"), communication_data_type="fp32"), "sgd"),
    # gloo's reduce-scatter/all-gather (what NCCL runs) instead of carrying them by all-reduce
    "s1_native_collectives": (ds_config(1, 2, MB), "sgd"),
    "s2_native_collectives": (ds_config(2, 2, MB), "sgd"),
}


def _result(engine):
    return {"fp32": full_fp32(engine),
            "module": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "counts": engine.optimizer.launch_counts, "n_buckets": len(engine.optimizer.buckets),
            "inner": type(engine.optimizer.inner).__name__}


def _body(rank, world_size, with_variants):
    torch.manual_seed(1234 + rank)  # different RNG per rank: nothing may depend on it
    out = {}
    for stage, gas, dtype in (CONFIGS if world_size == 2 else CONFIGS_4):
        engine = build_engine(ds_config(stage, gas, MB, dtype))
        run_steps(engine, rank, world_size, global_batches(N_STEPS, MB * gas * world_size), dtype)
        out[(stage, gas, dtype)] = _result(engine)
        engine.destroy()
    if with_variants:
        for name, (cfg, opt) in VARIANTS.items():
            engine = build_engine(cfg, opt_name=opt)
            if "native" in name:
                assert engine.optimizer.comm.via_all_reduce     # the gloo default
                engine.optimizer.comm.via_all_reduce = False
            run_steps(engine, rank, world_size, global_batches(N_STEPS, MB * 2 * world_size),
                      "bf16" if "bf16" in cfg else "fp16" if "fp16" in cfg else "fp32")
            out[name] = _result(engine)
            engine.destroy()
    return out


def _check_config(res, key, world_size, ref, tol):
    stage, gas, dtype = key
    r0 = res[0][key]
    for name, want in ref.items():
        torch.testing.assert_close(r0["fp32"][name], want, **tol, msg=f"{key} {name}")
    for r in res:  # every rank holds the same module; 16-bit params are the masters rounded
        for name, p in r[key]["module"].items():
            assert torch.equal(p, r0["module"][name]), (key, name)
            if name in r0["fp32"]:
                assert torch.equal(p, r0["fp32"][name].to(p.dtype)), (key, name)
    frozen = make_net(0).layers[0].bias.detach()
    assert torch.equal(r0["module"]["layers.0.bias"].float(), frozen.to(r0["module"]["layers.0.bias"].dtype).float())
    nb = r0["n_buckets"]
    assert nb > 1
    per_step = nb * (gas if stage == 2 else 1)   # stage 2 reduces every micro-step, stage 1 at the boundary
    assert r0["counts"] == {"reduce_scatter": per_step * N_STEPS, "all_gather": nb * N_STEPS}, (key, r0["counts"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero12_matches_plain_pytorch(world_size):
    res = run_distributed(_body, world_size, args=(world_size == 2,), timeout=240)
    for key in (CONFIGS if world_size == 2 else CONFIGS_4):
        ref, _, _ = reference(N_STEPS, MB * key[1] * world_size)
        _check_config(res, key, world_size, ref, TOL[key[2]])
    if world_size != 2:
        return
    ref, _, _ = reference(N_STEPS, MB * 2 * world_size)
    ref_adam, _, _ = reference(N_STEPS, MB * 2 * world_size, opt_name="adamw")
    r = res[0]
    nb = r["offload_s1"]["n_buckets"]
    # offload (master, grads and optimizer state on the host) gives the same parameters
    for name in ("offload_s1", "offload_s2", "s2_sync_reduce_noncontig", "s1_reduce", "s1_native_collectives",
                 "s2_native_collectives", "s2_predivide"):
        for pname, want in ref.items():
            torch.testing.assert_close(r[name]["fp32"][pname], want, **TOL["fp32"], msg=f"{name} {pname}")
    # reduce_scatter: false -> one reduce per owner rank per bucket
    assert r["s1_reduce"]["counts"] == {"reduce": world_size * nb * N_STEPS, "all_gather": nb * N_STEPS}
    assert r["s2_sync_reduce_noncontig"]["counts"]["reduce"] == world_size * nb * 2 * N_STEPS
    # the config's AdamW with offload runs DeepSpeed's CPU Adam, same math as torch AdamW
    assert r["s2_config_adamw_offload"]["inner"] == "DeepSpeedCPUAdam"
    for pname, want in ref_adam.items():
        torch.testing.assert_close(r["s2_config_adamw_offload"]["fp32"][pname], want, rtol=1e-5, atol=1e-6)
    # stage 0 in bf16: one all-reduce per bucket per optimizer step, nothing else
    s0 = r["s0_bf16"]
    assert s0["counts"] == {"all_reduce": s0["n_buckets"] * N_STEPS} and s0["n_buckets"] > 1
    for pname, want in ref.items():
        torch.testing.assert_close(s0["fp32"][pname], want, **TOL["bf16"], msg=f"s0_bf16 {pname}")
    # fp32 gradient accumulation at stage 2 (bf16 model) and fp16 with loss scaling at stage 1
    for name in ("s2_bf16_accum_fp32", "s1_fp16", "s1_bf16_comm_fp32"):
        for pname, want in ref.items():
            torch.testing.assert_close(r[name]["fp32"][pname], want, **TOL["bf16"], msg=f"{name} {pname}")
