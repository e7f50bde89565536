"""Every optimizer in deepspeed.ops resumes from its state_dict exactly."""
import copy
import io

import pytest
import torch

from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.lamb import FusedLamb
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

from ._common import batches, compute_grads, flat, tiny_model

FACTORIES = {
    "FusedLamb": lambda ps: FusedLamb(ps, lr=1e-2, weight_decay=0.01),
    "FusedLion": lambda ps: FusedLion(ps, lr=1e-3, weight_decay=0.1),
    "DeepSpeedCPULion": lambda ps: DeepSpeedCPULion(ps, lr=1e-3),
    "DeepSpeedCPUAdagrad": lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_resume_from_state_dict_is_bit_identical(name):
    make = FACTORIES[name]
    model, data = tiny_model(), batches(5)

    def run(m, opt, chunk):
        for x, y in chunk:
            compute_grads(m, x, y)
            opt.step()

    full = copy.deepcopy(model)
    run(full, make(full.parameters()), data)
    first = copy.deepcopy(model)
    opt = make(first.parameters())
    run(first, opt, data[:2])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    resumed_opt = make(first.parameters())
    resumed_opt.load_state_dict(torch.load(buf, weights_only=True))
    run(first, resumed_opt, data[2:])
    assert torch.equal(flat(first), flat(full))
