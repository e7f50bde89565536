"""``redundancy_clean``: the cleaned model computes what the masked model computed, with
the pruned rows / heads / channels physically gone."""
import pytest
import torch

from deepspeed.compression import compression_scheduler, init_compression, redundancy_clean
from tests.compression.models import HIDDEN, INTER, BertClassifier, SmallCNN, bert_batches, param_count


def _activate(model, cfg, steps=1):
    sched = compression_scheduler(model, cfg)
    sched.step(step_zero_check=True)
    for _ in range(steps):
        sched.step()
    return sched


def _scramble_scores(model):
    # topk scores start random; make them decisive and distinct so the masks are not ties
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "scores" in n:
                p.copy_(torch.randn(p.shape, generator=g))


def test_bert_row_and_head_pruning_shrink_and_keep_outputs():
    torch.manual_seed(0)
    cfg = {"compression_training": {
        "row_pruning": {"shared_parameters": {"enabled": True, "method": "topk"},
                        "different_groups": {"rp1": {"params": {"dense_ratio": 0.5},
                                                     "modules": ["intermediate.dense"],
                                                     "related_modules": [["layer.\\w+.output.dense"]]}}},
        "head_pruning": {"shared_parameters": {"enabled": True, "method": "topk", "num_heads": 4},
                         "different_groups": {"hp1": {"params": {"dense_ratio": 0.5},
                                                      "modules": ["attention.output.dense"],
                                                      "related_modules": [["self.query", "self.key", "self.value"]]}}},
        "weight_quantization": {"shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
                                "different_groups": {"wq": {"params": {"start_bits": 4, "target_bits": 4},
                                                            "modules": ["classifier", "word_embeddings"]}}}}}
    model = BertClassifier().eval()
    init_compression(model, cfg)
    _scramble_scores(model)
    _activate(model, cfg)
    x, _ = bert_batches(1, seed=3)[0]
    masked = model(x).detach()
    before = param_count(model)
    layer0 = model.bert.encoder.layer[0]
    kept_heads = layer0.attention.output.dense.get_mask("head").detach().view(-1).bool()
    q_before = layer0.attention.self.query.weight.detach().clone().view(4, -1, HIDDEN)
    o_before = layer0.attention.output.dense.weight.detach().clone().view(HIDDEN, 4, -1)
    redundancy_clean(model, cfg)
    torch.testing.assert_close(model(x), masked, rtol=1e-5, atol=1e-6)
    for layer in model.bert.encoder.layer:
        assert layer.intermediate.dense.weight.shape == (INTER // 2, HIDDEN)
        assert layer.output.dense.weight.shape == (HIDDEN, INTER // 2)
        for proj in (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value):
            assert proj.weight.shape == (HIDDEN // 2, HIDDEN) and proj.bias.shape == (HIDDEN // 2,)
        assert layer.attention.output.dense.weight.shape == (HIDDEN, HIDDEN // 2)
        assert not any("scores" in n or "mask" in n for n, _ in layer.named_parameters())
    # whole heads: Q keeps exactly the kept heads' rows, the output matrix their columns
    torch.testing.assert_close(layer0.attention.self.query.weight, q_before[kept_heads].reshape(-1, HIDDEN))
    torch.testing.assert_close(layer0.attention.output.dense.weight,
                               o_before[:, kept_heads].reshape(HIDDEN, -1))
    # removed per layer: half the intermediate rows (+bias) and output columns, half of Q/K/V (+bias)
    # and of the output matrix's columns; minus the scores (row: INTER, head: 4) that are gone too
    per_layer = (INTER // 2) * HIDDEN * 2 + INTER // 2 + 3 * (HIDDEN // 2 * HIDDEN + HIDDEN // 2) \
        + HIDDEN * HIDDEN // 2 + INTER + 4
    assert before - param_count(model) == 2 * per_layer
    # quantization baked: the classifier's weight holds at most 2**4 values
    assert model.classifier.weight.unique().numel() <= 16


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_cnn_channel_pruning_with_batch_norm(method):
    torch.manual_seed(0)
    cfg = {"compression_training": {"channel_pruning": {
        "shared_parameters": {"enabled": True, "method": method},
        "different_groups": {"cp1": {"params": {"dense_ratio": 0.5}, "modules": ["conv1"],
                                     "related_modules": [["conv2", "bn1"]]}}}}}
    model = SmallCNN()
    init_compression(model, cfg)
    _activate(model, cfg)
    model.train()
    for _ in range(2):  # batch statistics move the running averages
        model(torch.randn(4, 3, 5, 5))
    model.eval()
    x = torch.randn(2, 3, 5, 5)
    masked = model(x).detach()
    redundancy_clean(model, cfg)
    assert model.conv1.weight.shape == (4, 3, 3, 3) and model.conv1.bias.shape == (4,)
    assert model.bn1.weight.shape == (4,) and model.bn1.running_mean.shape == (4,)
    assert model.conv2.weight.shape == (6, 4, 3, 3)
    torch.testing.assert_close(model(x), masked, rtol=1e-5, atol=1e-6)


def test_sparse_pruning_and_row_pruning_without_related_modules_zero_in_place():
    torch.manual_seed(0)
    cfg = {"compression_training": {
        "sparse_pruning": {"shared_parameters": {"enabled": True, "method": "l1"},
                           "different_groups": {"sp": {"params": {"dense_ratio": 0.3}, "modules": ["self.query"]}}},
        "row_pruning": {"shared_parameters": {"enabled": True, "method": "l1"},
                        "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["classifier"]}}}}}
    model = BertClassifier().eval()
    init_compression(model, cfg)
    _activate(model, cfg)
    x, _ = bert_batches(1, seed=4)[0]
    masked = model(x).detach()
    redundancy_clean(model, cfg)
    torch.testing.assert_close(model(x), masked)
    q = model.bert.encoder.layer[0].attention.self.query.weight
    assert q.shape == (HIDDEN, HIDDEN) and int((q != 0).sum()) == round(0.3 * HIDDEN * HIDDEN + 0.5)
    assert model.classifier.weight.shape == (2, HIDDEN) and int((model.classifier.weight != 0).any(1).sum()) == 1
