"""ALST: UlyssesSPAttentionHF on a tiny Llama (built in the test, no download) equals the model
without sequence parallelism; UlyssesSPDataLoaderAdapter's shards; the tiled computations equal
the plain ones."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed

SEQ = 8


def _tiny_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _hf_body(rank, ws, with_engine=False):
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups
    out = {}
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 64, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).expand(2, SEQ)
    # reference: no sequence parallelism, full sequence (before the attention is replaced)
    ref = _tiny_llama(0)
    ref_loss = ref(input_ids=ids[:1], position_ids=pos[:1], labels=ids[:1]).loss
    ref_loss.backward()
    ref_grads = _grads(ref)

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=ref, core_attn_implementation="sdpa", sequence_parallel_size=ws, micro_batch_size=1,
        seq_length=SEQ, seq_length_is_variable=True)
    sp_group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
    ds = torch.utils.data.TensorDataset(ids, pos)
    dl = torch.utils.data.DataLoader(ds, batch_size=1, collate_fn=lambda b: dict(
        input_ids=b[0][0][None], position_ids=b[0][1][None], labels=b[0][0][None]))
    adapter = UlyssesSPDataLoaderAdapter(dl, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=ws,
                                         device=torch.device("cpu"))
    batch = next(iter(adapter))
    out["batch"] = {k: v.tolist() for k, v in batch.items()}
    out["len"] = len(adapter)

    def share_loss(model, batch):
        """This rank's share of the full-sequence mean loss (sums to it over the group)."""
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        lbl = batch["shift_labels"]
        tok = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), lbl.reshape(-1),
                                                ignore_index=-100, reduction="sum")
        total = (lbl != -100).sum()
        torch.distributed.all_reduce(total, group=sp_group)
        return tok / total

    # 1. the model alone: loss and gradients (summed over the group) equal the reference
    m = _tiny_llama(0)
    loss = share_loss(m, batch)
    loss.backward()
    full = loss.detach().clone()
    torch.distributed.all_reduce(full, group=sp_group)
    out["loss_diff"] = (full - ref_loss.detach()).abs().item()
    grads = _grads(m)
    for t in grads.values():
        torch.distributed.all_reduce(t, group=sp_group)
    out["grad_diff"] = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    # DeepSpeed's tutorial aggregation (differentiable all_gather): loss value equal, gradient x sp
    __import__("torch.distributed.nn")
    m2 = _tiny_llama(0)
    logits = m2(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    local = m2.loss_function(logits=logits, labels=None, shift_labels=batch["shift_labels"], vocab_size=64)
    good = (batch["shift_labels"] != -100).sum()
    losses = torch.distributed.nn.functional.all_gather(local, group=sp_group)
    goods = torch.distributed.nn.functional.all_gather(good, group=sp_group)
    tut = sum(lo * go for lo, go in zip(losses, goods)) / sum(goods)
    tut.backward()
    out["tutorial_loss_diff"] = (tut.detach() - ref_loss.detach()).abs().item()
    g2 = _grads(m2)
    for t in g2.values():
        torch.distributed.all_reduce(t, group=sp_group)
    out["tutorial_grad_ratio_diff"] = max((g2[n] - ws * ref_grads[n]).abs().max().item() for n in ref_grads)

    if not with_engine:
        return out
    # 2. through the engine (mpu from register_with_transformers, ZeRO 0 and 3): one Adam step
    for stage in (0, 3):
        m3 = _tiny_llama(0)
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "sequence_parallel_size": ws}
        eng, *_ = deepspeed.initialize(model=m3, model_parameters=m3.parameters(), config=cfg, mpu=mpu)
        out[f"groups{stage}"] = (groups._get_sequence_parallel_world_size(), groups._get_data_parallel_world_size(),
                                 eng.train_batch_size())
        eng.backward(share_loss(eng, batch))
        eng.step()
        out[f"params{stage}"] = {k: v.clone() for k, v in eng.module_state_dict().items()} if rank == 0 else None
    # the reference step: Adam on the full-sequence gradient
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt.step()
    out["ref_params"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return out


@pytest.fixture(scope="module")
def hf_world(sp2_world):
    return [r["hf"] for r in sp2_world[0]]


def test_ulysses_hf_attention_equals_full_model(hf_world):
    for r in hf_world:
        assert r["loss_diff"] < 1e-5, r["loss_diff"]
        assert r["grad_diff"] < 1e-5, r["grad_diff"]
        # the tutorial's differentiable all_gather: the same loss, sp x the gradient (see ulysses_sp's docstring)
        assert r["tutorial_loss_diff"] < 1e-5 and r["tutorial_grad_ratio_diff"] < 2e-5


def test_dataloader_adapter_shards_and_preshifts(hf_world):
    ids = torch.randint(1, 64, (2, SEQ), generator=torch.Generator().manual_seed(5))
    first = ids[0].tolist()
    for rank, r in enumerate(hf_world):
        half = SEQ // 2
        assert r["batch"]["input_ids"] == [first[rank * half:(rank + 1) * half]]
        assert r["batch"]["position_ids"] == [list(range(rank * half, (rank + 1) * half))]
        shifted = first[1:] + [-100]
        assert r["batch"]["shift_labels"] == [shifted[rank * half:(rank + 1) * half]]
        assert "labels" not in r["batch"] and r["len"] == 2 * 2


@pytest.mark.slow
def test_ulysses_hf_training_step_through_engine():
    pytest.importorskip("transformers")
    res = run_distributed(_hf_body, world_size=2, args=(True,), timeout=300)
    r = res[0]
    for stage in (0, 3):
        assert all(h[f"groups{stage}"] == (2, 1, 1) for h in res)
        for k, want in r["ref_params"].items():
            assert torch.allclose(r[f"params{stage}"][k].float(), want, atol=1e-5, rtol=1e-4), (stage, k)


def check_tiled_under_zero(rank, ws):
    """TiledMLP inside engines at ZeRO 0-3 (tiny buckets, overlapped reduction: a bucket reduced
    after the first slice would miss the others) vs plain PyTorch; data parallel only."""
    import deepspeed
    from tests.sequence._models import TiledNet
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(4, 12, 4, generator=g) for _ in range(2)]
    torch.manual_seed(0)
    ref = TiledNet(False)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x in data:
        opt.zero_grad()
        ref(x).backward()
        opt.step()
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "optimizer": {"type": "Adam",
               "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage, "reduce_bucket_size": 40,
                                                              "allgather_bucket_size": 40, "overlap_comm": True}}
        eng, *_ = deepspeed.initialize(model=TiledNet(True), config=cfg)
        for x in data:
            eng.backward(eng(x[rank * 2:rank * 2 + 2]))
            eng.step()
        sd = eng.module_state_dict()
        out[stage] = (eng.sequence_parallel_size, max((sd[k].float() - v).abs().max().item()
                                                      for k, v in ref.state_dict().items()) if rank == 0 else 0.0)
    return out


def test_tiled_mlp_under_zero_equals_plain(sp2_world):
    for r in sp2_world[0]:
        for stage, (sp, diff) in r["tiled_zero"].items():
            assert sp == 1 and diff < 1e-6, (stage, sp, diff)


def test_tiled_compute_equals_plain():
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    head = torch.nn.Linear(8, 20)
    x = torch.randn(2, 12, 8)
    y = torch.randint(0, 20, (2, 12))

    def run(tiled):
        for p in list(mlp.parameters()) + list(head.parameters()):
            p.grad = None
        xi = x.clone().requires_grad_()
        if tiled:
            h = TiledMLP.apply(lambda self, t: self(t), mlp, xi, 3, list(mlp.parameters()))
            loss = TiledFusedLogitsLoss.apply(
                lambda self, a, b: torch.nn.functional.cross_entropy(self(a), b), head, h, y, None, 4,
                list(head.parameters()), "mean")
            loss2 = sequence_tiled_compute(lambda h, y: torch.nn.functional.cross_entropy(
                head(h).reshape(-1, 20), y.reshape(-1), reduction="sum"), 12, 3, dict(h=h, y=y), {}, "h",
                list(head.parameters()), output_unshard_dimension=0, output_reduction="sum") / 24
        else:
            h = mlp(xi)
            loss = torch.nn.functional.cross_entropy(head(h).reshape(-1, 20), y.reshape(-1))
            loss2 = loss
        (loss + loss2).backward()
        return loss.detach(), loss2.detach(), xi.grad, [p.grad.clone() for p in list(mlp.parameters()) +
                                                         list(head.parameters())]

    a, b = run(False), run(True)
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.allclose(a[1], b[1], atol=1e-6)
    assert torch.allclose(a[2], b[2], atol=1e-6)
    for ga, gb in zip(a[3], b[3]):
        assert torch.allclose(ga, gb, atol=1e-6)


def test_uneven_heads_refused():
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    class _G:
        pass
    import unittest.mock as um
    with um.patch("torch.distributed.get_world_size", return_value=4), \
            um.patch("torch.distributed.get_rank", return_value=0):
        with pytest.raises(ValueError, match="head count 6 is not divisible by the sequence-parallel size 4"):
            UlyssesSPAttentionHF(None, 1, 6, 4, 6, 1, _G())
        with pytest.raises(ValueError, match="key/value head count 3"):
            UlyssesSPAttentionHF(None, 1, 8, 4, 3, 1, _G())
