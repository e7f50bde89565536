"""The torch_autocast section on one process: the forward runs under torch.autocast (the same
output and gradients as plain PyTorch under torch.autocast), parameters stay fp32, and
deepspeed.runtime.torch_autocast reports the dtype gradients are reduced in."""
import torch

import deepspeed
from deepspeed.runtime.torch_autocast import get_all_comm_dtypes, get_comm_dtype, has_comm_dtype


def test_forward_under_autocast_params_fp32():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "gradient_clipping": 0.0,
        "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}},
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    x = torch.randn(2, 4)
    out = engine(x)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        want = ref(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    engine.backward(out.float().sum())
    want.float().sum().backward()
    assert engine.module.weight.dtype == torch.float32 and engine.module.weight.grad.dtype == torch.float32
    torch.testing.assert_close(engine.module.weight.grad, ref.weight.grad)
    assert not has_comm_dtype(engine.module.weight) and get_comm_dtype(engine.module.weight) == torch.float32
    assert get_all_comm_dtypes(engine.module.parameters()) == {torch.float32}
