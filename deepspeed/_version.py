"""The installed version of ``deepspeed``: a leaf module (it imports nothing from the package),
so every file that reports the version reads it here instead of from the package face
(``deepspeed/__init__.py`` re-exports it as ``deepspeed.__version__``)."""
from __future__ import annotations

try:
    from importlib.metadata import version as _pkg_version
    __version__ = _pkg_version("deepspeed")
except Exception:  # running from a source tree without an install
    __version__ = "0.19.6"

from packaging.version import Version as _V  # noqa: E402

_v = _V(__version__)
__version_major__, __version_minor__, __version_patch__ = _v.major, _v.minor, _v.micro
del _v, _V
