"""``deepspeed.git_version_info``: the version, git revision and op table of this install.

DeepSpeed writes this file at build time. Here the git revision is read from the
source checkout's ``.git`` files when there is one (``None`` otherwise), and the op tables are computed
on first use from the op builders: ``installed_ops`` (usable without a build step) and
``compatible_ops`` (usable on this machine) are the same thing for PyTorch-native ops.
"""
from __future__ import annotations

import os

from ._version import __version__ as version  # noqa: F401


def _read_git():
    """(short hash, branch) of the source checkout, read from .git without running git
    (every rank imports this); (None, None) for an installed package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = os.path.join(root, ".git")
    try:
        if os.path.isfile(git):  # a worktree: "gitdir: <path>"
            with open(git) as f:
                git = os.path.join(root, f.read().split(":", 1)[1].strip())
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return head[:7], "HEAD"  # detached
        ref = head.split(":", 1)[1].strip()
        branch = ref.rsplit("refs/heads/", 1)[-1]
        for base in (git, _common_dir(git)):
            path = os.path.join(base, ref)
            if os.path.isfile(path):
                with open(path) as f:
                    return f.read().strip()[:7], branch
            packed = os.path.join(base, "packed-refs")
            if os.path.isfile(packed):
                with open(packed) as f:
                    for line in f:
                        if line.rstrip().endswith(" " + ref):
                            return line.split()[0][:7], branch
        return None, branch
    except (OSError, IndexError):
        return None, None


def _common_dir(git):
    try:
        with open(os.path.join(git, "commondir")) as f:
            return os.path.normpath(os.path.join(git, f.read().strip()))
    except OSError:
        return git


git_hash, git_branch = _read_git()


def _torch_info():
    import torch
    return {"version": torch.__version__, "bf16_support": True,
            "cuda_version": torch.version.cuda or "0.0", "nccl_version": _nccl(),
            "hip_version": getattr(torch.version, "hip", None) or "0.0"}


def _nccl():
    import torch
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # no NCCL in a CPU build
        return "0.0"


_LAZY = {}


def __getattr__(name):
    if name in ("compatible_ops", "installed_ops"):
        if "ops" not in _LAZY:
            from .ops.op_builder import ALL_OPS
            _LAZY["ops"] = {op_name: b.is_compatible() for op_name, b in ALL_OPS.items()}
        return dict(_LAZY["ops"])
    if name == "torch_info":
        return _torch_info()
    raise AttributeError(f"module 'deepspeed.git_version_info' has no attribute '{name}'")
