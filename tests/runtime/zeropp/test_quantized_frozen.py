"""ZeRO++ ``zero_quantized_nontrainable_weights`` at world size 2: frozen weights are kept as
int8 blocks + fp32 scales (about a quarter of their fp32 bytes), gathered exactly as the
quantizer's round trip of the original values (so within the documented scale/2 bound), and
the trainable layers train exactly as plain PyTorch does with the frozen weight replaced by
that round trip."""
from __future__ import annotations

import torch

from tests.helpers.dist import run_distributed


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    m[0].weight.requires_grad_(False)   # a frozen backbone weight (4096 elements)
    return m


def _body(rank, world_size):
    import deepspeed
    from deepspeed.ops.quantizer import dequantize_blockwise, quantize_blockwise
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "zero_quantized_nontrainable_weights": True},
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    ref = _model()
    w0 = ref[0].weight.detach().clone()
    model = _model()
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                        if p.requires_grad], config=cfg)
    frozen = eng.module[0].weight
    acct = eng.strategy.model_state_bytes()["frozen_partitions"]
    # what each rank's partition round-trips to through the quantizer, then gathered
    s = -(-w0.numel() // world_size)     # 4096 / 2: every partition is whole, no padding
    want = torch.cat([dequantize_blockwise(*quantize_blockwise(w0.reshape(-1)[r * s:(r + 1) * s], 2048, bits=8),
                                           numel=s) for r in range(world_size)]).view_as(w0)
    # reference: plain PyTorch on the whole batch, the frozen weight replaced by its round trip
    ref[0].weight.data.copy_(want)
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=0.01)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(4):
        x, y = torch.randn(2 * world_size, 64, generator=g), torch.randn(2 * world_size, 4, generator=g)
        loss = torch.nn.functional.mse_loss(eng(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2])
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    with deepspeed.zero.GatheredParameters([frozen]):
        got = frozen.detach().clone()
    params = [p for p in eng.module.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(params):
        trained = [p.detach().clone() for p in params]
    expect = [p.detach().clone() for p in ref.parameters() if p.requires_grad]
    sd = eng.module_state_dict()
    out = {"acct": acct, "got": got, "trained": trained, "expect": expect, "want": want, "w0": w0, "losses": losses,
           "sd_frozen": sd["0.weight"].clone() if rank == 0 else None, "no_storage": frozen.ds_tensor.untyped_storage().nbytes() == 0}
    eng.destroy()
    return out


def test_frozen_weights_kept_quantized_and_trainable_layers_train():
    for r in run_distributed(_body, world_size=2, timeout=120):
        w0 = r["w0"]
        assert r["no_storage"]                       # no full-precision partition is kept
        # int8 codes for a 2048-element partition + one fp32 scale: 2052 bytes, vs 8192 in fp32
        assert r["acct"] == 2048 + 4
        assert torch.equal(r["got"], r["want"])      # exactly the quantizer's round trip
        bound = float(w0.abs().max()) / 127 / 2
        assert float((r["got"] - w0).abs().max()) <= bound + 1e-7
        if r["sd_frozen"] is not None:               # the state dict holds what the model computes with
            assert torch.equal(r["sd_frozen"], r["got"])
        for t, e in zip(r["trained"], r["expect"]):  # the trainable layers train as plain PyTorch does
            torch.testing.assert_close(t, e, rtol=1e-5, atol=1e-6)

