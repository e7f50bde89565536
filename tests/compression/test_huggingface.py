"""DeepSpeed's compression recipe on a real Hugging Face BERT (tiny config): the tutorial's
patterns match Transformers' module names, training runs through the engine, and the cleaned
model (heads and FFN rows physically removed) computes what the masked model computed."""
import torch

import deepspeed
from deepspeed.compression.compress import init_compression, redundancy_clean


def test_hf_bert_head_and_row_pruning_clean_to_the_same_outputs():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    ds = {"train_batch_size": 8, "steps_per_print": 0, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "compression_training": {
              "weight_quantization": {
                  "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 1},
                  "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8},
                                               "modules": ["attention.self", "intermediate", "word_embeddings"]}}},
              "row_pruning": {
                  "shared_parameters": {"enabled": True, "schedule_offset": 2, "method": "topk"},
                  "different_groups": {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["intermediate.dense"],
                                               "related_modules": [["layer.\\w+.output.dense"]]}}},
              "head_pruning": {
                  "shared_parameters": {"enabled": True, "schedule_offset": 2, "method": "topk", "num_heads": 4},
                  "different_groups": {"hp1": {"params": {"dense_ratio": 0.5}, "modules": ["attention.output.dense"],
                                               "related_modules": [["self.query", "self.key", "self.value"]]}}}}}
    model = init_compression(model, ds)
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 64, (8, 12), generator=g)
        out = engine(input_ids=ids, labels=(ids[:, 0] < 32).long())
        engine.backward(out.loss)
        engine.step()
        assert torch.isfinite(out.loss)
    layer = engine.module.bert.encoder.layer[0]
    assert layer.attention.output.dense.head_pruning_enabled and layer.intermediate.dense.row_pruning_enabled
    engine.eval()
    ids = torch.randint(0, 64, (4, 12), generator=g)
    masked = engine(input_ids=ids).logits.detach()
    model = redundancy_clean(engine.module, ds)
    assert layer.attention.self.query.weight.shape == (16, 32) and layer.attention.output.dense.weight.shape == (32, 16)
    assert layer.intermediate.dense.weight.shape == (32, 32) and layer.output.dense.weight.shape == (32, 32)
    torch.testing.assert_close(model(input_ids=ids).logits, masked, rtol=1e-5, atol=1e-6)
