"""Activation memory and step time per rank with Ulysses sequence parallelism and TiledMLP
(CPU, gloo), at sp = 1, 2, 4 and several sequence lengths, in one run.

Memory: the bytes autograd saves for the backward in one forward (distinct storages, via
``torch.autograd.graph.saved_tensors_hooks``): the activation memory a rank holds at the peak
between forward and backward. Step time: forward + backward of the model at sequence length S
split over sp ranks (median of 3 after one warm-up; a shared CPU box: compare within the run).
``longest_seq_under_cap``: the longest measured S whose per-rank activation memory stays under
``--cap-mib``. Prints one JSON object.
Run: ``.venv/bin/python benchmarks/sequence_parallel.py [--seqs 1024,2048,4096] [--cap-mib 40]``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TILED = {"on": False}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    plain = modeling_llama.LlamaMLP.forward

    def fwd(self, x):
        if not TILED["on"]:
            return plain(self, x)
        shards = max(1, math.ceil(x.shape[1] / x.shape[2]))
        return TiledMLP.apply(lambda m, t: m.down_proj(m.act_fn(m.gate_proj(t)) * m.up_proj(t)), self, x, shards,
                              [m for m in (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)])
    modeling_llama.LlamaMLP.forward = fwd
    cfg = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=256, max_position_embeddings=16384)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _step(model, ids, pos):
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, position_ids=pos).logits.float().mean()
    loss.backward()
    return sum(seen.values())


def _worker(rank, world, seqs, port, q):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model()
    if world > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1, seq_length_is_variable=True)
    res = {}
    for seq in seqs:
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
        n = seq // world
        sl = slice(rank * n, (rank + 1) * n)
        pos = torch.arange(seq)[None, sl]
        for tiled in (False, True):
            TILED["on"] = tiled
            nbytes = _step(model, ids[:, sl], pos)
            times = []
            for _ in range(3):
                dist.barrier()
                t0 = time.perf_counter()
                _step(model, ids[:, sl], pos)
                dist.barrier()
                times.append(time.perf_counter() - t0)
            res[(seq, tiled)] = (nbytes, statistics.median(times))
    q.put((rank, res))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,2048,4096")
    ap.add_argument("--cap-mib", type=float, default=40.0)
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    import torch.multiprocessing as mp
    from tests.helpers.dist import free_port
    ctx = mp.get_context("spawn")
    out = {"model": "Llama hidden 128, 2 layers, 4 heads, vocab 256, fp32, sdpa", "device": "cpu (gloo), 1 thread/rank",
           "memory": "MiB saved for backward per rank (max over ranks)", "time": "s per forward+backward (median of 3)",
           "cap_mib": args.cap_mib, "runs": []}
    for world in (1, 2, 4):
        q = ctx.Queue()
        port = free_port()
        ps = [ctx.Process(target=_worker, args=(r, world, seqs, port, q)) for r in range(world)]
        for p in ps:
            p.start()
        got = dict(q.get(timeout=1800) for _ in ps)
        for p in ps:
            p.join()
        for (seq, tiled) in got[0]:
            mem = max(g[(seq, tiled)][0] for g in got.values()) / 2**20
            t = max(g[(seq, tiled)][1] for g in got.values())
            out["runs"].append({"sp": world, "seq": seq, "tiled_mlp": tiled, "mem_mib": round(mem, 2),
                                "step_s": round(t, 4)})
    for tiled in (False, True):
        for world in (1, 2, 4):
            fit = [r["seq"] for r in out["runs"] if r["sp"] == world and r["tiled_mlp"] == tiled
                   and r["mem_mib"] <= args.cap_mib]
            out.setdefault("longest_seq_under_cap", {})[f"sp{world}{'_tiled' if tiled else ''}"] = max(fit) if fit \
                else None
    base = {(r["seq"], r["tiled_mlp"]): r for r in out["runs"] if r["sp"] == 1}
    for r in out["runs"]:
        b = base[(r["seq"], r["tiled_mlp"])]
        r["mem_vs_sp1"] = round(r["mem_mib"] / b["mem_mib"], 3)
        r["time_vs_sp1"] = round(r["step_s"] / b["step_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
