"""Random-LTD: the scheduled number of tokens per layer, the wrapped layer applied to the kept
tokens with the dropped ones passed through, and gradients equal to a plain-PyTorch reference."""
import pytest
import torch

from deepspeed.ops.random_ltd import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens
from deepspeed.runtime.data_pipeline.data_routing import (RandomLayerTokenDrop, RandomLTDScheduler,
                                                          remove_random_ltd_state_dict)


class Affine(torch.nn.Module):
    """A token-wise layer that also records the shapes it saw."""

    def __init__(self, d, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(d, d, generator=g))
        self.seen = []

    def forward(self, h, attention_mask=None):
        self.seen.append((tuple(h.shape), None if attention_mask is None else tuple(attention_mask.shape)))
        return torch.tanh(h @ self.w)


def _cfg(order, model_type="decoder", layers=(0, 1)):
    return {"total_layer_num": 3, "random_ltd_layer_num": len(layers), "random_ltd_layer_id": list(layers),
            "model_mask_name": "attention_mask", "model_type": model_type, "hidden_state_order": order,
            "micro_batch_size": 2, "global_batch_size": 2,
            "random_ltd_schedule": {"min_value": 4, "max_value": 10, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 6, "seq_per_step": 2}}}


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
def test_kept_tokens_output_and_gradients(order):
    torch.manual_seed(0)
    B, S, D = 2, 10, 4
    cfg = _cfg(order)
    sched = RandomLTDScheduler(cfg)
    sched.update_seq(3)  # 3/6*6+4 = 7 -> 6 kept tokens (multiple of 2)
    kept = sched.get_current_seq()
    assert kept == 6
    inner = [Affine(D, 1), Affine(D, 2)]
    wrapped = [RandomLayerTokenDrop(m) for m in inner]
    for i, w in enumerate(wrapped):
        w.init_config(cfg, sched, i)
        w.train()
    x = torch.randn((B, S, D) if order == "batch_seq_dim" else (S, B, D), requires_grad=True)
    mask = torch.ones(S, S, dtype=torch.bool).tril().view(1, 1, S, S)
    h = x
    for w in wrapped:
        h = w(h, attention_mask=mask)
    idx = sched.state["sample_idx"].long()  # [layers, batch, kept]
    assert idx.shape == (2, B, kept)
    for layer, m in enumerate(inner):  # exactly `kept` tokens reached each layer; the mask was cut to them
        tokens = (B, kept, D) if order == "batch_seq_dim" else (kept, B, D)
        assert m.seen == [(tokens, (1, 1, kept, kept))]
        for b in range(B):
            assert idx[layer, b].unique().numel() == kept and bool((idx[layer, b].diff() > 0).all())

    # reference: plain indexing, per sample and layer
    xb = x if order == "batch_seq_dim" else x.transpose(0, 1)
    ref = xb
    for layer, m in enumerate(inner):
        out = ref.clone()
        for b in range(B):
            sel = idx[layer, b]
            out[b, sel] = torch.tanh(ref[b, sel] @ m.w)
        ref = out
    got = h if order == "batch_seq_dim" else h.transpose(0, 1)
    torch.testing.assert_close(got, ref)
    # a dropped token of layer 0 that layer 1 kept went through layer 1 only, and so on: the
    # gradients of the input and of each layer's weights match the reference's
    g = torch.randn_like(got)
    grads = torch.autograd.grad((got * g).sum(), [x] + [m.w for m in inner])
    ref_grads = torch.autograd.grad((ref * g).sum(), [x] + [m.w for m in inner])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    assert grads[0].abs().sum() > 0 and all(gr.abs().sum() > 0 for gr in grads[1:])


def test_full_length_and_eval_run_every_token():
    cfg = _cfg("batch_seq_dim")
    sched = RandomLTDScheduler(cfg)
    sched.update_seq(100)  # max_value 10 = the sequence length
    m = Affine(4, 3)
    w = RandomLayerTokenDrop(m)
    w.init_config(cfg, sched, 0)
    x = torch.randn(2, 10, 4)
    torch.testing.assert_close(w(x), torch.tanh(x @ m.w))
    sched.set_current_seq(4)
    w.eval()
    torch.testing.assert_close(w(x), torch.tanh(x @ m.w))
    assert [s[0] for s in m.seen] == [(2, 10, 4), (2, 10, 4)]


def test_encoder_mask_keeps_the_rows_and_columns_of_kept_tokens():
    torch.manual_seed(1)
    mask = torch.rand(2, 1, 8, 8) > 0.5
    idx, new = bert_sample_tokens(5, 8, 2, layers=3, attn_mask=mask)
    assert idx.shape == (3, 2, 5) and len(new) == 3
    for layer in range(3):
        for b in range(2):
            sel = idx[layer, b].long()
            assert torch.equal(new[layer][b, 0], mask[b, 0][sel][:, sel])
    idx, new = gpt_sample_tokens(5, 8, 2, layers=1, attn_mask=mask)
    assert torch.equal(new, mask[:, :, :5, :5])
    with pytest.raises(ValueError, match="reserved_length"):
        gpt_sample_tokens(9, 8, 2)


def test_gather_scatter_roundtrip_and_state_dict_keys():
    x = torch.randn(2, 6, 3)
    idx = torch.tensor([[0, 2, 5], [1, 3, 4]], dtype=torch.int32)
    _, part = GatherTokens.apply(x, idx, True)
    assert torch.equal(part[1], x[1, [1, 3, 4]])
    assert torch.equal(ScatterTokens.apply(x, part, idx, True), x)
    sd = {"layers.0.random_ltd_layer.w": 1, "head.w": 2}
    assert list(remove_random_ltd_state_dict(sd)) == ["layers.0.w", "head.w"]
