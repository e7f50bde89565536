"""deepspeed.checkpoint: ZeROCheckpoint merging a tag's optimizer files onto a smaller shape,
DeepSpeedCheckpoint's metadata read once, ds_to_universal's metadata check and
engine._checkpoint_parallel_metadata.

References are independent of the code under test: the weights and Adam moments the REAL
DeepSpeed 0.19.8 saved beside its checkpoints (tests/fixtures/ds_checkpoints, ``expected.pt``);
the trained modules' own parameters; the optimizer state a fresh engine reads back through
``load_checkpoint`` (another reader of the same files)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from deepspeed.checkpoint import (CHECKPOINT_PARALLEL_DIMS, PARAM_SHAPES, DeepSpeedCheckpoint, ZeROCheckpoint,
                                  get_model_3d_descriptor, model_3d_desc)
from deepspeed.checkpoint.constants import AUTOEP_LAYERS_KEY
from deepspeed.checkpoint.ds_to_universal import _aggregate_autoep_zero12_metadata
from deepspeed.runtime.engine import _checkpoint_parallel_metadata
from tests.helpers.dist import run_distributed
from tests.helpers.models import global_batches, make_model

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ds_checkpoints", "v0_19_8")


def _flat(tensors):
    return torch.cat([t.reshape(-1).float() for t in tensors])


# ---------------------------------------------------------------- checkpoints DeepSpeed wrote
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_written_partitions_merge_to_the_full_flat_state(stage):
    run = os.path.join(FIXTURES, f"ws2_stage{stage}")
    tag = os.path.join(run, "step3")
    expected = torch.load(os.path.join(run, "expected.pt"), weights_only=True)
    names = list(expected["params"])                       # module order = DeepSpeed's flat order
    numel = sum(expected["params"][n].numel() for n in names)

    zc = ZeROCheckpoint(tag)
    assert (zc.get_src_pp_degree(), zc.get_src_tp_degree(), zc.get_src_dp_degree()) == (1, 1, 2)
    assert [os.path.basename(f) for f in zc.get_files_for_rank(0, 0, 1)] == [
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    # unmerged, each rank's partition is part of the whole; the last one carries the alignment padding
    parts = [zc.get_state_for_rank(0, 0, d, strip_tensor_paddings=False)["optimizer_state_dict"] for d in range(2)]
    assert all(0 < p["single_partition_of_fp32_groups"][0].numel() < numel + 2 for p in parts)

    zc.reshape(model_3d_desc(1, 1, 1))
    osd = zc.get_state_for_rank(0, 0, 0)["optimizer_state_dict"]
    state = osd["base_optimizer_state"]["state"][0]
    for key in ("exp_avg", "exp_avg_sq"):   # padding stripped, rank partitions concatenated
        assert state[key].numel() == numel
        torch.testing.assert_close(state[key], _flat(expected[key][n] for n in names), rtol=0, atol=0)
    fp32 = osd["single_partition_of_fp32_groups"][0]
    torch.testing.assert_close(fp32[:numel].detach(), _flat(expected["params"][n] for n in names), rtol=0, atol=0)
    assert osd["partition_count"] == [1] and osd["group_paddings"] == [0]
    assert int(state["step"]) == 3

    raw = zc.get_state_for_rank(0, 0, 0, strip_tensor_paddings=False)["optimizer_state_dict"]
    pad = sum(p["group_paddings"][0] for p in parts)
    assert pad == 1      # 67 elements over 2 ranks: DeepSpeed padded the last partition by one
    assert raw["base_optimizer_state"]["state"][0]["exp_avg"].numel() == numel + pad
    with pytest.raises(ValueError, match="Expansion reshape not supported - DP: 2 ---> 4"):
        zc.reshape(model_3d_desc(1, 1, 4))


def test_deepspeed_checkpoint_metadata_of_a_deepspeed_written_tag(monkeypatch):
    tag = os.path.join(FIXTURES, "ws2_stage2", "step3")
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: (loads.append(str(f)), real_load(f, *a, **k))[1])
    ck = DeepSpeedCheckpoint(tag)
    assert loads == ck.mp_rank_files == [os.path.join(tag, "mp_rank_00_model_states.pt")]   # read once
    assert (ck.pp_degree, ck.tp_degree, ck.dp_degree) == (1, 1, 2)
    assert ck.get_iteration() == 3 and ck.get_checkpoint_info() is None and len(loads) == 1
    shapes = {"0.weight": (8, 4), "0.bias": (8,), "2.weight": (3, 8), "2.bias": (3,)}
    (path, meta), = ck.model_state_metadata
    assert {n: tuple(s) for n, s in meta[PARAM_SHAPES].items()} == shapes
    assert meta[CHECKPOINT_PARALLEL_DIMS] == _checkpoint_parallel_metadata(None)[CHECKPOINT_PARALLEL_DIMS]
    by_file, autoep, data_first = _aggregate_autoep_zero12_metadata(ck.model_state_metadata)
    assert [{n: tuple(s) for n, s in d.items()} for d in by_file] == [shapes] and autoep is None and not data_first
    # dp 2 -> 1: get_zero_checkpoint_state merges both files (param_shapes dropped as DeepSpeed does)
    one = DeepSpeedCheckpoint(tag, dp_degree=1)
    assert len(one.get_zero_files(0, 0, 0)) == 2 and not one.get_zero_files(0, 0, 1)
    merged = one.get_zero_checkpoint_state(0, 0, 0)["optimizer_state_dict"]
    assert merged["base_optimizer_state"]["state"][0]["exp_avg"].numel() == sum(
        torch.Size(s).numel() for s in shapes.values())


# ---------------------------------------------------------------- the metadata checks
def _meta(shapes=None, autoep=None, flag=False):
    return {PARAM_SHAPES: {"w": (2, 2)} if shapes is None else shapes, AUTOEP_LAYERS_KEY: autoep,
            "ds_config": {"use_data_before_expert_parallelism": flag}}


def test_aggregate_metadata_checks_each_file():
    layer = {"expert_key_prefix": "layers.0.moe", "num_experts": 4, "num_local_experts": 2, "ep_size": 2}
    shapes, autoep, flag = _aggregate_autoep_zero12_metadata([("a", _meta(autoep=[layer])),
                                                              ("b", _meta(autoep=[dict(layer)], shapes={"v": (3,)}))])
    assert shapes == [{"w": (2, 2)}, {"v": (3,)}] and autoep == [layer] and flag is False
    bad = [
        ([("a", _meta(shapes="list"))], "param_shapes must contain dictionaries in a"),
        ([("a", _meta(autoep=["x"]))], "AutoEP layer metadata must contain dictionaries in a"),
        ([("a", _meta(autoep=[{"expert_key_prefix": ""}]))], "expert_key_prefix must be a non-empty string in a"),
        ([("a", _meta(autoep=[layer])), ("b", _meta(autoep=[dict(layer, ep_size=4)]))],
         "Conflicting AutoEP metadata for expert_key_prefix 'layers.0.moe' in a and b"),
        ([("a", _meta(flag=True)), ("b", _meta())], "use_data_before_expert_parallelism disagrees"),
        ([("a", _meta(flag="str"))], "use_data_before_expert_parallelism must be a boolean in a"),
        ([("a", dict(_meta(), ds_config="DeepSpeedConfig"))], "ds_config must be a dictionary in a"),
    ]
    for metadata, message in bad:
        with pytest.raises(RuntimeError, match=message):
            _aggregate_autoep_zero12_metadata(metadata)


def test_checkpoint_parallel_metadata_reads_the_mpu_as_deepspeed_does():
    megatron = SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 4, get_model_parallel_world_size=lambda: 8,
                               get_pipeline_model_parallel_world_size=lambda: 3)
    grid = SimpleNamespace(get_pipe_parallel_world_size=lambda: 2, get_slice_parallel_world_size=lambda: 1,
                           get_model_parallel_world_size=lambda: 2)
    legacy = SimpleNamespace(get_model_parallel_world_size=lambda: 2)
    dims = [_checkpoint_parallel_metadata(m)[CHECKPOINT_PARALLEL_DIMS] for m in (megatron, grid, legacy, None)]
    assert dims == [{"pp_degree": 3, "tp_degree": 4}, {"pp_degree": 2, "tp_degree": 1},
                    {"pp_degree": 1, "tp_degree": 2}, {"pp_degree": 1, "tp_degree": 1}]
    with pytest.raises(AttributeError, match="get_tensor_model_parallel_world_size"):
        _checkpoint_parallel_metadata(SimpleNamespace())
    with pytest.raises(ImportError, match="not available in this version.*already universal"):
        from deepspeed.checkpoint.ds_to_universal import main  # noqa: F401


# ---------------------------------------------------------------- checkpoints this package wrote
def _cfg(stage, **kw):
    return dict({"train_batch_size": 4, "steps_per_print": 0, "zero_optimization": {"stage": stage},
                 "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}}}, **kw)


def _save_zero2_and_pipeline(rank, world, out):
    import deepspeed
    from deepspeed.pipe import PipelineModule
    eng, *_ = deepspeed.initialize(model=make_model(hidden=12), config=_cfg(2))
    for x, y in global_batches(2, 4):
        eng.backward(eng(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        eng.step()
    eng.save_checkpoint(os.path.join(out, "zero2"), tag="t")
    res = {"zero2": {n: p.detach().clone() for n, p in eng.module.named_parameters()}}

    torch.manual_seed(0)
    pipe = PipelineModule([nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)], num_stages=2,
                          loss_fn=nn.functional.mse_loss, partition_method="uniform")
    pe, *_ = deepspeed.initialize(model=pipe, model_parameters=pipe.parameters(),
                                  config=_cfg(0, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2))
    for x, y in global_batches(2, 4):
        pe.train_batch(iter([(x[:2], y[:2]), (x[2:], y[2:])]))
    pe.save_checkpoint(os.path.join(out, "pipe"), tag="t")
    res["pipe"] = {n: p.detach().clone() for n, p in pe.module.named_parameters()}
    return res


def _one_fragment_each(state):
    """{name: fp32 tensor in the parameter's shape}, checking each parameter is one whole fragment."""
    out = {}
    for name, entry in state["optimizer_state_dict"]["params"].items():
        (frag,) = entry["fragments"]
        numel = torch.Size(entry["shape"]).numel()
        assert (frag["offset"], frag["numel"]) == (0, numel), name
        out[name] = frag
    return out


def test_own_checkpoints_merge_onto_one_rank(tmp_path):
    import deepspeed
    out = str(tmp_path)
    r0, r1 = run_distributed(_save_zero2_and_pipeline, 2, args=(out,), timeout=300)

    # ZeRO-2 over 2 data-parallel ranks -> one rank: every parameter whole again
    tag = os.path.join(out, "zero2", "t")
    ck = DeepSpeedCheckpoint(tag, dp_degree=1)
    assert (ck.original_pp_degree, ck.original_tp_degree, ck.original_dp_degree) == (1, 1, 2)
    assert ck.model_state_metadata[0][1][CHECKPOINT_PARALLEL_DIMS] == {"pp_degree": 1, "tp_degree": 1}
    shapes, autoep, _ = _aggregate_autoep_zero12_metadata(ck.model_state_metadata)
    assert shapes == [{n: p.shape for n, p in r0["zero2"].items()}] and autoep is None
    per_rank = [ZeROCheckpoint(tag).get_state_for_rank(0, 0, d) for d in range(2)]
    owned = [{n for n, e in s["optimizer_state_dict"]["params"].items() if e["fragments"]} for s in per_rank]
    assert owned[0] and owned[1]                                # a real partition: both ranks hold elements
    merged = ck.get_zero_checkpoint_state(0, 0, 0)
    rs = merged["optimizer_state_dict"]
    assert (rs["dp_world_size"], rs["dp_rank"], rs["partition_count"]) == (1, 0, [1])
    frags = _one_fragment_each(merged)
    assert set(frags) == set(r0["zero2"])
    for n, p in r0["zero2"].items():   # fp32 masters = the trained weights (fp32 training)
        torch.testing.assert_close(frags[n]["fp32"].view(p.shape), p, rtol=0, atol=0)
    # Adam's moments as a fresh engine reads them back from the same files
    fresh, *_ = deepspeed.initialize(model=make_model(hidden=12), config=_cfg(1))
    fresh.load_checkpoint(os.path.join(out, "zero2"), tag="t")
    from deepspeed.utils import safe_get_full_optimizer_state
    for n, p in fresh.module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(frags[n]["state"][key].view(p.shape), safe_get_full_optimizer_state(p, key),
                                       rtol=0, atol=0)
    fresh.destroy()

    # 2-stage pipeline (this package's layout: one mp_rank file, pipe_stage_SS- optimizer files) -> 1 stage
    tag = os.path.join(out, "pipe", "t")
    desc = get_model_3d_descriptor(tag)
    assert (desc.pp_degree, desc.tp_degree, desc.dp_degree) == (2, 1, 1)
    ck = DeepSpeedCheckpoint(tag)
    assert [os.path.basename(f) for f in ck.get_zero_files(1, 0, 0)] == [
        "pipe_stage_01-zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert ck.get_2d_parallel_files(tp_index=0, pp_index=1) == ck.mp_rank_files
    zc = ZeROCheckpoint(tag)
    zc.reshape(model_3d_desc(1, 1, 1))
    frags = _one_fragment_each(zc.get_state_for_rank(0, 0, 0))
    trained = {**r0["pipe"], **r1["pipe"]}      # each rank holds its stage's layers
    assert len(trained) == 6 and set(frags) == set(trained)
    for n, p in trained.items():
        torch.testing.assert_close(frags[n]["fp32"].view(p.shape), p, rtol=0, atol=0)


def test_tensor_parallel_slices_are_not_merged(tmp_path):
    from deepspeed.runtime.checkpoint.universal import make_rank_state, optim_file_name
    for mp in range(2):
        rs = make_rank_state(zero_stage=1, dp_world_size=1, dp_rank=0, mp_rank=mp, dtype=torch.float32,
                             params={"w": {"shape": [4], "fragments": [{"offset": 0, "numel": 4,
                                                                         "fp32": torch.full((4,), float(mp))}]}},
                             param_groups=[{"params": ["w"], "lr": 0.1}], group_state=[{}], optimizer_class="AdamW",
                             loss_scaler=None)
        torch.save({"optimizer_state_dict": rs}, tmp_path / optim_file_name(0, mp))
    zc = ZeROCheckpoint(str(tmp_path), source_3d=model_3d_desc(1, 2, 1))
    assert torch.equal(zc.get_state_for_rank(0, 1, 0)["optimizer_state_dict"]["params"]["w"]["fragments"][0]["fp32"],
                       torch.ones(4))
    zc.reshape(model_3d_desc(1, 1, 1))
    with pytest.raises(ValueError, match="fragments of 'w' overlap.*tensor-parallel"):
        zc.get_state_for_rank(0, 0, 0)
    with pytest.raises(ValueError, match="holds 2 ZeRO optimizer files, but its shape .* needs 4"):
        ZeROCheckpoint(str(tmp_path), source_3d=model_3d_desc(1, 2, 2))
