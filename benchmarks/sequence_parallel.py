"""Activation memory per rank with Ulysses sequence parallelism and tiled MLP (CPU, gloo).

Measures the bytes autograd saves for the backward (distinct storages, via
``torch.autograd.graph.saved_tensors_hooks``) in one forward of a small Llama at sequence
length S: at sp=1 (one process, the plain model) and at sp=2 (two processes, each with S/2
tokens), each with and without ``TiledMLP``. Prints one JSON object.
Run: ``.venv/bin/python benchmarks/sequence_parallel.py [--seq 2048]``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(tiled):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    cfg = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    if tiled:
        def fwd(self, x):
            shards = max(1, math.ceil(x.shape[1] / x.shape[2]))
            return TiledMLP.apply(lambda m, t: m.down_proj(m.act_fn(m.gate_proj(t)) * m.up_proj(t)), self, x,
                                  shards, [])
        modeling_llama.LlamaMLP.forward = fwd
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg), cfg


def _saved_bytes(fn):
    seen = {}

    def pack(t):
        try:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001
            pass
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _run(rank, world, seq, tiled, port):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, cfg = _model(tiled)
    if world > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1, seq_length_is_variable=True)
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
    n = seq // world
    sl = slice(rank * n, (rank + 1) * n)
    pos = torch.arange(seq)[None, sl]
    out, nbytes = _saved_bytes(lambda: model(input_ids=ids[:, sl], position_ids=pos).logits.float().mean())
    out.backward()
    dist.destroy_process_group()
    return nbytes


def _worker(rank, world, seq, tiled, port, q):
    q.put((rank, _run(rank, world, seq, tiled, port)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    import torch.multiprocessing as mp
    from tests.helpers.dist import free_port
    res = {"seq": args.seq, "model": "Llama hidden 128, 2 layers, 4 heads, vocab 256, fp32",
           "measure": "bytes saved for backward in one forward, per rank (MiB)"}
    ctx = mp.get_context("spawn")
    for world in (1, 2):
        for tiled in (False, True):
            q = ctx.Queue()
            port = free_port()
            ps = [ctx.Process(target=_worker, args=(r, world, args.seq, tiled, port, q)) for r in range(world)]
            [p.start() for p in ps]
            vals = dict(q.get(timeout=600) for _ in ps)
            [p.join() for p in ps]
            res[f"sp{world}{'_tiled_mlp' if tiled else ''}_MiB"] = round(max(vals.values()) / 2**20, 2)
    res["ratio_sp2_vs_sp1"] = round(res["sp2_MiB"] / res["sp1_MiB"], 3)
    res["ratio_tiled_vs_plain_sp1"] = round(res["sp1_tiled_mlp_MiB"] / res["sp1_MiB"], 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
