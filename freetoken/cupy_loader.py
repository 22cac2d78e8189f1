"""The one place that loads CuPy: the real package, or with FREETOKEN_CUDA_EMULATE=1 the host
stand-in of freetoken/cuda_emu (an emulated device that runs cuda/*.cu on the CPU).

Every module that needs CuPy calls ``cupy()`` (or ``cupyx()``) at use, never at import, so
``import freetoken`` stays light and a process decides real vs emulated once, on first use.
"""
from __future__ import annotations

import functools

from freetoken.env import flag


def emulated() -> bool:
    """True when FREETOKEN_CUDA_EMULATE asks for the emulated device."""
    return flag("CUDA_EMULATE")


@functools.cache
def _load(emulate: bool):
    if emulate:
        from freetoken.cuda_emu import cupy_standin
        return cupy_standin, cupy_standin.cupyx
    import cupy as real
    import cupyx as real_x
    return real, real_x


def cupy():
    """The cupy module in use (raises ImportError when real CuPy is wanted and missing)."""
    return _load(emulated())[0]


def cupyx():
    """The cupyx module matching cupy() (pinned allocations)."""
    return _load(emulated())[1]
