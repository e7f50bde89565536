"""What a checkpoint's files hold, key by key, against DeepSpeed's layout (its
``runtime/engine.py``: ``_common_checkpoint_state``, ``_save_checkpoint``,
``_save_zero_checkpoint``), read the way tools read them (plain ``torch.load``); and the
layout this package wrote before (client state nested, bare fragments) still loading."""
from __future__ import annotations

import logging
import os

import pytest
import torch

import deepspeed
from deepspeed.runtime.checkpoint.contents import DEEPSPEED_MODEL_STATE_KEYS
from deepspeed.utils import zero_to_fp32

# every key DeepSpeed 0.19 writes into a model-states file (num_experts etc. only with MoE)
DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
           "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
           "checkpoint_parallel_dimensions", "ds_config", "ds_version"}


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.mid = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight   # tied: one parameter, two names

    def forward(self, x, y):
        h = self.frozen(torch.tanh(self.mid(self.norm(self.emb(x)))))
        return torch.nn.functional.cross_entropy(self.head(h), y)


def _batches(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 10, (4,), generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(n)]


def _engine(stage):
    model = Tied()
    cfg = {"train_batch_size": 4, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.0}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.05}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    params = [p for p in model.parameters() if p.requires_grad]
    return deepspeed.initialize(model=model, model_parameters=params, config=cfg)[0]


def _train(engine, batches):
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _params(engine):
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_files_hold_deepspeeds_keys_and_the_client_state_at_the_top_level(tmp_path, stage):
    eng = _engine(stage)
    _train(eng, _batches(2))
    client = {"epoch": 3, "global_step": 7, "loops": {"fit": [1, 2]}}
    eng.save_checkpoint(str(tmp_path), tag="t", client_state=client)
    tag = tmp_path / "t"
    model_file = tag / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt")
    ms = torch.load(model_file, weights_only=True)   # what a tool does: a plain weights-only load
    assert DS_KEYS <= set(ms) and DS_KEYS <= DEEPSPEED_MODEL_STATE_KEYS
    assert "client_state" not in ms and {k: ms[k] for k in client} == client
    assert ms["ds_version"] == deepspeed.__version__ and ms["ds_config"]["train_batch_size"] == 4
    assert ms["global_steps"] == 2 and ms["global_samples"] == 8 and ms["skipped_steps"] == 0
    assert ms["dp_world_size"] == 1 and ms["mp_world_size"] == 1
    assert ms["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": 1}
    assert ms["optimizer"] is None                         # under ZeRO and (here) at stage 0: the optim file
    assert ms["lr_scheduler"] == eng.lr_scheduler.state_dict()
    assert ms["buffer_names"] == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    full = {n: p for n, p in Tied().named_parameters()}
    assert sorted(ms["module"]) == sorted(Tied().state_dict())
    if stage == 0:
        assert ms["param_shapes"] is None and ms["shared_params"] is None
    else:   # one group: every trainable parameter by name, with its full shape; the tied name mapped
        assert [list(g) for g in ms["param_shapes"]] == [["emb.weight", "norm.weight", "norm.bias", "mid.weight",
                                                          "mid.bias"]]
        assert all(tuple(s) == tuple(full[n].shape) for n, s in ms["param_shapes"][0].items())
        assert ms["shared_params"] == {"head.weight": "emb.weight"}
    if stage >= 2:   # frozen parameters: shapes, and (stage 3: this rank's partition) their values
        assert {n: tuple(s) for n, s in ms["frozen_param_shapes"].items()} == {"frozen.weight": (6, 6),
                                                                               "frozen.bias": (6,)}
        assert set(ms["frozen_param_fragments"]) == {"frozen.weight", "frozen.bias"}
    else:
        assert ms["frozen_param_shapes"] is None and ms["frozen_param_fragments"] is None
    # the optimizer-states file: DeepSpeed's envelope; Lightning reads optimizer_state_dict.zero_stage
    optim_files = zero_to_fp32.get_optim_files(str(tag))
    osd = torch.load(optim_files[0], weights_only=True)
    assert set(osd) == {"optimizer_state_dict", "ds_config", "ds_version"}
    assert osd["optimizer_state_dict"]["zero_stage"] == stage and osd["ds_version"] == deepspeed.__version__
    assert osd["optimizer_state_dict"]["partition_count"] == (1 if stage in (0, 3) else [1])
    assert zero_to_fp32.get_model_state_file(str(tag), stage) == str(model_file)
    # load_checkpoint hands back exactly the client state
    eng2 = _engine(stage)
    _, got = eng2.load_checkpoint(str(tmp_path), tag="t")
    assert got == client
    eng.destroy()
    eng2.destroy()


def _to_previous_layout(tag_dir):
    """Rewrite a tag directory as this package wrote it before DeepSpeed's contents (client state
    nested under ``client_state``, only its own keys; optimizer files the bare fragments)."""
    old_keys = ("module", "lr_scheduler", "global_steps", "global_samples", "micro_steps", "skipped_steps",
                "dp_world_size", "mp_world_size", "ds_config", "ds_version")
    for name in os.listdir(tag_dir):
        path = os.path.join(tag_dir, name)
        if name.endswith("_model_states.pt"):
            ms = torch.load(path, weights_only=True)
            client = {k: v for k, v in ms.items() if k not in DEEPSPEED_MODEL_STATE_KEYS | {"micro_steps"}}
            old = {k: ms[k] for k in old_keys}
            old.update(zero_stage=2, client_state=client)
            torch.save(old, path)
        elif name.endswith("_optim_states.pt"):
            torch.save(torch.load(path, weights_only=True)["optimizer_state_dict"], path)
        elif name.endswith(".json"):   # a checksum manifest would no longer match; old tags had none
            os.remove(path)


def test_checkpoints_in_the_previous_layout_still_load_and_resume(tmp_path):
    batches = _batches(4)
    ref = _engine(2)
    ref_losses = _train(ref, batches)
    ref_params = _params(ref)
    ref.destroy()

    eng = _engine(2)
    _train(eng, batches[:2])
    eng.save_checkpoint(str(tmp_path), tag="t", client_state={"epoch": 5})
    eng.destroy()
    _to_previous_layout(str(tmp_path / "t"))
    assert "client_state" in torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=True)
    for stage in (2, 3):   # resumes exactly, at its own stage and at another
        res = _engine(stage)
        _, client = res.load_checkpoint(str(tmp_path), tag="t")
        assert client == {"epoch": 5}
        assert _train(res, batches[2:]) == pytest.approx(ref_losses[2:], rel=1e-6, abs=1e-7)
        for n, p in _params(res).items():
            torch.testing.assert_close(p, ref_params[n], rtol=1e-6, atol=1e-7, msg=n)
        res.destroy()
    # zero_to_fp32 reads it too
    sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    assert set(sd) >= {"emb.weight", "mid.weight", "norm.running_mean"}


def test_a_client_key_named_like_deepspeeds_wins_with_a_warning(tmp_path, caplog):
    eng = _engine(0)
    _train(eng, _batches(1))
    with caplog.at_level(logging.WARNING):
        eng.save_checkpoint(str(tmp_path), tag="t", client_state={"lr_scheduler": {"mine": 1}, "x": 2})
    assert "['lr_scheduler']" in caplog.text and "replace deepspeed's own" in caplog.text
    ms = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=True)
    assert ms["lr_scheduler"] == {"mine": 1} and ms["x"] == 2   # DeepSpeed: state.update(client_state)
    eng.destroy()


def test_load_adopts_the_checkpoints_sparse_tensor_module_names(tmp_path):
    """DeepSpeed replaces the engine's sparse_tensor_module_names with the saved set on a full
    load (its test_sparse.py::test_non_strict_load_sparse); a module-only load keeps the engine's."""
    def engine(sparse):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 3), torch.nn.Linear(3, 1))
        cfg = {"train_batch_size": 1, "steps_per_print": 0, "sparse_gradients": sparse}
        return deepspeed.initialize(model=model, config=cfg)[0]
    src = engine(True)
    assert src.sparse_tensor_module_names == {"0.weight"}
    src.save_checkpoint(str(tmp_path), tag="t")
    dst = engine(False)
    assert dst.sparse_tensor_module_names == set()
    dst.load_checkpoint(str(tmp_path), tag="t", load_module_only=True)
    assert dst.sparse_tensor_module_names == set()
    dst.load_checkpoint(str(tmp_path), tag="t", load_optimizer_states=False, load_lr_scheduler_states=False)
    assert dst.sparse_tensor_module_names == {"0.weight"}
    # non-strict: a name is kept unless the checkpoint holds that parameter dense, and the
    # checkpoint's sparse names are added where this model has the parameter
    def make(sparse, *extra):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 3), torch.nn.Linear(3, 1), *extra)
        return deepspeed.initialize(model=model, config={"train_batch_size": 1, "steps_per_print": 0,
                                                         "sparse_gradients": sparse})[0]
    adds = make(False)
    adds.load_checkpoint(str(tmp_path), tag="t", load_module_strict=False, load_optimizer_states=False)
    assert adds.sparse_tensor_module_names == {"0.weight"}
    make(False).save_checkpoint(str(tmp_path), tag="dense")
    sparse_dst = make(True, torch.nn.Embedding(4, 3))
    assert sparse_dst.sparse_tensor_module_names == {"0.weight", "2.weight"}
    sparse_dst.load_checkpoint(str(tmp_path), tag="dense", load_module_strict=False, load_optimizer_states=False)
    assert sparse_dst.sparse_tensor_module_names == {"2.weight"}   # 0.weight was dense in the checkpoint
