"""ZeRO stage 3 with ``offload_param.device: nvme`` and ``zero.Init(remote_device="nvme")``
(swap_tensor/partitioned_param_swapper.py, zero/stage3_nvme_params.py).

* the swapper: byte-exact round trips (fp32/bf16/fp16, sizes not a multiple of 4 KiB),
  write-back only with ``write_back``, storage-less partitions while swapped out, at most
  ``buffer_count`` pool buffers and ``max_in_cpu`` cached elements (counted), cached
  partitions never re-read, prefetched reads used by the next hold, a partition larger
  than ``buffer_size`` served by a buffer of its own, files gone after ``close()``;
* fp32 training with the partitions on NVMe ends bit-identical (``torch.equal``) to the
  same run without offload (client torch AdamW; DeepSpeed's CPU Adam with
  ``offload_optimizer: cpu``), with 2 small buffers, a small ``max_in_cpu`` and a small
  prefetch bucket so partitions are evicted and read back every step; at 2 ranks too;
* a model built under ``zero.Init(remote_device="nvme")`` has only storage-less partitions,
  trains identically to one built normally, and its swap files are gone after destroy;
* building under ``zero.Init(remote_device="nvme")`` grows the process's peak RSS by far
  less than the partitions' bytes (``remote_device="cpu"``, measured the same way, grows
  by more than them).
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (AsyncPartitionedParameterSwapper,
                                                                      PartitionedParamStatus)
from tests.helpers.dist import run_distributed
from tests.runtime.zero3._models import TinyLM, lm_batches, make_lm, shard, stage3_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LR, WD = 0.02, 0.1


class _P:
    """A stand-in for a partitioned parameter: the swapper only uses ``ds_tensor``/``ds_id``."""

    def __init__(self, i, t):
        self.ds_id, self.ds_tensor = i, t


def _swapper(path, **kw):
    kw.setdefault("dtype", torch.float32)
    return AsyncPartitionedParameterSwapper(str(path), **kw)


# ---------------------------------------------------------------- the swapper on its own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_byte_exact_and_write_back_is_explicit(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    sizes = [1, 1000, 1025, 4096 // 2 + 3, 30000]       # not multiples of the 4 KiB alignment
    ref = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    ps = [_P(i, r.clone()) for i, r in enumerate(ref)]
    sw = _swapper(tmp_path, dtype=dtype, buffer_count=2, buffer_size=8192, max_in_cpu=0)
    sw.add_params(ps)
    for p in ps:   # swapped out: no storage, sizes and dtype kept
        assert p.ds_tensor.device.type == "meta" and p.ds_tensor.dtype == dtype
        assert p.ds_tensor.ds_numel == p.ds_tensor.numel() > 0
        assert p.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE
    files = sorted(f for f in os.listdir(sw.swap_folder) if f.endswith(".swp"))
    assert len(files) == len(sizes)
    for p, r in zip(ps, ref):
        sw.make_resident([p])
        assert p.ds_tensor.status == PartitionedParamStatus.AVAILABLE
        assert torch.equal(p.ds_tensor.view(torch.uint8), r.view(torch.uint8))   # bit for bit
        p.ds_tensor.add_(1)              # changed, released without write_back: discarded
        sw.release_resident([p])
        assert p.ds_tensor.device.type == "meta"
    for p, r in zip(ps, ref):
        sw.make_resident([p])
        assert torch.equal(p.ds_tensor.view(torch.uint8), r.view(torch.uint8))
        p.ds_tensor.mul_(-2)
        sw.release_resident([p], write_back=True)
    sw.make_resident(ps)
    assert all(torch.equal(p.ds_tensor, r * -2) for p, r in zip(ps, ref))
    # the contract: ds_tensor is written in place, never rebound while swapped
    ps[0].ds_tensor = ps[0].ds_tensor.clone()
    with pytest.raises(RuntimeError, match="rebound"):
        sw.release_resident(ps[:1])
    folder = sw.swap_folder
    sw.close()
    assert not os.path.exists(folder)
    with pytest.raises(RuntimeError, match="closed"):
        sw.make_resident(ps[1:])


def test_pool_and_cache_limits_are_respected(tmp_path):
    """buffer_count buffers of buffer_size elements at most; max_in_cpu cached elements at most;
    a cached partition is never read again; a prefetched read is used by the next hold."""
    g = torch.Generator().manual_seed(1)
    n, size, max_in_cpu = 24, 1000, 2500       # 4 KiB-aligned slot per partition: 4000 B -> 4096 B
    ref = [torch.randint(-1000, 1000, (size,), generator=g).float() for _ in range(n)]   # +1 stays exact
    ps = [_P(i, r.clone()) for i, r in enumerate(ref)]
    sw = _swapper(tmp_path, buffer_count=2, buffer_size=2048, max_in_cpu=max_in_cpu)   # 2 x 8 KiB: 2 slots each
    sw.add_params(ps)
    peak_res = 0
    for rnd in range(3):
        for i in range(0, n, 3):                 # a "module" of 3 partitions at a time
            mod = ps[i:i + 3]
            sw.make_resident(mod)
            assert all(torch.equal(p.ds_tensor, ref[p.ds_id] + rnd) for p in mod)
            for p in mod:
                p.ds_tensor.add_(1)
            peak_res = max(peak_res, sw.resident_numel())
            sw.release_resident(mod, write_back=True)
            assert sw.cached_numel <= max_in_cpu
            assert len(sw._arenas) <= 2 and sw.pool_bytes() <= 2 * sw.buffer_bytes
    st = sw.stats
    assert st["peak_arenas"] == 2 and st["peak_cached_numel"] <= max_in_cpu and st["overflow"] == 0
    assert st["evictions"] > n    # the cache holds 2 of 24 partitions: the rest go back to disk
    # resident at most: one module (3) + the cache (2 partitions) + its newest entry before trimming
    assert peak_res <= 6 * size
    # a cached partition is not read again; an evicted one is
    cached = [e.param for e in sw._lru.values()]
    assert len(cached) == max_in_cpu // size
    reads = st["reads"]
    sw.make_resident(cached)
    assert sw.stats["reads"] == reads and sw.stats["cache_hits"] >= len(cached)
    sw.release_resident(cached)
    # prefetch: reads submitted now (no wait), taken by the next hold without reading again
    out = [p for p in ps if id(p) not in sw._lru][:2]
    assert sw.prefetch(out) == 2 and sw.stats["reads"] == reads + 2
    sw.make_resident(out)
    assert sw.stats["reads"] == reads + 2
    assert all(torch.equal(p.ds_tensor, ref[p.ds_id] + 3) for p in out)
    sw.release_resident(out)
    # more partitions held at once than the pool holds: the excess is ordinary memory, counted
    sw.make_resident(ps)
    assert sw.stats["overflow"] > 0 and sw.overflow_bytes > 0
    assert all(torch.equal(p.ds_tensor, ref[p.ds_id] + 3) for p in ps)
    sw.release_resident(ps)
    assert sw.overflow_bytes == 0
    sw.close()


def test_partition_larger_than_buffer_size_gets_its_own_buffer(tmp_path, caplog):
    big = torch.arange(5000, dtype=torch.float32)
    p = _P(0, big.clone())
    sw = _swapper(tmp_path, buffer_count=1, buffer_size=1024, max_in_cpu=0)
    sw.add_params([p])
    assert sw.prefetch([p]) == 0           # never prefetched into the pool
    sw.make_resident([p])
    assert torch.equal(p.ds_tensor, big) and sw.oversize_bytes >= big.numel() * 4 and sw.pool_bytes() == 0
    sw.release_resident([p])
    assert sw.oversize_bytes == 0
    sw.close()


def test_bad_swapper_settings_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="offload_param.buffer_count"):
        _swapper(tmp_path, buffer_count=0)
    with pytest.raises(ValueError, match="offload_param.nvme_path"):
        _swapper(tmp_path / "missing")
    with pytest.raises(ValueError, match="offload_param.nvme_path is not set"):
        AsyncPartitionedParameterSwapper.from_config({"device": "nvme"})


def test_partitioned_params_gather_modify_and_overwrite_through_nvme(tmp_path):
    """convert_param hands partitions to spec.swapper; gather_params, GatheredParameters
    (modifier_rank) and resident_partitions(overwrite=True) go through it."""
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param import (PartitionSpec, ZeroParamStatus, convert_param,
                                                          gather_params, release_param, resident_partitions)
    from deepspeed.runtime.zero.stage3_comm import comm_for
    spec = PartitionSpec(comm_for(None), "cpu", "cpu")
    spec.swapper = sw = _swapper(tmp_path, buffer_count=2, buffer_size=3000, max_in_cpu=0)
    g = torch.Generator().manual_seed(3)
    ref = [torch.randn(n, generator=g) for n in (1000, 2500, 17, 5000)]    # 5000 > buffer_size
    ps = [torch.nn.Parameter(r.clone()) for r in ref]
    for p in ps:
        convert_param(p, spec)
    assert all(p.ds_tensor.device.type == "meta" and p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in ps)
    gather_params(ps)        # 34 KB of partitions through a 24 KB pool: gathered a pool's worth at a time
    assert all(torch.equal(p.data, r) for p, r in zip(ps, ref)) and sw.stats["overflow"] == 0
    for p in ps:
        release_param(p)
    with deepspeed.zero.GatheredParameters(ps[:2], modifier_rank=0):
        with torch.no_grad():
            ps[0].mul_(3)
    reads = sw.stats["reads"]
    with resident_partitions(ps[1:2], overwrite=True):
        ps[1].ds_tensor.fill_(7)
    assert sw.stats["reads"] == reads          # overwritten, not read first
    gather_params(ps)
    assert torch.equal(ps[0].data, ref[0] * 3) and bool((ps[1].data == 7).all()) and torch.equal(ps[3].data, ref[3])
    sw.close()


# ---------------------------------------------------------------- training


def _nvme_cfg(path, opt_off=None, **param):
    cfg = stage3_config(gas=2, mb=2, stage3_prefetch_bucket_size=40, stage3_max_live_parameters=200,
                        stage3_max_reuse_distance=0)
    cfg["gradient_clipping"] = 0.5
    if opt_off:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": opt_off}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
    if path is not None:
        off = {"device": "nvme", "nvme_path": str(path), "buffer_count": 2, "buffer_size": 300, "max_in_cpu": 150}
        off.update(param)
        cfg["zero_optimization"]["offload_param"] = off
    return cfg


def _train(cfg, model=None, steps=3, rank=0, ws=1, seed=0):
    import deepspeed
    model = make_lm(seed=seed, n_layers=3) if model is None else model
    opt = None if "optimizer" in cfg else torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    eng = deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]
    gas, mb = cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"]
    for b in lm_batches(steps, gas * mb * ws):
        for m in range(gas):
            x, y = shard(b, rank, ws, m, mb)
            eng.backward(eng(x, y))
            eng.step()
    sd = eng.module_state_dict()
    sw = eng.optimizer.spec.swapper
    info = None
    if sw is not None:
        info = dict(sw.stats, folder=sw.swap_folder, swapped=sw.swapped_numel(),
                    total=sum(p.ds_tensor.numel() for p in model.parameters()))
    eng.destroy()
    if info is not None:
        info["gone"] = not os.path.exists(info["folder"])
    return sd, info


def _same(a, b):
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"differ: {bad}"


@pytest.mark.parametrize("opt_off", [None, "cpu"])
def test_fp32_training_with_params_on_nvme_is_bit_identical(tmp_path, opt_off):
    ref, _ = _train(_nvme_cfg(None, opt_off))
    got, info = _train(_nvme_cfg(tmp_path, opt_off))
    _same(ref, got)
    assert info["swapped"] == info["total"] > 0          # every partition lived in a swap file
    assert info["reads"] > 3 * 2 * info["total"] / 300 / 10 and info["bytes_written"] > 0
    assert info["evictions"] > 0 and info["prefetched"] > 0 and info["peak_arenas"] <= 2
    assert info["peak_cached_numel"] <= 150
    assert info["gone"]


def test_checkpoint_of_an_nvme_param_run_resumes_bit_identical(tmp_path):
    """Save after 2 of 4 steps with the partitions on NVMe; resume with NVMe and without
    offload: both end equal to the uninterrupted run; no swap path in the checkpoint."""
    import deepspeed
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    batches = lm_batches(4, 4)

    def engine(cfg):
        return deepspeed.initialize(model=make_lm(seed=0, n_layers=3), config=cfg)[0]

    def steps(eng, bs):
        for b in bs:
            for m in range(2):
                x, y = shard(b, 0, 1, m, 2)
                eng.backward(eng(x, y))
                eng.step()

    base, nv = _nvme_cfg(None, "cpu"), _nvme_cfg(nvme, "cpu")
    eng = engine(base)
    steps(eng, batches)
    ref = eng.module_state_dict()
    eng.destroy()
    eng = engine(nv)
    steps(eng, batches[:2])
    folder = eng.optimizer.spec.swapper.swap_folder
    eng.save_checkpoint(str(tmp_path / "ck"), tag="t")
    eng.destroy()
    for name in os.listdir(tmp_path / "ck" / "t"):
        with open(tmp_path / "ck" / "t" / name, "rb") as f:
            data = f.read()
        assert folder.encode() not in data and b"ds_swap" not in data, name
    for cfg in (nv, base):
        eng = engine(cfg)
        eng.load_checkpoint(str(tmp_path / "ck"), tag="t")
        steps(eng, batches[2:])
        _same(ref, eng.module_state_dict())
        eng.destroy()


def _built_under_init(path, seed=0):
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    torch.manual_seed(seed)
    with deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=_nvme_cfg(path)):
        model = TinyLM(n_layers=3)
    for p in model.parameters():
        assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE
        assert p.ds_tensor.device.type == "meta" or p.ds_tensor.numel() <= 150   # on NVMe, or in the cache
    return model


def test_zero_init_nvme_model_trains_like_a_normally_built_one(tmp_path):
    ref, _ = _train(_nvme_cfg(None))
    model = _built_under_init(tmp_path)
    init_sw = next(iter(model.parameters()))._z3.swapper
    assert init_sw is not None and init_sw.swapped_numel() == sum(p.ds_tensor.numel() for p in model.parameters())
    got, info = _train(_nvme_cfg(tmp_path), model=model)
    _same(ref, got)
    assert info["folder"] == init_sw.swap_folder      # the engine took zero.Init's swapper over (no copy)
    assert info["gone"]


def _two_ranks(rank, ws, path):
    ref, _ = _train(_nvme_cfg(None), rank=rank, ws=ws, steps=2)
    got, info = _train(_nvme_cfg(os.path.join(path, f"r{rank}")), rank=rank, ws=ws, steps=2)
    model = _built_under_init(os.path.join(path, f"r{rank}"))
    got_init, _ = _train(_nvme_cfg(os.path.join(path, f"r{rank}")), model=model, rank=rank, ws=ws, steps=2)
    return {"same": all(torch.equal(ref[k], got[k]) for k in ref) if rank == 0 else True,
            "same_init": all(torch.equal(ref[k], got_init[k]) for k in ref) if rank == 0 else True,
            "reads": info["reads"], "gone": info["gone"], "half": info["swapped"]}


def test_two_ranks_nvme_params_and_zero_init_match_no_offload(tmp_path):
    for r in (0, 1):
        os.makedirs(tmp_path / f"r{r}")
    out = run_distributed(_two_ranks, world_size=2, args=(str(tmp_path),), timeout=240)
    assert out[0]["same"] and out[0]["same_init"]
    assert all(o["reads"] > 0 and o["gone"] for o in out)
    assert out[0]["half"] == out[1]["half"]


# ---------------------------------------------------------------- memory while building

_BUILD = textwrap.dedent("""
    import json, sys, torch, deepspeed
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    path, layers, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": path, "buffer_count": 2, "buffer_size": width * width, "max_in_cpu": 0}}}
    torch.empty(width * width).normal_()   # warm the allocator and the RNG before the baseline
    out = {}
    for remote in ("nvme", "cpu"):         # nvme first: its peak is what the cpu build starts from
        before = status("VmRSS:")
        with deepspeed.zero.Init(remote_device=remote, config_dict_or_path=cfg):
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
        sw = next(model.parameters())._z3.swapper
        if sw is not None:
            sw.synchronize()
        out[remote] = {"growth": status("VmHWM:") - before,
                       "partition_bytes": sum(p.ds_tensor.numel() * p.ds_tensor.element_size()
                                              for p in model.parameters()),
                       "meta": all(p.ds_tensor.device.type == "meta" for p in model.parameters())}
        if sw is not None:
            sw.close()
        del model
    print(json.dumps(out))
""")


def test_zero_init_nvme_peak_rss_growth_is_far_below_the_partitions(tmp_path):
    """Peak RSS (VmHWM) growth while building 48 fp32 1024x1024 layers (192 MiB of partitions)
    under zero.Init: nvme stays far below the partitions' bytes; cpu (the reference, same
    process and measure) holds them all."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-c", _BUILD, str(tmp_path), "48", "1024"], cwd=REPO,
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    nvme, cpu = out["nvme"], out["cpu"]
    total = nvme["partition_bytes"]
    assert total == cpu["partition_bytes"] == 48 * 1024 * 1024 * 4
    assert nvme["meta"] and not cpu["meta"]
    assert cpu["growth"] > 0.9 * total, out      # the reference holds every partition
    assert nvme["growth"] < 0.25 * total, out    # one layer + the 2-buffer pool + writes in flight
    assert not os.listdir(tmp_path) or not os.listdir(tmp_path / "ds_swap")   # files gone after close
