"""Tests for deepspeed.ops optimizers against torch.optim and hand-written references."""
