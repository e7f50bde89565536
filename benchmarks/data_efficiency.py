"""Data efficiency, in one run on one small GPT: baseline vs curriculum seqlen vs random-LTD.

The same initial weights, the same batches in the same order and the same number of
steps for each run, through ``deepspeed.initialize``:

* ``baseline``: every step at the full sequence length;
* ``curriculum_seqlen``: the legacy ``curriculum_learning`` section (``fixed_linear`` from
  ``min`` to the full length over half the steps); the model truncates its batch to the
  ``curriculum_seqlen`` the engine passes;
* ``random_ltd``: ``data_efficiency.data_routing.random_ltd`` on the middle layers (the first
  and last stay full), kept tokens ``fixed_linear`` from ``min`` to the full length over half
  the steps.

Reported per run: tokens processed (for random-LTD, layer-tokens divided by the layer
count: the full-model-token equivalent), the theoretical saving of the schedule
(1 - processed / baseline), the measured time saving (1 - total step time / baseline's),
median step time in the first and last quarter, and the loss on held-out full-length
batches at the end. A PNG plots training loss against tokens processed.

Prints one JSON object. Usage: ``python benchmarks/data_efficiency.py [--steps 200] [--png PATH]``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
from deepspeed.runtime.data_pipeline.data_routing import convert_to_random_ltd  # noqa: E402

V, D, L, SEQ, BATCH = 64, 64, 4, 128, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, h, attention_mask=None):
        b, t, _ = h.shape
        q, k, v = (y.view(b, t, 4, D // 4).transpose(1, 2) for y in self.qkv(self.ln1(h)).chunk(3, -1))
        if attention_mask is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # random-LTD passes the causal mask cut to the kept tokens
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, D), nn.Embedding(SEQ, D)
        self.layers = nn.ModuleList([Block() for _ in range(L)])
        self.head = nn.Linear(D, V)
        self.use_mask = False

    def forward(self, x, curriculum_seqlen=None):
        if curriculum_seqlen is not None:
            x = x[:, :curriculum_seqlen]
        inp, tgt = x[:, :-1], x[:, 1:]
        t = inp.shape[1]
        h = self.emb(inp) + self.pos(torch.arange(t))
        mask = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t) if self.use_mask else None
        for blk in self.layers:
            h = blk(h, attention_mask=mask)
        return F.cross_entropy(self.head(h).flatten(0, 1), tgt.flatten())


def markov_batches(n, seed):
    """A low-entropy first-order Markov language (each token has 3 likely successors)."""
    g = torch.Generator().manual_seed(1234)
    succ = torch.randint(0, V, (V, 3), generator=g)
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, BATCH, SEQ, dtype=torch.long)
    x[:, :, 0] = torch.randint(0, V, (n, BATCH), generator=g)
    for t in range(1, SEQ):
        pick = torch.randint(0, 3, (n, BATCH), generator=g)
        x[:, :, t] = succ[x[:, :, t - 1], pick]
    return x


def run(name, sections, steps, batches, held_out, init):
    torch.manual_seed(0)
    model = GPT()
    model.load_state_dict(init)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, **copy.deepcopy(sections)}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    if name == "random_ltd":
        model.use_mask = True
        convert_to_random_ltd(engine, Block)
    losses, tokens, times, cum = [], [], [], 0.0
    for s in range(steps):
        t0 = time.perf_counter()
        loss = engine(batches[s])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        call_len = SEQ
        if name == "curriculum_seqlen":
            call_len = engine.curriculum_scheduler_legacy.get_current_difficulty()
        if name == "random_ltd":
            cum = engine.random_ltd_scheduler.state["consumed_layer_tokens"] / L  # full-model equivalent
        else:
            cum += BATCH * (call_len - 1)  # input tokens (the last one is only a target)
        losses.append(loss.item())
        tokens.append(cum)
    engine.eval()
    with torch.no_grad():
        eval_loss = statistics.mean(engine(b).item() for b in held_out)
    q = max(1, steps // 4)
    return {"tokens_processed": tokens[-1], "total_step_time_s": sum(times),
            "median_step_s_first_quarter": statistics.median(times[:q]),
            "median_step_s_last_quarter": statistics.median(times[-q:]),
            "final_train_loss": statistics.mean(losses[-q:]), "held_out_loss": eval_loss,
            "_curve": (tokens, losses)}


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        tokens, losses = r["_curve"]
        ax.plot(tokens, losses, label=name, linewidth=1)
    ax.set_xlabel("tokens processed (random-LTD: layer-tokens / layers)")
    ax.set_ylabel("training loss")
    ax.set_title("Data efficiency: loss vs tokens, same model and batches")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--png", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs",
                                                  "measurements", "data_efficiency_loss_vs_tokens.png"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    steps, half = args.steps, max(1, args.steps // 2)
    batches, held_out = markov_batches(steps, 1), markov_batches(4, 2)
    torch.manual_seed(0)
    init = GPT().state_dict()
    configs = {
        "baseline": {},
        "curriculum_seqlen": {"curriculum_learning": {
            "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 16, "max_difficulty": SEQ,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": half, "difficulty_step": 8}}},
        "random_ltd": {"data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": L, "random_ltd_layer_num": L - 2,
            "random_ltd_layer_id": list(range(1, L - 1)), "model_mask_name": "attention_mask",
            "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": 16, "max_value": SEQ - 1, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": half, "seq_per_step": 8}}}}}},
    }
    results = {name: run(name, cfg, steps, batches, held_out, init) for name, cfg in configs.items()}
    base = results["baseline"]
    out = {"benchmark": "data_efficiency", "model": {"vocab": V, "d_model": D, "layers": L, "seq": SEQ,
                                                      "batch": BATCH, "steps": steps},
           "device": "cpu", "torch_threads": torch.get_num_threads(), "runs": {}}
    for name, r in results.items():
        row = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items() if not k.startswith("_")}
        row["theoretical_saving"] = round(1 - r["tokens_processed"] / base["tokens_processed"], 4)
        row["measured_time_saving"] = round(1 - r["total_step_time_s"] / base["total_step_time_s"], 4)
        out["runs"][name] = row
    if args.png:
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        plot(results, args.png)
        out["png"] = os.path.relpath(os.path.abspath(args.png), os.getcwd())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
