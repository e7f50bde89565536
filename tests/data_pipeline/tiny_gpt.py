"""A tiny causal language model that understands DeepSpeed's data-efficiency forward
keywords (``curriculum_seqlen``, ``progressive_layer_drop``/``pld_theta``) and whose
blocks take an ``attention_mask`` (for random-LTD)."""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h, attention_mask=None):  # h: [batch, seq, d]; mask: bool [.., 1, seq, seq], True = attend
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        # written out (not scaled_dot_product_attention): the eigenvalue estimator differentiates twice
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask.squeeze(1), float("-inf"))
        a = scores.softmax(-1) @ v
        h = h + self.proj(a)
        return h + self.mlp(self.ln2(h))


class TinyGPT(nn.Module):
    def __init__(self, vocab=16, d=16, layers=3, seq=16):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)
        self.calls = []  # the data-efficiency keywords of each forward

    def forward(self, x, curriculum_seqlen=None, progressive_layer_drop=False, pld_theta=1.0):
        self.calls.append({"curriculum_seqlen": curriculum_seqlen, "progressive_layer_drop": progressive_layer_drop,
                           "pld_theta": pld_theta, "seq": x.shape[1]})
        if curriculum_seqlen is not None:
            x = x[:, :curriculum_seqlen]
        inp, tgt = x[:, :-1], x[:, 1:]
        s = inp.shape[1]
        h = self.emb(inp) + self.pos(torch.arange(s))
        mask = torch.ones(s, s, dtype=torch.bool).tril().view(1, 1, s, s)
        for blk in self.layers:
            if progressive_layer_drop and self.training and torch.rand(()) > pld_theta:
                continue  # dropped this step (keep probability pld_theta)
            h = blk(h, attention_mask=mask)
        return F.cross_entropy(self.head(h).flatten(0, 1), tgt.flatten())


def counting_batches(n, batch, seq=16, vocab=16, seed=0):
    """Sequences that count up modulo ``vocab`` from a random start: next token = previous + 1."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n, batch, 1), generator=g)
    return (starts + torch.arange(seq)) % vocab
