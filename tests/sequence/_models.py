"""Tiny models and references for the sequence-parallel tests (module level: spawn pickles)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, DIM, HEADS = 32, 16, 4


def causal_sdpa(q, k, v):
    """[b, s, h, d] in and out; causal over the (full) sequence."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


class TinyAttnLM(torch.nn.Module):
    """Embedding -> causal self-attention (DistributedAttention when given a group) -> LM head."""

    def __init__(self, sp_group=None):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM, bias=False)  # a key bias has a zero gradient: Adam amplifies its rounding noise
        self.proj = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.attn = None
        if sp_group is not None:
            from deepspeed.sequence.layer import DistributedAttention
            self.attn = DistributedAttention(causal_sdpa, sp_group, scatter_idx=2, gather_idx=1)

    def forward(self, ids):                          # ids: [b, s_local]
        x = self.emb(ids)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        ctx = self.attn(q, k, v, 0) if self.attn is not None else causal_sdpa(q, k, v)
        return self.head(x + self.proj(ctx.reshape(b, s, DIM)))   # [b, s, V]


def batches(steps, batch=2, seq=8, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g))
            for _ in range(steps)]


def full_loss(model, ids, tgt):
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))


def sp_loss(model, ids, tgt, sp_rank, sp_size, group):
    """The sequence-parallel loss: this rank's shard, DeepSpeed's gathered per-token losses."""
    from deepspeed.sequence.cross_entropy import vocab_sequence_parallel_cross_entropy
    n = ids.shape[1] // sp_size
    sl = slice(sp_rank * n, (sp_rank + 1) * n)
    logits = model(ids[:, sl])                                  # [b, s/P, V]
    losses = vocab_sequence_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                   tgt[:, sl].transpose(0, 1).contiguous(), group)  # [S, b]
    return losses.mean()


def reference_params(steps_data, lr, seed, extra_steps=0):
    """Plain PyTorch: the same model and Adam on the full sequences of every global batch."""
    torch.manual_seed(seed)
    m = TinyAttnLM()
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    out = []
    for ids, tgt in steps_data:
        opt.zero_grad()
        full_loss(m, ids, tgt).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in m.state_dict().items()})
    return out


class TiledNet(torch.nn.Module):
    """input -> MLP (TiledMLP over 3 slices of the sequence when ``tiled``) -> head; loss inside."""

    def __init__(self, tiled):
        super().__init__()
        self.tiled = tiled
        self.inp = torch.nn.Linear(4, 8)
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 8)
        self.head = torch.nn.Linear(8, 1)

    @staticmethod
    def _mlp(m, t):
        return m.down(torch.relu(m.up(t)))

    def forward(self, x):
        h = self.inp(x)
        if self.tiled:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
            h = TiledMLP.apply(TiledNet._mlp, self, h, 3, [self.up.weight, self.up.bias, self.down.weight,
                                                            self.down.bias])
        else:
            h = self._mlp(self, h)
        return self.head(h).pow(2).mean()
