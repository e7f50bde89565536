"""Checkpoint integrity: corrupted files are caught and named (file and tensor) at ZeRO stages
0-3, missing per-rank files are named with the rank and world size that wrote them, every
reader refuses a malicious pickle without running it, an empty ``latest`` is an error, and a
killed save's leftovers are swept by the next save."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import deepspeed
from deepspeed.checkpoint import DeepSpeedCheckpoint
from deepspeed.runtime.checkpoint import CheckpointError
from deepspeed.runtime.checkpoint.io import load_file
from deepspeed.runtime.checkpoint.manifest import MANIFEST, _record_ranges, read_manifest, set_checkpoint_verification
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.helpers.dist import run_distributed
from tests.helpers.models import make_model


def _cfg(stage):
    return {"train_batch_size": 4, "steps_per_print": 0, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": stage}}


def _trained(stage, seed=0):
    eng, *_ = deepspeed.initialize(model=make_model(seed=seed), config=_cfg(stage))
    g = torch.Generator().manual_seed(3)
    loss = eng(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
    eng.backward(loss)
    eng.step()
    return eng


def _flip(path, record):
    """Flip one bit in the middle of a record's data; returns the record's byte offset."""
    rec = {r: (off, size) for r, off, size in _record_ranges(path)}
    off, size = rec[record]
    with open(path, "r+b") as f:
        f.seek(off + size // 2)
        b = f.read(1)
        f.seek(off + size // 2)
        f.write(bytes([b[0] ^ 0x08]))
    return off


def _largest_tensor_record(path):
    return max((r for r in _record_ranges(path) if r[0].startswith("data/")), key=lambda r: r[2])[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_flipped_bytes_in_each_file_are_caught_and_named(stage, tmp_path):
    eng = _trained(stage)
    save = str(tmp_path / "ckpt")
    eng.save_checkpoint(save)
    tag_dir = os.path.join(save, "global_step1")
    man = read_manifest(tag_dir)
    pt_files = sorted(n for n in os.listdir(tag_dir) if n.endswith(".pt"))
    assert sorted(n for n in man["files"] if n.endswith(".pt")) == pt_files
    assert all(any(k in n for n in pt_files) for k in ("model_states", "optim_states", "rng_state")), pt_files
    pristine = str(tmp_path / "pristine")
    shutil.copytree(save, pristine)
    for name in pt_files:
        shutil.rmtree(save)
        shutil.copytree(pristine, save)
        path = os.path.join(tag_dir, name)
        record = _largest_tensor_record(path)
        _flip(path, record)
        with pytest.raises(CheckpointError) as err:
            eng.load_checkpoint(save)
        msg = str(err.value)
        assert name in msg and "corrupted" in msg, msg
        assert f"{record} -> '" in msg, msg   # the record and the tensor(s) stored in it, by key
    # the byte flip inside the pickled structure (not tensor data) is caught too, and named as such
    shutil.rmtree(save)
    shutil.copytree(pristine, save)
    optim = next(n for n in pt_files if "optim_states" in n)
    _flip(os.path.join(tag_dir, optim), "data.pkl")
    with pytest.raises(CheckpointError, match=optim):
        eng.load_checkpoint(save)
    # the documented switch: without verification the same file is not checked against the manifest
    shutil.rmtree(save)
    shutil.copytree(pristine, save)
    _flip(os.path.join(tag_dir, optim), _largest_tensor_record(os.path.join(tag_dir, optim)))
    with set_checkpoint_verification(False):
        eng.load_checkpoint(save)   # loads: this is what happened before the manifest existed
    with pytest.raises(CheckpointError, match="corrupted"):
        eng.load_checkpoint(save)   # the block ended: verification is back on
    eng.destroy()


def test_optimizer_file_is_loaded_from_the_map_its_check_reads(tmp_path, monkeypatch):
    """The optimizer file is checked in the background over the very map its tensors are sliced
    from (one page fault per page); the load returns before the check ends and the check's
    outcome still decides the load, at the agreement."""
    from deepspeed.runtime.checkpoint import manifest
    eng = _trained(2)
    save = str(tmp_path / "ckpt")
    eng.save_checkpoint(save)
    want = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    want_opt = [t.clone() for t in _opt_tensors(eng)]
    taken = []
    real = manifest.take_prefetched

    def spy(path):
        got = real(path)
        taken.append((os.path.basename(path), got is not None))
        return got
    monkeypatch.setattr(manifest, "take_prefetched", spy)
    fresh, *_ = deepspeed.initialize(model=make_model(seed=5), config=_cfg(2))
    fresh.load_checkpoint(save)
    assert ("zero_pp_rank_0_mp_rank_00_optim_states.pt", True) in taken, taken
    for n, p in fresh.module.named_parameters():
        assert torch.equal(p, want[n]), n
    got_opt = _opt_tensors(fresh)
    assert len(got_opt) == len(want_opt) and all(torch.equal(a, b) for a, b in zip(got_opt, want_opt))
    optim = os.path.join(save, "global_step1", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _flip(optim, _largest_tensor_record(optim))
    taken.clear()
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt.*corrupted"):
        fresh.load_checkpoint(save)
    assert ("zero_pp_rank_0_mp_rank_00_optim_states.pt", True) in taken, taken
    # outside a load's agreement, a mismatch found after the file was loaded raises when settled
    manifest._verified.clear()
    manifest.prefetch([optim])
    mapped, fut = manifest.take_prefetched(optim)
    with pytest.raises(CheckpointError, match="corrupted"):
        manifest.settle(fut)
    eng.destroy()
    fresh.destroy()


def _opt_tensors(eng):
    sd = eng.optimizer.state_dict()
    out = []

    def walk(x):
        if torch.is_tensor(x):
            out.append(x)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(sd)
    return out


def test_corrupted_optimizer_named_tensor_is_the_one_flipped(tmp_path):
    """The tensor named is the one whose bytes changed (checked against the file's own structure)."""
    eng = _trained(2)
    eng.save_checkpoint(str(tmp_path))
    path = os.path.join(str(tmp_path), "global_step1", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with set_checkpoint_verification(False):
        before = load_file(path)
    record = _largest_tensor_record(path)
    _flip(path, record)
    with set_checkpoint_verification(False):
        after = load_file(path)
    changed = []

    def walk(a, b, key):
        if torch.is_tensor(a):
            if not torch.equal(a, b):
                changed.append(key)
        elif isinstance(a, dict):
            for k in a:
                walk(a[k], b[k], f"{key}/{k}" if key else str(k))
        elif isinstance(a, (list, tuple)):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{key}[{i}]")
    walk(before, after, "")
    assert len(changed) == 1
    with pytest.raises(CheckpointError) as err:
        load_file(path)
    assert f"'{changed[0]}'" in str(err.value), (changed, str(err.value))
    eng.destroy()


def _save_two_ranks(rank, ws, out):
    eng, *_ = deepspeed.initialize(model=make_model(), config=_cfg(2))
    loss = eng(torch.randn(2, 8), torch.randn(2, 4))
    eng.backward(loss)
    eng.step()
    eng.save_checkpoint(out)
    return sorted(os.listdir(os.path.join(out, "global_step1")))


def test_missing_rank_file_names_rank_file_and_world_size(tmp_path):
    out = str(tmp_path / "ckpt")
    files = run_distributed(_save_two_ranks, 2, args=(out,), timeout=240)[0]
    tag_dir = os.path.join(out, "global_step1")
    man = read_manifest(tag_dir)
    assert man["world_size"] == 2 and MANIFEST in files
    assert man["files"]["zero_pp_rank_1_mp_rank_00_optim_states.pt"]["rank"] == 1
    os.remove(os.path.join(tag_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    expected = ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "rank 1", "of the 2 ranks", "global_step1")
    for call in (lambda: get_fp32_state_dict_from_zero_checkpoint(out),
                 lambda: DeepSpeedCheckpoint(tag_dir)):
        with pytest.raises(CheckpointError) as err:
            call()
        assert all(e in str(err.value) for e in expected), str(err.value)
    eng, *_ = deepspeed.initialize(model=make_model(), config=_cfg(2))
    with pytest.raises(CheckpointError) as err:
        eng.load_checkpoint(out)
    assert all(e in str(err.value) for e in expected), str(err.value)
    eng.destroy()


def test_a_file_every_rank_reads_is_checked_in_shares(tmp_path):
    """Inside a load's agreement, member i of n checks every n-th tensor of a shared file
    (the others are checked by the other members); outside it, every tensor, and raises."""
    from deepspeed.runtime.checkpoint.manifest import deferred_failures
    eng = _trained(0)
    eng.save_checkpoint(str(tmp_path))
    path = os.path.join(str(tmp_path), "global_step1", "mp_rank_00_model_states.pt")
    _flip(path, "data/1")   # the second tensor torch reads
    for share, caught in (((0, 2), False), ((1, 2), True), (None, True)):
        with deferred_failures(share) as failures:
            load_file(path, share=True)
        assert bool(failures) == caught, (share, failures)
        assert all("data/1 -> '" in f for f in failures), failures
    with pytest.raises(CheckpointError, match="data/1 -> '"):
        load_file(path, share=True)   # no agreement to rely on: checked whole, and raised
    eng.destroy()


def _load_damaged_at_two_ranks(rank, ws, out):
    """Every rank loads while rank 0 damages one file at a time: a tensor of rank 1's optimizer
    file (only rank 1 reads it) and two tensors of the model-states file (both ranks read it
    and each checks a share of its tensors: one of them each). Returns each load's error (None when it loaded)."""
    import torch.distributed as dist
    eng, *_ = deepspeed.initialize(model=make_model(), config=_cfg(2))
    loss = eng(torch.randn(2, 8), torch.randn(2, 4))
    eng.backward(loss)
    eng.step()
    eng.save_checkpoint(out)
    tag = os.path.join(out, "global_step1")
    saved = {k: v.clone() for k, v in eng.module.state_dict().items()}
    with torch.no_grad():
        for p in eng.module.parameters():
            p.zero_()
    eng.load_checkpoint(out)   # undamaged: loads, the weights come back
    assert all(torch.equal(saved[k], v) for k, v in eng.module.state_dict().items())
    pristine = {n: open(os.path.join(tag, n), "rb").read() for n in os.listdir(tag)}
    model = "mp_rank_00_model_states.pt"
    optim1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    targets = [(optim1, _largest_tensor_record(os.path.join(tag, optim1)))]
    # the first two tensors torch reads: one in each rank's share
    targets += [(model, f"data/{i}") for i in range(2)]
    errors = []
    dist.barrier()   # every rank has read the pristine files before rank 0 changes them
    for name, record in targets:
        if rank == 0:
            for n, data in pristine.items():
                with open(os.path.join(tag, n), "wb") as f:
                    f.write(data)
            _flip(os.path.join(tag, name), record)
        dist.barrier()
        try:
            eng.load_checkpoint(out)
            errors.append((name, record, None))
        except CheckpointError as err:
            errors.append((name, record, str(err)))
        dist.barrier()
    eng.destroy()
    return errors


def test_damage_only_another_rank_reads_fails_the_load_on_every_rank(tmp_path):
    out = str(tmp_path / "ckpt")
    per_rank = run_distributed(_load_damaged_at_two_ranks, 2, args=(out,), timeout=240)
    assert len(per_rank[0]) >= 3   # the optimizer file and at least two model-states tensors
    for rank, errors in enumerate(per_rank):
        for name, record, msg in errors:
            assert msg is not None, (rank, name, record)
            assert name in msg and "corrupted" in msg and f"{record} -> '" in msg, (rank, msg)
            assert msg.count(" -> ") == 1, msg   # only the damaged tensor is named


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))   # creates the marker file if it ever runs


def test_every_reader_refuses_a_malicious_pickle(tmp_path):
    eng = _trained(2)
    save = str(tmp_path / "ckpt")
    eng.save_checkpoint(save)
    tag_dir = os.path.join(save, "global_step1")
    marker = str(tmp_path / "PWNED")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"module": {"w": _Payload(marker)}, "x": _Payload(marker)}, os.path.join(tag_dir, name))
    os.remove(os.path.join(tag_dir, MANIFEST))   # no manifest: only the unpickler stands in the way
    torch.save({"weight": _Payload(marker)}, os.path.join(tag_dir, "layer_01-model_states.pt"))
    torch.save({"x": _Payload(marker)},
               os.path.join(tag_dir, "expp_rank_0_edp_rank_0_ep_size_1_mp_rank_00_optim_states.pt"))
    from deepspeed.moe.checkpoint import expert_optim_states
    from deepspeed.runtime.checkpoint import io as ckpt_io
    from deepspeed.runtime.checkpoint.deepspeed_native import load_native
    from deepspeed.runtime.pipe.module import PipelineModule
    optim = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_optim_states.pt")

    class _Topo:
        def get_rank_repr(self, rank):
            return ""

    class _OneLayer:   # what PipelineModule.load_state_dir needs of a pipeline stage
        forward_funcs = [torch.nn.Linear(2, 2)]
        _topo, global_rank = _Topo(), 0
        _local_layer_ids = [1]
        _layer_module = PipelineModule._layer_module
        ckpt_layer_path = PipelineModule.ckpt_layer_path

    readers = {
        "engine.load_checkpoint": lambda: eng.load_checkpoint(save),
        "zero_to_fp32": lambda: get_fp32_state_dict_from_zero_checkpoint(save),
        "DeepSpeedCheckpoint": lambda: DeepSpeedCheckpoint(tag_dir),
        "load_file": lambda: load_file(os.path.join(tag_dir, "layer_01-model_states.pt")),
        "pipeline layer files": lambda: PipelineModule.load_state_dir(_OneLayer(), tag_dir),
        "MoE expert optimizer files": lambda: expert_optim_states(tag_dir),
        "DeepSpeed-written files (converter)": lambda: load_native(optim),
        "NVMe / larger-than-RAM map (MAP_NORESERVE)": lambda: ckpt_io._load_mapped_noreserve(optim),
    }
    for what, call in readers.items():
        with pytest.raises(Exception, match="weights_only|Weights only|WeightsUnpickler|Unsupported global") as err:
            call()
        assert not os.path.exists(marker), what
        assert isinstance(err.value, CheckpointError) or what.startswith("NVMe"), (what, err.value)
    ck_dir = str(tmp_path / "only_layers")
    os.makedirs(ck_dir)
    shutil.copy(os.path.join(tag_dir, "layer_01-model_states.pt"), ck_dir)
    shutil.copy(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), ck_dir)
    with pytest.raises(CheckpointError):
        DeepSpeedCheckpoint(ck_dir).get_embedding_state()
    assert not os.path.exists(marker)
    eng.destroy()


def test_empty_or_unreadable_latest_is_an_error(tmp_path):
    eng = _trained(0)
    save = str(tmp_path)
    assert eng.load_checkpoint(save) == (None, None)   # no 'latest': no checkpoint yet
    eng.save_checkpoint(save)
    latest = os.path.join(save, "latest")
    for content in ("", "  \n"):
        with open(latest, "w") as f:
            f.write(content)
        with pytest.raises(CheckpointError, match="latest.*empty"):
            eng.load_checkpoint(save)
        with pytest.raises(CheckpointError, match="empty"):
            get_fp32_state_dict_from_zero_checkpoint(save)
    with open(latest, "wb") as f:
        f.write(b"\xff\xfe\x00bad")
    with pytest.raises(CheckpointError, match="cannot be read|does not hold"):
        eng.load_checkpoint(save)
    with open(latest, "w") as f:
        f.write("global_step1")
    path, _ = eng.load_checkpoint(save)
    assert path.endswith("global_step1")
    eng.destroy()


def test_killed_save_leftovers_are_swept_by_the_next_save(tmp_path):
    eng = _trained(1)
    save = str(tmp_path)
    eng.save_checkpoint(save, tag="a")
    # what saves killed at various points leave: a temporary tag directory (another tag), a
    # half-written 'latest', and tag 'a' moved aside while being replaced
    os.makedirs(os.path.join(save, ".tmp-global_step7"))
    with open(os.path.join(save, ".tmp-global_step7", "mp_rank_00_model_states.pt.part"), "wb") as f:
        f.write(b"x" * 100)
    with open(os.path.join(save, "latest.part"), "w") as f:
        f.write("glob")
    os.replace(os.path.join(save, "a"), os.path.join(save, ".old-a"))
    eng.save_checkpoint(save, tag="b")
    assert sorted(os.listdir(save)) == ["a", "b", "latest", "zero_to_fp32.py"]
    eng.load_checkpoint(save, tag="a")   # the tag being replaced was put back, intact (verified)
    eng.destroy()
