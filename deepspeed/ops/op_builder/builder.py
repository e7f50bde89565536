"""``OpBuilder``: DeepSpeed's handle on one op, answering for PyTorch-native code.

DeepSpeed compiles each op (C++/CUDA) ahead of time or JIT and ``load()`` returns the
compiled extension. Here every op is Python over PyTorch kernels, so there is nothing
to compile: ``load()`` imports the Python module that implements the op and returns it,
and ``is_compatible()`` says whether that module exists and imports on this machine.
The check is lazy (made at call time), so a builder turns compatible as soon as the
code implementing its op lands, without touching this file.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ...utils.logging import logger

TORCH_MAJOR, TORCH_MINOR = (int(x) for x in torch.__version__.split(".")[:2])


class OpNotAvailableError(RuntimeError, ImportError):
    """``load()`` of an op this installation cannot provide. A ``RuntimeError`` as
    DeepSpeed's failed JIT load is, and an ``ImportError`` for ``try: ... except ImportError``."""


@dataclass
class PythonExtension:
    """What ``builder()`` returns: the op's description for a build system. There is no
    source to compile; ``module`` is the Python module ``load()`` imports."""
    name: str
    module: Optional[str]
    sources: List[str] = field(default_factory=list)


class OpBuilder:
    """One op. Subclasses set ``NAME`` (DeepSpeed's op name), ``MODULE`` (the Python module
    implementing it here, or ``None`` when this version has no implementation), ``FEATURE``
    (words for error messages) and optionally ``ABSENT_WHY`` (why it is not built)."""
    NAME: str = ""
    BUILD_VAR: str = ""
    MODULE: Optional[str] = None
    FEATURE: str = ""
    ABSENT_WHY: str = ""
    # DeepSpeed's absolute_name(): where its compiled extension would live.
    ABSOLUTE_NAME: str = ""

    def __init__(self, name: Optional[str] = None):
        self.name = name or self.NAME
        self._reason: Optional[str] = None

    # -- identity ----------------------------------------------------------------
    def absolute_name(self) -> str:
        return self.ABSOLUTE_NAME or f"deepspeed.ops.{self.NAME}.{self.NAME}_op"

    def sources(self) -> List[str]:
        return []  # nothing to compile

    def include_paths(self) -> List[str]:
        return []

    def cxx_args(self) -> List[str]:
        return []

    def nvcc_args(self) -> List[str]:
        return []

    def extra_ldflags(self) -> List[str]:
        return []

    def python_module(self) -> Optional[str]:
        """The Python module that implements this op here."""
        return self.MODULE

    # -- availability ------------------------------------------------------------
    def _probe(self) -> Tuple[bool, str]:
        if self.MODULE is None:
            return False, self.ABSENT_WHY or f"{self.FEATURE or self.NAME} is not implemented in this version"
        try:
            importlib.import_module(self.MODULE)
        except ImportError as err:
            return False, f"{self.FEATURE or self.NAME} ({self.MODULE}) is not available: {err}"
        return True, ""

    def is_compatible(self, verbose: bool = False) -> bool:
        ok, why = self._probe()
        self._reason = why or None
        if not ok and verbose:
            logger.warning(f"{self.name} is not compatible: {why}")
        return ok

    def load(self, verbose: bool = True):
        """The module implementing the op (DeepSpeed returns the compiled extension)."""
        ok, why = self._probe()
        if not ok:
            raise OpNotAvailableError(
                f"op '{self.NAME}' ({type(self).__name__}) is not available in this version of deepspeed: "
                f"{why}. Check {type(self).__name__}().is_compatible() before loading it.")
        return importlib.import_module(self.MODULE)

    def jit_load(self, verbose: bool = True):
        return self.load(verbose)

    def builder(self) -> PythonExtension:
        return PythonExtension(name=self.absolute_name(), module=self.MODULE)

    def warning(self, msg: str) -> None:
        logger.warning(f"{self.name}: {msg}")

    @staticmethod
    def is_rocm_pytorch() -> bool:
        return getattr(torch.version, "hip", None) is not None

    @staticmethod
    def installed_cuda_version(name: str = ""):
        v = torch.version.cuda
        if v is None:
            raise OpNotAvailableError("this PyTorch build has no CUDA (torch.version.cuda is None)")
        major, minor = v.split(".")[:2]
        return int(major), int(minor)

    @staticmethod
    def installed_rocm_version():
        """``(major, minor)`` of the ROCm this PyTorch was built with (from ``torch.version.hip``);
        ``(0, 0)`` on a build without ROCm, as DeepSpeed's OpBuilder returns."""
        hip = getattr(torch.version, "hip", None)
        if not hip:
            return 0, 0
        parts = (str(hip).split(".") + ["0"])[:2]
        return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(NAME={self.NAME!r}, module={self.MODULE!r})"


# DeepSpeed's intermediate base classes, for code that subclasses or isinstance-checks them.
class CUDAOpBuilder(OpBuilder):
    pass


class TorchCPUOpBuilder(CUDAOpBuilder):
    pass
