"""The surface pieces that need several ranks, run in one spawned group of 2 (amortizing
start-up): ZeRO-3 leaf modules (one gather for the whole subtree, same training result),
unwrap_model_for_generation, empty_partition_cache, external-parameter bookkeeping, the
coalesced collectives and PartitionedTensor.full, each against plain-PyTorch values."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers.dist import run_distributed

DIM = 8


class Expertish(nn.Module):
    """Two children the forward calls in a data-dependent order (a leaf candidate)."""

    def __init__(self, dynamic):
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.dynamic = dynamic
        self.only = None   # "a"/"b": this call uses one child only (a child chosen by rank)

    def forward(self, x):
        if self.only is not None:
            return x + torch.tanh(getattr(self, self.only)(x))
        first, second = (self.a, self.b) if not self.dynamic or x.sum() > 0 else (self.b, self.a)
        return x + second(torch.tanh(first(x)))


class Net(nn.Module):
    def __init__(self, dynamic=False):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Expertish(dynamic) for _ in range(2))
        self.out = nn.Linear(DIM, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.mse_loss(self.out(h), y)


def _data(n_steps, world):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2 * world, DIM, generator=g), torch.randn(2 * world, 1, generator=g)) for _ in range(n_steps)]


def _train(rank, world, leaf: bool, dynamic: bool = False, by_rank: bool = False):
    import deepspeed
    from deepspeed.utils import set_z3_leaf_modules
    torch.manual_seed(0)
    model = Net(dynamic)
    if by_rank:   # rank 0 runs only child a of each block, rank 1 only child b (DeepSpeed's ChooseModuleByRank)
        for b in model.blocks:
            b.only = "ab"[rank]
    if leaf:
        set_z3_leaf_modules(model, [Expertish])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}
    eng = deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]
    c = eng.strategy.coordinator
    gathers = []
    for x, y in _data(3, world):
        before = c.gathers
        loss = eng(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        gathers.append(c.gathers - before)   # forward gathers of this step
        eng.backward(loss)
        eng.step()
    return eng, gathers


def _body(rank, world, ckpt_dir):
    import deepspeed
    import deepspeed.comm as dscomm
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
    from deepspeed.runtime.utils import PartitionedTensor
    from deepspeed.runtime.zero import unwrap_model_for_generation
    from deepspeed.runtime.zero.partition_parameters import partitioned_param_data_shape
    out = {}

    # -- ZeRO-3 leaf modules ----------------------------------------------------------------
    eng_plain, g_plain = _train(rank, world, leaf=False)
    eng_leaf, g_leaf = _train(rank, world, leaf=True)
    out["gathers"] = (g_plain, g_leaf)
    with deepspeed.zero.GatheredParameters(list(eng_plain.module.parameters())):
        plain = [p.detach().clone() for p in eng_plain.module.parameters()]
    with deepspeed.zero.GatheredParameters(list(eng_leaf.module.parameters())):
        leafp = [p.detach().clone() for p in eng_leaf.module.parameters()]
    out["leaf_same_params"] = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, leafp))
    # a leaf whose children run differently on each rank: its gradients are reduced together at
    # the end of backward (zeros for the child a rank did not run), never in rank-dependent order
    eng_rank, _ = _train(rank, world, leaf=True, by_rank=True)
    with deepspeed.zero.GatheredParameters(list(eng_rank.module.parameters())):
        by_rank = [p.detach().clone() for p in eng_rank.module.parameters()]
    eng_rank.destroy()

    def per_rank_loss(ref, x, y, r):
        for b in ref.blocks:
            b.only = "ab"[r] if name == "leaf_by_rank_vs_plain_torch" else None
        return ref(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])
    # reference: the same training in plain PyTorch on the full batches
    for name, dynamic, got in (("leaf_vs_plain_torch", False, leafp), ("leaf_by_rank_vs_plain_torch", False, by_rank)):
        torch.manual_seed(0)
        ref = Net(dynamic)
        ropt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.0)
        for x, y in _data(3, world):  # whole batch; per-sample order picks differ, so split the loss per rank
            ropt.zero_grad()
            sum(per_rank_loss(ref, x, y, r) for r in range(world)).div(world).backward()
            ropt.step()
        out[name] = max((a - b.detach()).abs().max().item() for a, b in zip(got, ref.parameters()))
    # inside the leaf's forward its children's weights are whole; outside they are placeholders
    seen = {}
    blk = eng_leaf.module.blocks[0]
    h = blk.b.register_forward_pre_hook(lambda m, a: seen.update(b_shape=tuple(m.weight.shape)))
    with torch.no_grad():
        eng_leaf(torch.ones(2, DIM), torch.zeros(2, 1))
    h.remove()
    out["child_shape_in_forward"] = seen["b_shape"]
    out["child_shape_outside"] = tuple(blk.b.weight.shape)
    out["placeholder_shape"] = list(partitioned_param_data_shape)

    # -- unwrap_model_for_generation / empty_partition_cache ----------------------------------
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(5))
    with unwrap_model_for_generation(eng_leaf) as m:
        out["unwrapped_is_module"] = m is eng_leaf.module
        out["shapes_inside"] = tuple(m.inp.weight.shape)
        with torch.no_grad():
            h1 = m.blocks[1](m.blocks[0](m.inp(x)))  # direct child calls: weights already whole
            y_inside = m.out(h1)
        full = {n: p.detach().clone() for n, p in m.named_parameters()}
    out["shapes_after"] = tuple(eng_leaf.module.inp.weight.shape)
    ref2 = Net()
    ref2.load_state_dict(full)
    with torch.no_grad():
        out["gen_matches_full_model"] = torch.allclose(y_inside, ref2.out(ref2.blocks[1](ref2.blocks[0](ref2.inp(x)))))
    gp = deepspeed.zero.GatheredParameters([eng_leaf.module.out.weight])
    gp.__enter__()
    eng_leaf.strategy.coordinator.fetch(eng_leaf.module.inp, 0, [eng_leaf.module.inp.weight])  # leave one gathered
    before = eng_leaf.module.inp.weight.ds_status.name
    eng_leaf.empty_partition_cache()  # DeepSpeed's engine method (runtime.zero.generation.empty_partition_cache)
    out["cache"] = (before, eng_leaf.module.inp.weight.ds_status.name, eng_leaf.module.out.weight.ds_status.name)
    gp.__exit__(None, None, None)

    # -- external parameters are kept where DeepSpeed keeps them ----------------------------
    owner, user = nn.Linear(2, 2), nn.Linear(2, 2)
    deepspeed.zero.register_external_parameter(user, owner.weight)
    out["external"] = list(user._external_params.values())[0] is owner.weight

    # -- coalesced collectives vs per-tensor torch.distributed ------------------------------
    ts = [torch.full((3,), float(rank + 1)), torch.arange(4, dtype=torch.float64) * (rank + 1)]
    dscomm.all_reduce_coalesced(ts)
    out["arc"] = [t.tolist() for t in ts]
    handle = dscomm.all_reduce_coalesced([torch.ones(2) * (rank + 1)], async_op=True)
    handle.wait()
    outs = [[torch.empty(2), torch.empty(1)] for _ in range(world)]
    dscomm.all_gather_coalesced(outs, [torch.tensor([rank, rank + 0.5]), torch.tensor([10.0 * rank])])
    out["agc"] = [[t.tolist() for t in o] for o in outs]
    parts = reduce_scatter_coalesced([torch.arange(5.) * (rank + 1), torch.ones(2, 2) * (rank + 1)])
    out["rsc"] = [p.tolist() for p in parts]
    out["iar"] = dscomm.inference_all_reduce(torch.tensor([float(rank)])).tolist()
    g = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
    dscomm.gather(torch.tensor([rank + 10.0]), g, dst=0)
    sc = torch.zeros(1)
    dscomm.scatter(sc, [torch.tensor([5.0]), torch.tensor([6.0])] if rank == 0 else None, src=0)
    peer = 1 - rank
    got = torch.zeros(1)
    for w in dscomm.batch_isend_irecv([dscomm.P2POp(dscomm.isend, torch.tensor([float(rank)]), peer),
                                       dscomm.P2POp(dscomm.irecv, got, peer)]):
        w.wait()
    ag = torch.zeros(2)
    dscomm.all_gather_base(ag, torch.tensor([rank * 2.0]))
    rs = torch.zeros(1)
    dscomm.reduce_scatter_base(rs, torch.tensor([1.0, 2.0]) * (rank + 1))
    out["p2p"] = ([t.item() for t in g] if g else None, sc.item(), got.item(), ag.tolist(), rs.item())
    sub = dscomm.new_group([1])
    out["ranks"] = (dscomm.get_all_ranks_from_group(), dscomm.get_all_ranks_from_group(sub) if rank == 1 else None)

    # -- PartitionedTensor across the group --------------------------------------------------
    t = torch.arange(15.).view(3, 5)
    pt = PartitionedTensor(t, group=None)
    again = PartitionedTensor.from_meta(pt.to_meta(), pt.data(), group=None)
    out["pt"] = (pt.local_size(), torch.equal(again.full(), t), pt.to_meta().tolist())

    # -- a real 2-stage pipeline checkpoint, described afterwards by DeepSpeedCheckpoint ------
    from tests.runtime.pipe.test_pipe_features import _gpt_engine, _train_params
    pipe = _gpt_engine(2, 1)
    _train_params(pipe)
    pipe.save_checkpoint(ckpt_dir, tag="t1", client_state={"iteration": 7, "args": {"hidden": 8}})
    out["pipe_params"] = [p.detach().clone() for p in pipe.module.parameters()]
    return out


def test_surface_on_two_ranks(tmp_path):
    r0, r1 = run_distributed(_body, world_size=2, args=(str(tmp_path),), timeout=300)
    g_plain, g_leaf = r0["gathers"]
    # per forward: inp + 2 children x 2 blocks + out = 6 without leaves; inp + 1 per block + out = 4 with
    assert g_plain == [6, 6, 6] and g_leaf == [4, 4, 4], (g_plain, g_leaf)
    assert r0["leaf_same_params"] and r1["leaf_same_params"]
    assert r0["leaf_vs_plain_torch"] < 1e-5
    assert r0["leaf_by_rank_vs_plain_torch"] < 1e-5 and r1["leaf_by_rank_vs_plain_torch"] < 1e-5
    assert r0["child_shape_in_forward"] == (DIM, DIM) and r0["child_shape_outside"] == (0,)
    assert r0["placeholder_shape"] == [0]
    for r in (r0, r1):
        assert r["unwrapped_is_module"] and r["shapes_inside"] == (DIM, DIM) and r["shapes_after"] == (0,)
        assert r["gen_matches_full_model"]
        assert r["cache"] == ("AVAILABLE", "NOT_AVAILABLE", "AVAILABLE")  # held params stay
        assert r["external"]
        assert r["arc"] == [[3.0] * 3, [0.0, 3.0, 6.0, 9.0]]  # 1+2, arange*(1+2)
        assert r["agc"] == [[[0.0, 0.5], [0.0]], [[1.0, 1.5], [10.0]]]
        assert r["iar"] == [1.0]
        assert r["ranks"][0] == [0, 1]
        assert r["pt"][1] and r["pt"][2] == [2, 3, 5, 2, 0, 8, 15]
    # average of arange(5)*1 and *2 = arange(5)*1.5, split 3+3 (last zero-padded); ones*1.5 split 2+2
    assert r0["rsc"] == [[0.0, 1.5, 3.0], [1.5, 1.5]] and r1["rsc"] == [[4.5, 6.0], [1.5, 1.5]]
    assert r1["ranks"][1] == [1]
    assert r0["pt"][0] == 8 and r1["pt"][0] == 7
    assert r0["p2p"] == ([10.0, 11.0], 5.0, 1.0, [0.0, 2.0], 3.0)
    assert r1["p2p"] == (None, 6.0, 0.0, [0.0, 2.0], 6.0)

    # DeepSpeedCheckpoint over the pipeline checkpoint the two ranks wrote
    from deepspeed.checkpoint import DeepSpeedCheckpoint
    ck = DeepSpeedCheckpoint(str(tmp_path / "t1"))
    assert (ck.original_pp_degree, ck.original_tp_degree, ck.original_dp_degree) == (2, 1, 1)
    assert ck.get_iteration() == 7 and ck.get_args() == {"hidden": 8}
    assert ck.layer_keys == [f"layer_{i:02d}" for i in range(6)]  # tied embedding, 4 blocks, tied head
    assert ck.get_zero_files(0, 0, 0) and ck.get_zero_files(1, 0, 0) and not ck.get_zero_files(2, 0, 0)
    emb = ck.get_embedding_state()
    assert emb and all(any(v.shape == p.shape and torch.equal(v, p) for p in r0["pipe_params"]) for v in emb.values())
    stage1_blocks = ck.get_transformer_state(tp_index=0, pp_index=1)
    for sd in stage1_blocks:
        assert all(any(v.shape == p.shape and torch.equal(v, p) for p in r1["pipe_params"]) for v in sd.values())
    # re-split over 4 stages: transformer layers 1..4 one per stage
    assert DeepSpeedCheckpoint(str(tmp_path / "t1"), pp_degree=4).get_pp_transformer_map(3) == ["layer_04"]
    with pytest.raises(ValueError, match="re-slicing tensor-parallel"):
        DeepSpeedCheckpoint(str(tmp_path / "t1"), tp_degree=2)
    with pytest.raises(ValueError, match="no mp_rank_XX_model_states.pt"):
        DeepSpeedCheckpoint(str(tmp_path))
