"""Compression training through ``deepspeed.initialize``: the engine drives the schedule,
training converges like the uncompressed run, a checkpoint resumes the compression state,
and what cannot run is refused with the reason."""
import pytest
import torch

import deepspeed
from deepspeed.compression import init_compression
from deepspeed.config.errors import DeepSpeedConfigError
from tests.compression.models import BertClassifier, bert_batches

COMPRESSION = {
    "weight_quantization": {"shared_parameters": {"enabled": True, "quantize_weight_in_forward": True,
                                                  "schedule_offset": 2, "quantize_groups": 4},
                            "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 6,
                                                                    "quantization_period": 3},
                                                         "modules": ["attention.self", "intermediate"]}}},
    "activation_quantization": {"shared_parameters": {"enabled": True, "range_calibration": "dynamic",
                                                      "schedule_offset": 4},
                                "different_groups": {"aq1": {"params": {"bits": 8},
                                                             "modules": ["attention.output"]}}},
    "row_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 3, "method": "topk"},
                    "different_groups": {"rp1": {"params": {"dense_ratio": 0.75}, "modules": ["intermediate.dense"],
                                                 "related_modules": [["layer.\\w+.output.dense"]]}}},
    "head_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 5, "num_heads": 4},
                     "different_groups": {"hp1": {"params": {"dense_ratio": 0.75},
                                                  "modules": ["attention.output.dense"],
                                                  "related_modules": [["self.query", "self.key", "self.value"]]}}},
}


def _config(compression=None, **extra):
    cfg = {"train_batch_size": 16, "steps_per_print": 0, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    if compression is not None:
        cfg["compression_training"] = compression
    cfg.update(extra)
    return cfg


def _engine(cfg, compress=True, seed=0):
    torch.manual_seed(seed)
    model = BertClassifier()
    if compress:
        init_compression(model, cfg)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine


def test_training_with_compression_follows_the_schedule_and_converges():
    batches = bert_batches(16)
    cfg = _config(COMPRESSION)
    engine = _engine(cfg)
    row = engine.module.bert.encoder.layer[0].intermediate.dense
    head = engine.module.bert.encoder.layer[1].attention.output.dense
    losses = []
    for step, (x, y) in enumerate(batches):
        loss = engine(x, y)
        # the forward of step s sees the state after s applied optimizer steps
        assert engine.compression_scheduler.training_steps == step
        assert row.row_pruning_enabled == (step >= 3) and head.head_pruning_enabled == (step >= 5)
        assert row.weight_quantize_bits == (8 if step < 2 + 3 else 7 if step < 2 + 6 else 6)  # target 6
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ref = _engine(_config(), compress=False)
    ref_losses = []
    for x, y in batches:
        loss = ref(x, y)
        ref.backward(loss)
        ref.step()
        ref_losses.append(loss.item())
    first, last = sum(losses[:3]) / 3, sum(losses[-4:]) / 4
    ref_last = sum(ref_losses[-4:]) / 4
    assert last < first - 0.1, losses  # it learns
    assert abs(last - ref_last) < 0.15, (losses, ref_losses)  # and stays near the uncompressed run
    # the row and head masks keep what dense_ratio says
    assert int(row.get_mask("row").sum()) == 24 and int(head.get_mask("head").sum()) == 3


@pytest.mark.parametrize("stage", [1])
def test_checkpoint_resume_restores_the_compression_state(tmp_path, stage):
    comp = {
        "weight_quantization": {"shared_parameters": {"enabled": True, "schedule_offset": 1,
                                                      "quantize_weight_in_forward": False},
                                "different_groups": {"wq": {"params": {"start_bits": 6, "target_bits": 4,
                                                                       "quantization_period": 2},
                                                            "modules": ["intermediate.dense"]}}},
        "sparse_pruning": {"shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 2},
                           "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["self.query"]}}},
        "activation_quantization": {"shared_parameters": {"enabled": True, "range_calibration": "static"},
                                    "different_groups": {"aq": {"params": {"bits": 8}, "modules": ["classifier"]}}},
    }
    cfg = _config(comp, zero_optimization={"stage": stage})
    batches = bert_batches(7, seed=2)

    def run(engine, bs):
        for x, y in bs:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()

    a = _engine(cfg)
    run(a, batches[:4])
    a.save_checkpoint(str(tmp_path), tag="t4")
    run(a, batches[4:])
    b = _engine(cfg, seed=123)  # other initial weights and scores: everything must come from the checkpoint
    b.load_checkpoint(str(tmp_path), tag="t4")
    run(b, batches[4:])
    assert b.compression_scheduler.training_steps == a.compression_scheduler.training_steps == 7
    for (n, p), q in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    x, _ = batches[0]
    a.eval(), b.eval()
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    # quantization in the optimizer step: the forward saw weights on a 2**bits grid
    wq = b.module.bert.encoder.layer[0].intermediate.dense
    assert wq.weight_quantize_bits == 4 and wq.weight.detach().unique().numel() <= 16


def test_refusals_name_the_cause():
    wq_moq = {"weight_quantization": {"shared_parameters": {"enabled": True, "quantize_weight_in_forward": False},
                                      "different_groups": {"g": {"modules": ["classifier"]}}}}
    with pytest.raises(DeepSpeedConfigError, match="quantize_weight_in_forward"):
        _engine(_config(wq_moq))  # fp32, stage 0
    with pytest.raises(DeepSpeedConfigError, match="stage 3"):
        _engine(_config(COMPRESSION, zero_optimization={"stage": 3}))
    bad = {"row_pruning": {"shared_parameters": {"enabled": True},
                           "different_groups": {"rp": {"modules": ["no_such_module"]}}}}
    with pytest.raises(ValueError, match="'no_such_module' matches no Linear"):
        init_compression(BertClassifier(), _config(bad))
    # a pattern naming modules the technique does not apply to (here LayerNorms) is skipped, as in
    # DeepSpeed, whose configs list patterns for several model families
    partly = {"row_pruning": {"shared_parameters": {"enabled": True},
                              "different_groups": {"rp": {"modules": ["LayerNorm", "intermediate.dense"]}}}}
    model = init_compression(BertClassifier(), _config(partly))
    assert model.bert.encoder.layer[1].intermediate.dense.row_pruning_method == "l1"
    wrong_pairing = {"row_pruning": {"shared_parameters": {"enabled": True},
                                     "different_groups": {"rp": {"modules": ["intermediate.dense"],
                                                                 "related_modules": [["classifier"]]}}}}
    with pytest.raises(ValueError, match="matches 1 modules .* but module pattern 'intermediate.dense' matches 2"):
        init_compression(BertClassifier(), _config(wrong_pairing))
    wrong_shape = {"row_pruning": {"shared_parameters": {"enabled": True},
                                   "different_groups": {"rp": {"modules": ["a", "b"], "related_modules": [["c"]]}}}}
    with pytest.raises(DeepSpeedConfigError, match="related_modules has 1 entries but modules has 2"):
        deepspeed.initialize(model=BertClassifier(), config=_config(wrong_shape))
