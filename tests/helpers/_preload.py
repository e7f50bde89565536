"""Imported once by the test fork server (see dist.py): every rank forked from it starts
with torch and deepspeed already imported. Nothing here may start threads or touch a device:
a fork after that is unsafe."""
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import deepspeed  # noqa: F401
