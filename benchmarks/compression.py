"""Compression, each technique on the same small BERT-like classifier, in one run.

For every technique: fine-tune from the same pretrained weights through
``deepspeed.initialize`` with ``compression_training`` on, evaluate loss and accuracy on
held-out batches, ``redundancy_clean`` it, and report parameters and saved-file size
before/after, the forward time of the cleaned model against the original dense model,
and whether the cleaned model's outputs equal the masked model's. Layer reduction is
distilled from the fine-tuned dense model (the tutorial's recipe: student initialised
from teacher layers, loss = cross-entropy + KL to the teacher's logits).

Prints one JSON object. Usage: ``python benchmarks/compression.py [--steps 60]``.
Note: quantization bakes values onto a 2**bits grid but keeps fp32 storage, so the file
does not shrink; ``quantized_payload_bytes`` is what the weights would take at that many
bits (distinct values per group are checked).
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
from deepspeed.utils.logging import logger  # noqa: E402
from deepspeed.compression import init_compression, redundancy_clean  # noqa: E402

V, H, HEADS, INTER, SEQ, CLASSES = 64, 64, 8, 256, 16, 4


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = H // HEADS
        self.query, self.key, self.value = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, y.size(-1) // self.head_dim, self.head_dim).transpose(1, 2)  # noqa: E731
        out = nn.functional.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                                         split(self.value(x)))
        return out.transpose(1, 2).reshape(b, t, -1)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = SelfAttention()
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(H, H)
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(H, INTER)
        self.output = nn.Module()
        self.output.dense = nn.Linear(INTER, H)

    def forward(self, x):
        x = self.ln1(x + self.attention.output.dense(self.attention.self(x)))
        return self.ln2(x + self.output.dense(torch.relu(self.intermediate.dense(x))))


class Bert(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.embeddings = nn.Embedding(V, H)
        self.position = nn.Parameter(torch.randn(SEQ, H) * 0.02)
        self.layer = nn.ModuleList([Layer() for _ in range(layers)])
        self.classifier = nn.Linear(H, CLASSES)

    def forward(self, ids):
        x = self.embeddings(ids) + self.position
        for layer in self.layer:
            x = layer(x)
        return self.classifier(x.mean(dim=1))


def batches(n, batch=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (batch, SEQ), generator=g)
        # the class: which quarter of the vocabulary the most frequent of the first 4 tokens' sum falls in
        y = (ids[:, :4].sum(1) * CLASSES // (4 * V)).clamp(max=CLASSES - 1)
        out.append((ids, y))
    return out


def evaluate(model, data):
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x) for x, _ in data])
        y = torch.cat([y for _, y in data])
    return {"loss": round(nn.functional.cross_entropy(logits, y).item(), 4),
            "accuracy": round((logits.argmax(1) == y).float().mean().item(), 4)}


def file_bytes(model):
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.tell()


def forward_ms_pair(a, b, x, reps=30):
    """Median forward times of ``a`` and ``b``, measured alternately (shared-machine noise hits both)."""
    a.eval(), b.eval()
    ta, tb = [], []
    with torch.no_grad():
        for _ in range(3):
            a(x), b(x)
        for _ in range(reps):
            for m, ts in ((a, ta), (b, tb)):
                t = time.perf_counter()
                m(x)
                ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ta), statistics.median(tb)


def group(params, modules, related=None):
    g = {"params": params, "modules": modules}
    if related:
        g["related_modules"] = related
    return {"g1": g}


TECHNIQUES = {
    "weight_quantization_4bit": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": 8},
        "different_groups": group({"start_bits": 8, "target_bits": 4, "quantization_period": 4},
                                  ["attention.self", "attention.output", "intermediate", "layer.\\d+.output"])}},
    "activation_quantization_8bit": {"activation_quantization": {
        "shared_parameters": {"enabled": True, "range_calibration": "static"},
        "different_groups": group({"bits": 8}, ["attention.self", "intermediate", "layer.\\d+.output"])}},
    "sparse_l1_50": {"sparse_pruning": {
        "shared_parameters": {"enabled": True, "method": "l1"},
        "different_groups": group({"dense_ratio": 0.5}, ["attention.self", "intermediate", "layer.\\d+.output"])}},
    "sparse_snip_momentum_4x1_50": {"sparse_pruning": {
        "shared_parameters": {"enabled": True, "method": "snip_momentum", "block_pattern": "4x1", "dense_ratio": 0.5,
                              "schedule_offset": 5, "schedule_offset_end": 30, "schedule_offset_stride": 5,
                              "excluded_modules": ["classifier"]}, "different_groups": {}}},
    "row_pruning_50": {"row_pruning": {
        "shared_parameters": {"enabled": True, "method": "topk"},
        "different_groups": group({"dense_ratio": 0.5}, ["intermediate.dense"], [["layer.\\d+.output.dense"]])}},
    "head_pruning_50": {"head_pruning": {
        "shared_parameters": {"enabled": True, "num_heads": HEADS},
        "different_groups": group({"dense_ratio": 0.5}, ["attention.output.dense"],
                                  [["self.query", "self.key", "self.value"]])}},
}


def train(model, compression, data, teacher=None, lr=2e-3):
    cfg = {"train_batch_size": 32, "steps_per_print": 0, "optimizer": {"type": "Adam", "params": {"lr": lr}}}
    if compression:
        cfg["compression_training"] = compression
        init_compression(model, cfg, teacher_model=teacher)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    for x, y in data:
        logits = engine(x)
        loss = nn.functional.cross_entropy(logits, y)
        if teacher is not None:  # knowledge distillation (the tutorial's recipe)
            with torch.no_grad():
                t_logits = teacher(x)
            loss = loss + nn.functional.kl_div(logits.log_softmax(-1), t_logits.log_softmax(-1), log_target=True,
                                               reduction="batchmean")
        engine.backward(loss)
        engine.step()
    return engine.module, cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pretrain-steps", type=int, default=80)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    logger.setLevel("WARNING")  # stdout carries only the JSON
    torch.manual_seed(0)
    pre, tune, held = batches(args.pretrain_steps, seed=1), batches(args.steps, seed=2), batches(8, seed=3)
    pretrained, _ = train(Bert(), None, pre, lr=2e-3)
    x_time = torch.cat([held[0][0], held[1][0]])
    dense, _ = train(copy.deepcopy(pretrained), None, tune)
    result = {"model": {"layers": 4, "hidden": H, "heads": HEADS, "intermediate": INTER, "seq": SEQ, "batch": 32},
              "pretrain_steps": args.pretrain_steps, "finetune_steps": args.steps,
              "threads": torch.get_num_threads(),
              "dense": {**evaluate(dense, held), "params": sum(p.numel() for p in dense.parameters()),
                        "file_bytes": file_bytes(dense)},
              "techniques": {}}
    runs = dict(TECHNIQUES)
    runs["layer_reduction_4to2_kd"] = {"layer_reduction": {
        "enabled": True, "keep_number_layer": 2, "module_name_prefix": "layer", "teacher_layer": [1, 3],
        "other_module_name": ["embeddings", "classifier"]}}
    for name, comp in runs.items():
        print(f"[compression benchmark] {name}", file=sys.stderr, flush=True)
        torch.manual_seed(0)
        if name.startswith("layer_reduction"):
            model = Bert(layers=2)
            with torch.no_grad():
                model.position.copy_(dense.position)
            model, cfg = train(model, comp, tune, teacher=dense.eval())
        else:
            model, cfg = train(copy.deepcopy(pretrained), comp, tune)
        masked_eval = evaluate(model, held)
        with torch.no_grad():
            masked_out = model(held[1][0])
        before = {"params": sum(p.numel() for p in model.parameters()), "file_bytes": file_bytes(model)}
        redundancy_clean(model, cfg)
        with torch.no_grad():
            equal = torch.allclose(model(held[1][0]), masked_out, rtol=1e-4, atol=1e-5)
        entry = {**masked_eval, "params_before_clean": before["params"], "file_bytes_before_clean": before["file_bytes"],
                 "params_after_clean": sum(p.numel() for p in model.parameters()),
                 "file_bytes_after_clean": file_bytes(model), "cleaned_equals_masked": bool(equal)}
        t_dense, t_clean = forward_ms_pair(dense, model, x_time)
        entry.update(forward_ms_dense=round(t_dense, 3), forward_ms_cleaned=round(t_clean, 3),
                     forward_ratio_vs_dense=round(t_clean / t_dense, 3))
        entry["params_ratio_vs_dense"] = round(entry["params_after_clean"] / result["dense"]["params"], 3)
        if "quantization_4bit" in name:
            payload, bits_seen = 0, set()
            quantized = {id(m.weight): m for m in model.modules() if getattr(m, "weight_quantize_bits", None)}
            for p in model.parameters():
                m = quantized.get(id(p))
                if m is None:
                    payload += p.numel() * 4
                    continue
                bits = m.weight_quantize_bits
                bits_seen.add(bits)
                payload += p.numel() * bits // 8
                groups = p.detach().reshape(m.weight_quantize_num_groups, -1)
                assert all(g.unique().numel() <= 2 ** bits for g in groups)
            entry["quantized_payload_bytes"] = payload
            entry["bits_at_end"] = sorted(bits_seen)
        result["techniques"][name] = entry
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
