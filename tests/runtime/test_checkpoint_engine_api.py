"""deepspeed.runtime.checkpoint_engine: DeepSpeed's engine interface over our atomic,
weights-only checkpoint I/O."""
import os

import pytest
import torch

from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine, TorchCheckpointEngine


class _Opaque:   # an arbitrary object: weights-only loading must refuse it
    pass


def test_torch_checkpoint_engine_roundtrip_atomic_weights_only(tmp_path):
    eng = TorchCheckpointEngine()
    info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True)
    eng.create(info)
    path = os.path.join(tmp_path, "layer_00-model_states.pt")
    eng.save({"w": torch.arange(6.0).view(2, 3), "step": 3}, path)
    assert eng.commit(info) is True and os.listdir(tmp_path) == ["layer_00-model_states.pt"]   # no .part left
    got = eng.load(path)
    assert got["step"] == 3 and torch.equal(got["w"], torch.arange(6.0).view(2, 3))
    bad = os.path.join(tmp_path, "bad.pt")
    torch.save({"x": _Opaque()}, bad)
    with pytest.raises(Exception, match="bad.pt"):
        eng.load(bad)
    with pytest.raises(TypeError):
        CheckpointEngine()   # abstract: save/load must be provided
