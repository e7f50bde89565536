"""Tiny models for the compression tests: a BERT-like encoder (named like Hugging Face's
BERT, so DeepSpeed's documented patterns apply) and a small CNN."""
import torch
from torch import nn

VOCAB, HIDDEN, HEADS, INTER, SEQ, CLASSES = 32, 16, 4, 32, 6, 2


class SelfAttention(nn.Module):
    def __init__(self, hidden=HIDDEN, heads=HEADS):
        super().__init__()
        self.head_dim = hidden // heads
        self.query, self.key, self.value = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, _ = x.shape
        # the number of heads is read from the projection's size, so a head-pruned model still runs
        split = lambda y: y.view(b, t, y.size(-1) // self.head_dim, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, -1)


class AttentionOutput(nn.Module):
    def __init__(self, hidden=HIDDEN):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden)

    def forward(self, h, x):
        return self.LayerNorm(self.dense(h) + x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.self = SelfAttention()
        self.output = AttentionOutput()

    def forward(self, x):
        return self.output(self.self(x), x)


class Intermediate(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(HIDDEN, INTER)

    def forward(self, x):
        return torch.relu(self.dense(x))


class Output(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(INTER, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN)

    def forward(self, h, x):
        return self.LayerNorm(self.dense(h) + x)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.intermediate = Intermediate()
        self.output = Output()

    def forward(self, x):
        a = self.attention(x)
        return self.output(self.intermediate(a), a)


class Encoder(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layer = nn.ModuleList([Layer() for _ in range(layers)])

    def forward(self, x):
        for layer in self.layer:
            x = layer(x)
        return x


class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)

    def forward(self, ids):
        return self.word_embeddings(ids) + self.position_embeddings.weight[: ids.size(1)]


class Bert(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embeddings = Embeddings()
        self.encoder = Encoder(layers)

    def forward(self, ids):
        return self.encoder(self.embeddings(ids))


class BertClassifier(nn.Module):
    """Returns the cross-entropy loss when labels are given, else the logits."""

    def __init__(self, layers=2):
        super().__init__()
        self.bert = Bert(layers)
        self.classifier = nn.Linear(HIDDEN, CLASSES)

    def forward(self, ids, labels=None):
        logits = self.classifier(self.bert(ids)[:, 0])
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits, labels)


def bert_batches(n, batch=16, seed=0):
    """A learnable task: the class is whether the first token is in the lower half of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append((ids, (ids[:, 0] < VOCAB // 2).long()))
    return out


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, 3, padding=1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.conv2(h))
        return self.fc(h.mean(dim=(2, 3)))


def param_count(model):
    return sum(p.numel() for p in model.parameters())
