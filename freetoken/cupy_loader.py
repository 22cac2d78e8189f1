"""The one place that loads CuPy: the real package, or with FREETOKEN_CUDA_EMULATE=1 the host
stand-in of freetoken/cuda_emu (an emulated device that runs cuda/*.cu on the CPU).

Every module that needs CuPy calls ``cupy()`` (or ``cupyx()``) at use, never at import, so
``import freetoken`` stays light; the variable is read at each call (sys.modules caches the real
package, so that costs a dict lookup).
"""
from __future__ import annotations

import importlib

from freetoken.env import flag


def emulated() -> bool:
    """True when FREETOKEN_CUDA_EMULATE asks for the emulated device."""
    return flag("CUDA_EMULATE")


def _load(emulate: bool, name: str):
    # no cache of our own: sys.modules is one, and tests may swap a fake cupy in there
    if emulate:
        from freetoken.cuda_emu import cupy_standin
        return cupy_standin if name == "cupy" else cupy_standin.cupyx
    return importlib.import_module(name)


def cupy():
    """The cupy module in use (raises ImportError when real CuPy is wanted and missing)."""
    return _load(emulated(), "cupy")


def cupyx():
    """The cupyx module matching cupy() (pinned allocations)."""
    return _load(emulated(), "cupyx")
