"""Launched by test_stalled_rank with the deepspeed launcher: 2 ranks train a tiny model at
ZeRO stage argv[1]; at step 2 rank 1 stops itself (SIGSTOP) right before its backward, as a
hung rank would. The other rank must fail at the collective timeout naming the collective and
the step, and the launcher must take the whole job down."""
import datetime
import json
import os
import signal
import sys
import time

import torch

import deepspeed

stage, out = int(sys.argv[-2]), sys.argv[-1]
timeout_s = float(os.environ["STALL_TIMEOUT_S"])
_hook = sys.excepthook


def _note_error(*exc):   # when the error reaches the top of the script (the collective timed out)
    with open(os.path.join(out, f"error_rank{os.environ.get('RANK')}"), "w") as f:
        json.dump({"t": time.time(), "type": exc[0].__name__}, f)
    _hook(*exc)


sys.excepthook = _note_error
deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
cfg = {"train_batch_size": 4, "steps_per_print": 0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "zero_optimization": {"stage": stage}}
eng, *_ = deepspeed.initialize(model=model, config=cfg)
for step in range(4):
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    loss = torch.nn.functional.mse_loss(eng(x), y)
    if step == 2 and rank == 1:
        with open(os.path.join(out, "stalled"), "w") as f:
            json.dump({"t": time.time()}, f)
        os.kill(os.getpid(), signal.SIGSTOP)
    eng.backward(loss)
    eng.step()
