"""Checkpoints of NVMe-offloaded optimizer state (``offload_optimizer.device: nvme``) are
saved and loaded without holding the state in anonymous memory, in the ordinary format.

* memory: a child process (ZeRO stage 3 and stage 2, bf16, 340 MB of fp32 master + Adam
  moments in 12 sub-groups; ``python -m tests.runtime.swap_tensor.test_nvme_checkpoint_memory``
  runs it alone at any size) saves a checkpoint and a fresh engine loads it; the peak growth
  of ``RssAnon`` (sampled every 2 ms by a thread) during ``save_checkpoint`` and during
  ``load_checkpoint`` stays below 0.35 of the state, and below 0.1 of it beyond the bf16
  module weights (which the model-states file holds and which are gathered / loaded in
  memory as with any offload mode). The code before this change grew by 2.2x the state
  on save at both stages and 1.9x on load at stage 2 (0.17 beyond the module at stage-3
  load: chunk-sized temporaries); the resumed run continues bit-identically;
* format: the optimizer files an NVMe run writes equal those of the same run without
  offload (stages 1 and 2, with fragments straddling sub-groups) and with CPU offload
  (stage 3), tensor for tensor, each tensor's storage exactly its elements, same file size;
* the pieces this rests on: ``map_sub_group`` (a private map of the swap file),
  ``overwrite_sub_group`` (fill a buffer in place; nothing written if the body raises),
  ``map_file``, ``share_saved_tensors`` (exact-size aliases instead of copies), and the
  fragment reader's fallback for an optimizer file larger than RAM + swap.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers.dist import free_port, run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# ------------------------------------------------------------------ memory (child processes)

CHILD = textwrap.dedent(r"""
    import gc, json, os, sys, threading, time
    sys.path.insert(0, {repo!r})
    import torch
    torch.set_num_threads(1)
    import deepspeed

    def anon():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no RssAnon in /proc/self/status")

    class PeakAnon:
        # peak RssAnon while the block runs, sampled every ~2 ms by a background thread
        def __enter__(self):
            gc.collect()
            self.base = self.peak = anon()
            self.stop = threading.Event()
            def run():
                while not self.stop.is_set():
                    self.peak = max(self.peak, anon())
                    self.stop.wait(0.002)
            self.thread = threading.Thread(target=run, daemon=True)
            self.thread.start()
            self.t0 = time.perf_counter()
            return self

        def __exit__(self, *exc):
            self.wall = time.perf_counter() - self.t0
            self.stop.set()
            self.thread.join()
            self.growth = max(self.peak, anon()) - self.base

    stage, path = int(sys.argv[1]), sys.argv[2]
    # default 12 x Linear(1536, 1536): 28.3M parameters, 12 sub-groups / chunks
    LAYERS, DIM, SGS = [int(v) for v in sys.argv[3:6]] if len(sys.argv) > 5 else (12, 1536, 2400000)

    def engine(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)])
        zero = {{"stage": stage, "sub_group_size": SGS,
                 "offload_optimizer": {{"device": "nvme", "nvme_path": path, "buffer_count": 2,
                                       "pipeline_write": True}}}}
        if stage == 3:
            zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                        stage3_max_live_parameters=0, stage3_prefetch_bucket_size=0, reduce_bucket_size=DIM * DIM)
        cfg = {{"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "bf16": {{"enabled": True}},
               "zero_optimization": zero, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}}}
        return deepspeed.initialize(model=model, config=cfg)[0]

    def step(eng, seed):
        x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(seed)).bfloat16()
        eng.backward(eng(x).float().pow(2).mean())
        eng.step()

    def weights(eng):
        return {{k: v.clone() for k, v in eng.module_state_dict().items()}}

    eng = engine(0)
    step(eng, 1)
    numel = LAYERS * (DIM * DIM + DIM)
    swapped = (len(eng.strategy.parts.chunks) if stage == 3 else len(eng.optimizer._nvme.subgroups))
    out = {{"stage": stage, "state_bytes": 12 * numel, "module_bytes": 2 * numel, "sub_groups": swapped}}
    ck = os.path.join(path, "ckpt")
    with PeakAnon() as m:
        eng.save_checkpoint(ck, tag="t")
    out.update(save_growth=m.growth, save_s=m.wall)
    folder = eng.strategy.parts.nvme.swap_folder if stage == 3 else eng.optimizer._nvme.swapper.swap_folder
    out["swap_dir_after_save"] = sorted(os.listdir(folder))
    step(eng, 2)
    ref = weights(eng)
    eng.destroy()
    del eng
    eng = engine(5)                          # other initial weights: all must come from the checkpoint
    with PeakAnon() as m:
        eng.load_checkpoint(ck, tag="t")
    out.update(load_growth=m.growth, load_s=m.wall)
    step(eng, 2)
    got = weights(eng)
    out["resume_equal"] = sorted(k for k in ref if not torch.equal(ref[k], got[k])) == []
    eng.destroy()
    print(json.dumps(out), flush=True)
""")


def _child(stage, path, *size, stderr=subprocess.PIPE):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    return subprocess.Popen([sys.executable, "-c", CHILD.format(repo=REPO), str(stage), str(path)]
                            + [str(v) for v in size], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr,
                            text=True)


@pytest.mark.slow   # make test budget: a whole-script run (~12-21 s); make test-all runs it
def test_save_and_load_stay_out_of_anonymous_memory(tmp_path):
    procs = {}
    for stage in (3, 2):                     # both at once: one per core
        os.makedirs(tmp_path / f"s{stage}")
        procs[stage] = _child(stage, tmp_path / f"s{stage}")
    results = {}
    try:
        for stage, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
                raise AssertionError(f"stage {stage} child timed out: {stderr[-3000:]}")
            lines = [l for l in stdout.splitlines() if l.startswith("{")]
            assert proc.returncode == 0 and lines, f"stage {stage} child failed: {stderr[-3000:]}"
            results[stage] = json.loads(lines[-1])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    print("NVME_CHECKPOINT_MEMORY", json.dumps(results))
    for stage, r in results.items():
        state, module = r["state_bytes"], r["module_bytes"]
        assert r["sub_groups"] == 12, r
        assert r["resume_equal"], r
        assert not [f for f in r["swap_dir_after_save"] if not f.endswith(".swp") and f != "OWNER"], r   # no temporary
        for phase in ("save", "load"):
            growth = r[f"{phase}_growth"]
            assert growth < 0.35 * state, (stage, phase, growth / state, r)
            assert growth - module < 0.1 * state, (stage, phase, (growth - module) / state, r)


# ------------------------------------------------------------------ format (one world-1 group)

def _walk(a, b, path=""):
    """Same structure and values; every tensor's storage exactly its elements."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
        for t in (a, b):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), path
        return 1
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        return sum(_walk(a[k], b[k], f"{path}/{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        return sum(_walk(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    assert a == b, (path, a, b)
    return 0


def _tensor_bytes(path):
    """Bytes of the tensor storages a torch.save file holds (its zip's ``data/`` records): equal
    for two files exactly when neither pickled a storage larger than its tensor (the files'
    ds_config, which names the offload device, may differ in length)."""
    import zipfile
    with zipfile.ZipFile(path) as z:
        return sum(i.file_size for i in z.infolist() if "/data/" in i.filename)


def _optim_files(folder):
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith("_optim_states.pt"))


def _format_body(rank, world, root):
    import deepspeed
    from tests.helpers.models import global_batches
    from tests.runtime.zero._common import build_engine, ds_config, run_steps
    from tests.runtime.zero3._models import lm_batches, make_lm, shard, stage3_config

    nv = {"device": "nvme", "nvme_path": os.path.join(root, "nv"), "buffer_count": 2}
    os.makedirs(nv["nvme_path"])
    out = {}
    for stage in (1, 2):                      # sub_group_size 37 -> 64: fragments straddle sub-groups
        files = {}
        for mode in ("none", "nvme"):
            cfg = ds_config(stage, 2, 4, "fp32", clip=0.05, bucket=60, sub_group_size=37)
            if mode == "nvme":
                cfg["zero_optimization"]["offload_optimizer"] = nv
            e = build_engine(cfg, opt_name="adamw")
            run_steps(e, 0, 1, global_batches(2, 8))
            if mode == "nvme":
                out[f"s{stage}_straddlers"] = sum(
                    len([s for s in e.optimizer._nvme.by_group[g] if s.lo < f.part_offset + f.numel
                         and f.part_offset < s.hi]) > 1
                    for g, frags in enumerate(e.optimizer.fragments) for f in frags)
            e.save_checkpoint(os.path.join(root, f"s{stage}_{mode}"), tag="t")
            e.destroy()
            files[mode] = _optim_files(os.path.join(root, f"s{stage}_{mode}", "t"))
        out[f"s{stage}"] = files
    for mode in ("cpu", "nvme", "none"):
        cfg = stage3_config(gas=2, mb=2, sub_group_size=100)
        if mode != "none":
            cfg["zero_optimization"]["offload_optimizer"] = nv if mode == "nvme" else {"device": "cpu"}
        model = make_lm(seed=0)
        e = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.02),
                                 config=cfg)[0]
        for b in lm_batches(2, 4):
            for m in range(2):
                x, y = shard(b, 0, 1, m, 2)
                e.backward(e(x, y))
                e.step()
        e.save_checkpoint(os.path.join(root, f"s3_{mode}"), tag="t")
        e.destroy()
    out["s3"] = {m: _optim_files(os.path.join(root, f"s3_{m}", "t")) for m in ("cpu", "nvme", "none")}
    return out


def test_nvme_checkpoint_files_equal_the_in_memory_ones(tmp_path):
    out = run_distributed(_format_body, world_size=1, args=(str(tmp_path),), timeout=180)[0]
    assert out["s1_straddlers"] > 0 and out["s2_straddlers"] > 0
    pairs = [(out["s1"]["none"], out["s1"]["nvme"]), (out["s2"]["none"], out["s2"]["nvme"]),
             (out["s3"]["cpu"], out["s3"]["nvme"])]
    for ref, got in pairs:
        assert len(ref) == len(got) == 1
        a, b = torch.load(ref[0], weights_only=True), torch.load(got[0], weights_only=True)
        # the fragments inside DeepSpeed's envelope (whose ds_config differs: the offload section)
        assert _walk(a["optimizer_state_dict"], b["optimizer_state_dict"]) > 10
        assert _tensor_bytes(ref[0]) == _tensor_bytes(got[0])
    # stage 3 without offload: the same structure (values are those of another update order)
    a = torch.load(out["s3"]["none"][0], weights_only=True)
    b = torch.load(out["s3"]["nvme"][0], weights_only=True)
    a, b = a["optimizer_state_dict"], b["optimizer_state_dict"]   # DeepSpeed's envelope around the fragments
    assert list(a["params"]) == list(b["params"])
    assert _tensor_bytes(out["s3"]["none"][0]) == _tensor_bytes(out["s3"]["nvme"][0])


# ------------------------------------------------------------------ the swapper pieces (in process)

def test_map_and_overwrite_sub_group(tmp_path):
    from deepspeed.runtime.swap_tensor import PartitionedOptimizerSwapper
    with PartitionedOptimizerSwapper(str(tmp_path), buffer_count=1) as sw:
        sw.add_sub_group(0, {"param": torch.arange(1000.0), "exp_avg": torch.full((10, 100), 2.0)})
        sw.add_sub_group(1, {"param": torch.ones(5), "exp_avg": torch.zeros(5)})
        m = sw.map_sub_group(0)
        assert torch.equal(m["param"], torch.arange(1000.0)) and m["exp_avg"].shape == (10, 100)
        assert torch.equal(m["exp_avg"], torch.full((10, 100), 2.0))
        m["param"].zero_()                                    # a private map: the file keeps its values
        del m
        assert torch.equal(sw.read_sub_group(0)["param"], torch.arange(1000.0))
        with sw.overwrite_sub_group(1) as v:
            assert torch.equal(v["param"], torch.zeros(5))      # a zeroed buffer, not the stored values
            v["param"].fill_(7.0)
        assert torch.equal(sw.read_sub_group(1)["param"], torch.full((5,), 7.0))
        assert torch.equal(sw.read_sub_group(1)["exp_avg"], torch.zeros(5))
        with pytest.raises(ValueError, match="boom"):
            with sw.overwrite_sub_group(1) as v:
                v["param"].fill_(9.0)
                raise ValueError("boom")
        assert torch.equal(sw.read_sub_group(1)["param"], torch.full((5,), 7.0))   # nothing written
        for _, t in sw.iterate([0]):                          # the buffer came back: swapping still works
            with pytest.raises(RuntimeError, match="swapped in"):
                sw.map_sub_group(0)
            t["param"].add_(1.0)
        assert torch.equal(sw.map_sub_group(0)["param"], torch.arange(1000.0) + 1)


def test_map_file_and_shared_saved_tensors(tmp_path):
    from deepspeed.runtime.checkpoint.universal import make_rank_state, share_saved_tensors
    from deepspeed.runtime.swap_tensor.utils import map_file
    p = str(tmp_path / "f.bin")
    t = map_file(p, 1000, torch.float32, create=True)        # shared: writes reach the file
    t.copy_(torch.arange(1000.0))
    del t
    assert os.path.getsize(p) == 4000
    r = map_file(p, 600)                                      # private, a prefix of the file
    assert torch.equal(r, torch.arange(600.0))
    with pytest.raises(OSError, match="4000 bytes"):
        map_file(p, 2000)

    def state(fp32):
        return make_rank_state(zero_stage=3, dp_world_size=1, dp_rank=0, mp_rank=0, dtype=torch.bfloat16,
                               params={"w": {"shape": [100], "fragments": [
                                   {"offset": 0, "numel": 100, "fp32": fp32, "state": {"exp_avg": r[300:400]}}]}},
                               param_groups=[{"params": ["w"], "lr": 0.1}], group_state=[{}],
                               optimizer_class="AdamW", loss_scaler=None)
    copied = state(r[100:200])["params"]["w"]["fragments"][0]
    assert copied["fp32"].data_ptr() != r[100:200].data_ptr()                     # a copy, by default
    with share_saved_tensors():
        shared = state(r[100:200])["params"]["w"]["fragments"][0]
    assert shared["fp32"].data_ptr() == r[100:200].data_ptr()                      # the same memory ...
    assert shared["fp32"].untyped_storage().nbytes() == 400                       # ... in a storage of its own
    assert shared["state"]["exp_avg"].data_ptr() == r[300:400].data_ptr()
    f = str(tmp_path / "s.pt")
    torch.save(shared, f)
    back = torch.load(f, weights_only=True)
    assert torch.equal(back["fp32"], torch.arange(100.0, 200.0))
    assert torch.equal(back["state"]["exp_avg"], torch.arange(300.0, 400.0))
    assert os.path.getsize(f) < 400 * 2 + 2000                                      # not the whole map


def test_fragment_file_larger_than_ram_loads_through_a_noreserve_map(tmp_path, monkeypatch):
    """torch.load(mmap=True) maps the whole file private and writable; the kernel's default
    overcommit refuses that for a file larger than RAM + swap (ENOMEM). The fragment reader
    then maps it with MAP_NORESERVE and hands the map to torch's own unpickler."""
    from deepspeed.runtime.checkpoint import universal
    obj = {"format": "x", "t": torch.arange(1000.0), "n": {"i": torch.ones(3, dtype=torch.int64), "l": [1, 2.5, "s"]}}
    f = str(tmp_path / "o.pt")
    torch.save(obj, f)
    got = universal._load_mapped_noreserve(f)
    assert torch.equal(got["t"], obj["t"]) and torch.equal(got["n"]["i"], obj["n"]["i"])
    assert got["n"]["l"] == [1, 2.5, "s"]
    assert got["t"].untyped_storage().nbytes() == 4000             # a slice of the map, as mmap=True gives
    real = torch.load

    def refuse(path, *a, **kw):
        if kw.get("mmap"):
            raise RuntimeError(f"unable to mmap {os.path.getsize(path)} bytes from file <{path}>: "
                               f"Cannot allocate memory (12)")
        return real(path, *a, **kw)
    monkeypatch.setattr(torch, "load", refuse)
    assert torch.equal(universal._load(f)["t"], obj["t"])


if __name__ == "__main__":
    # the measurement alone, at any size (docs/zero_infinity.md):
    #   python -m tests.runtime.swap_tensor.test_nvme_checkpoint_memory STAGE NVME_DIR [LAYERS DIM SUB_GROUP_SIZE]
    proc = _child(*sys.argv[1:], stderr=None)
    print(proc.communicate()[0].strip().splitlines()[-1])
    sys.exit(proc.returncode)
