"""Each pruning method's mask against a hand-computed one, and the schedule that switches
techniques on."""
import pytest
import torch

from deepspeed.compression import compression_scheduler, init_compression
from deepspeed.compression.basic_layer import Conv2dLayer_Compress, LinearLayer_Compress
from deepspeed.compression.utils import TopKBinarizer, block_mask, cubic_sparsity
from tests.compression.models import BertClassifier, bert_batches


def _linear(weight):
    layer = LinearLayer_Compress(weight.size(1), weight.size(0))
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.fill_(1.0)
    return layer


W = torch.tensor([[0.1, -0.9, 0.3, 0.0],
                  [-0.5, 0.2, 0.05, 0.8],
                  [0.0, 0.0, 0.01, -0.02],
                  [1.0, 0.4, -0.6, 0.7]])


def test_sparse_l1_mask_keeps_largest_magnitudes():
    layer = _linear(W)
    layer.enable_sparse_pruning(0.25, "l1")  # keep ceil(0.25 * 16) = 4: |1.0|, |-0.9|, |0.8|, |0.7|
    expected = torch.zeros(4, 4)
    expected[0, 1] = expected[1, 3] = expected[3, 0] = expected[3, 3] = 1
    torch.testing.assert_close(layer.sparse_pruning_mask, expected)
    layer.sparse_pruning_enabled = True
    x = torch.randn(3, 4)
    torch.testing.assert_close(layer(x), x @ (W * expected).t() + 1.0)


def test_row_l1_mask_uses_row_norms():
    layer = _linear(W)
    # L1 row norms: 1.3, 1.55, 0.03, 2.7 -> keep rows 3 and 1
    layer.enable_row_pruning(0.5, "l1")
    torch.testing.assert_close(layer.row_pruning_mask.view(-1), torch.tensor([0.0, 1.0, 0.0, 1.0]))
    layer.row_pruning_enabled = True
    out = layer(torch.randn(2, 4))
    assert torch.all(out[:, [0, 2]] == 0)  # pruned rows lose weight and bias


def test_channel_l1_mask_uses_kernel_norms():
    conv = Conv2dLayer_Compress(1, 3, 2)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([1.0, -2.0, 0.5]).view(3, 1, 1, 1) * torch.ones(3, 1, 2, 2))
    conv.enable_channel_pruning(0.34, "l1")  # keep ceil(0.34 * 3) = 2: channels 1 (8.0) and 0 (4.0)
    torch.testing.assert_close(conv.channel_pruning_mask.view(-1), torch.tensor([1.0, 1.0, 0.0]))


def test_topk_binarizer_and_its_straight_through_gradient():
    scores = torch.tensor([[0.3, -1.0], [2.0, 0.1]], requires_grad=True)
    mask = TopKBinarizer.apply(scores, 0.5, False)
    torch.testing.assert_close(mask, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    g = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    (mask * g).sum().backward()
    torch.testing.assert_close(scores.grad, g)
    # topk scores are parameters the optimizer trains: the forward's mask follows them
    layer = _linear(W)
    layer.enable_sparse_pruning(0.5, "topk")
    assert isinstance(layer.sparse_mask_scores, torch.nn.Parameter)
    layer.sparse_pruning_enabled = True
    layer(torch.randn(2, 4)).sum().backward()
    assert layer.sparse_mask_scores.grad is not None and layer.sparse_mask_scores.grad.abs().sum() > 0


def test_n_in_m_pattern_prunes_n_lowest_of_every_m():
    scores = torch.tensor([[4.0, 1.0, 3.0, 2.0, 0.5, 0.6, 0.7, 0.8],
                           [1.0, 2.0, 3.0, 4.0, 9.0, 1.0, 1.5, 8.0]])
    expected = torch.tensor([[1.0, 0, 1, 0, 0, 0, 1, 1],
                             [0.0, 0, 1, 1, 1, 0, 0, 1]])
    torch.testing.assert_close(block_mask(scores, "2:4", 0.1), expected)


def test_nxm_pattern_keeps_whole_blocks():
    # 4x1 blocks on a 4x3 matrix: one block per column, scored by the column sum
    scores = torch.tensor([[1.0, 0.0, 5.0], [1.0, 0.0, 0.0], [1.0, 9.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(block_mask(scores, "4x1", 0.34),  # keep ceil(0.34 * 3) = 2 blocks: cols 1, 2
                               torch.tensor([[0.0, 1, 1]] * 4))
    # 2x2 blocks on 4x4: sums 1, 20, 3, 7 -> keep the two best
    s = torch.zeros(4, 4)
    s[0, 0] = 1
    s[0, 2] = 20
    s[2, 1] = 3
    s[3, 3] = 7
    m = block_mask(s, "2x2", 0.5)
    expected = torch.zeros(4, 4)
    expected[0:2, 2:4] = 1
    expected[2:4, 2:4] = 1
    torch.testing.assert_close(m, expected)


def test_head_mask_prunes_whole_heads_of_the_output_matrix():
    layer = LinearLayer_Compress(8, 3)
    layer.enable_head_pruning(0.5, "topk", 4)
    with torch.no_grad():
        layer.head_pruning_scores.copy_(torch.tensor([[0.1, 5.0, -1.0, 2.0]]))  # keep heads 1 and 3
    layer.head_pruning_enabled = True
    w = layer.compressed_weight_bias()[0]
    assert torch.all(w[:, 0:2] == 0) and torch.all(w[:, 4:6] == 0)
    torch.testing.assert_close(w[:, 2:4], layer.weight[:, 2:4])
    torch.testing.assert_close(w[:, 6:8], layer.weight[:, 6:8])


def _bert_cfg(**techniques):
    return {"compression_training": techniques}


def test_schedule_offsets_switch_techniques_on_at_their_step():
    cfg = _bert_cfg(
        weight_quantization={"shared_parameters": {"enabled": True, "schedule_offset": 1,
                                                   "quantize_weight_in_forward": True},
                             "different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 8},
                                                        "modules": ["intermediate"]}}},
        activation_quantization={"shared_parameters": {"enabled": True, "schedule_offset": 2},
                                 "different_groups": {"g": {"params": {"bits": 8}, "modules": ["output.dense"]}}},
        sparse_pruning={"shared_parameters": {"enabled": True, "schedule_offset": 3, "method": "l1"},
                        "different_groups": {"g": {"params": {"dense_ratio": 0.5}, "modules": ["self.query"]}}},
        row_pruning={"shared_parameters": {"enabled": True, "schedule_offset": 4, "method": "topk"},
                     "different_groups": {"g": {"params": {"dense_ratio": 0.5}, "modules": ["intermediate.dense"]}}},
        head_pruning={"shared_parameters": {"enabled": True, "schedule_offset": 5, "num_heads": 4},
                      "different_groups": {"g": {"params": {"dense_ratio": 0.5},
                                                 "modules": ["attention.output.dense"]}}})
    model = BertClassifier()
    init_compression(model, cfg)
    layer = model.bert.encoder.layer[1]
    probes = [(layer.intermediate.dense, "weight_quantization_enabled", 1),
              (layer.output.dense, "activation_quantization_enabled", 2),
              (layer.attention.self.query, "sparse_pruning_enabled", 3),
              (layer.intermediate.dense, "row_pruning_enabled", 4),
              (layer.attention.output.dense, "head_pruning_enabled", 5)]
    sched = compression_scheduler(model, cfg)
    sched.step(step_zero_check=True)
    for step in range(7):
        assert sched.training_steps == step
        for module, flag, offset in probes:
            assert getattr(module, flag) == (step >= offset), (flag, step)
        sched.step()
    # modules outside every group stay untouched
    assert not layer.attention.self.key.sparse_pruning_enabled and layer.attention.self.key.sparse_pruning_method is None


def test_snip_momentum_reaches_the_sparsity_in_blocks():
    torch.manual_seed(0)
    cfg = _bert_cfg(sparse_pruning={"shared_parameters": {
        "enabled": True, "method": "snip_momentum", "block_pattern": "4x1", "dense_ratio": 0.25,
        "schedule_offset": 2, "schedule_offset_end": 8, "schedule_offset_stride": 2,
        "excluded_modules": ["classifier", "embeddings"]}, "different_groups": {}})
    model = BertClassifier()
    init_compression(model, cfg)
    sched = compression_scheduler(model, cfg)
    sched.step(step_zero_check=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pruned = [m for n, m in model.named_modules() if isinstance(m, LinearLayer_Compress) and
              "classifier" not in n]
    assert model.classifier.sparse_pruning_method is None  # excluded
    density = {}
    for step, (x, y) in enumerate(bert_batches(9), start=1):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        density[step] = sum(float(m.sparse_pruning_mask.sum()) for m in pruned) / sum(m.weight.numel() for m in pruned)
    assert density[1] == 1.0  # before the offset: dense
    # cubic schedule: sparsity 0.75 * (1 - (1 - 2/6)**3) at step 4, the target 0.75 from step 8 on
    assert density[4] == pytest.approx(1 - cubic_sparsity(0.75, 2, 8, 4), abs=0.03)
    assert density[8] == pytest.approx(0.25, abs=0.01) and density[9] == density[8]
    for m in pruned:  # whole 4x1 blocks: 4 consecutive rows of a column share their fate
        blocks = m.sparse_pruning_mask.reshape(m.weight.size(0) // 4, 4, -1)
        assert torch.all(blocks.amin(dim=1) == blocks.amax(dim=1))
