"""ZeRO-3 at two gloo ranks without avoidable host copies (issue 32), training as plain PyTorch:

* the chunk layout puts the parameters kept whole (``stage3_param_persistence_threshold``)
  after the gathered ones, so a module's or a prefetch bucket's partitions lie back to back
  and go into the all-gather as one view: no concatenation;
* a gradient bucket is all-reduced in place on gloo (its reduce-scatter clones the input and
  copies the result out); each rank reads its own row.
"""
from __future__ import annotations

import torch

from tests.helpers.dist import run_distributed
from tests.runtime.zero3._models import lm_batches, make_lm, plain_reference, stage3_config, train_engine

LR, STEPS, GAS, MB, LAYERS = 0.02, 3, 2, 2, 3


def _run(rank, world_size):
    import deepspeed.runtime.zero.partitioned_gather as pg   # where gather_params looks up _flat_input
    from deepspeed.runtime.zero.stage3_comm import CheckedComm

    counts = {"flat_inputs": 0, "concatenated": 0, "reduce_scatters": 0}
    flat_input, reduce_scatter_rows = pg._flat_input, CheckedComm.reduce_scatter_rows

    def counted_flat_input(parts):
        out = flat_input(parts)
        counts["flat_inputs"] += 1
        counts["concatenated"] += out.untyped_storage().data_ptr() != parts[0].untyped_storage().data_ptr()
        return out

    def counted_reduce_scatter(self, *a, **k):
        counts["reduce_scatters"] += 1
        return reduce_scatter_rows(self, *a, **k)

    pg._flat_input, CheckedComm.reduce_scatter_rows = counted_flat_input, counted_reduce_scatter
    try:
        # biases and norms (<= 16 elements) kept whole; the weights are gathered
        cfg = stage3_config(gas=GAS, mb=MB, stage3_param_persistence_threshold=20)
        eng = train_engine(make_lm(seed=0, n_layers=LAYERS), cfg, lm_batches(STEPS, GAS * MB * world_size),
                           rank, world_size, lr=LR)
    finally:
        pg._flat_input, CheckedComm.reduce_scatter_rows = flat_input, reduce_scatter_rows
    st = eng.strategy
    names = {id(p): n for n, p in eng.module.named_parameters()}
    out = {"counts": counts, "launches": st.reducer.launches,
           "layout": [[(names[id(p)], bool(p.ds_persist)) for p in c.params] for c in st.parts.chunks],
           "sd": {k: v.float() for k, v in eng.module_state_dict().items()}}
    eng.destroy()
    return out


def test_gathers_take_views_and_buckets_reduce_in_place_matching_plain_pytorch():
    res = run_distributed(_run, 2, timeout=150)
    r0 = res[0]
    persist = [flag for chunk in r0["layout"] for _, flag in chunk]
    assert any(persist) and not all(persist), r0["layout"]
    for chunk in r0["layout"]:   # gathered parameters first, in model order; the whole ones last
        flags = [flag for _, flag in chunk]
        assert flags == sorted(flags), chunk
    for r in res:
        c = r["counts"]
        assert c["flat_inputs"] > 0, c                  # multi-parameter gathers happened ...
        assert c["concatenated"] == 0, c                # ... each from one view of the chunk
        assert r["launches"] > 0 and c["reduce_scatters"] == 0, (r["launches"], c)   # in-place all-reduce
    ref = plain_reference(make_lm(seed=0, n_layers=LAYERS), lm_batches(STEPS, GAS * MB * 2), LR)
    assert set(r0["sd"]) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(r0["sd"][k], v, rtol=1e-5, atol=2e-6, msg=k)
