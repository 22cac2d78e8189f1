"""Lazy numba for the kernel modules: ``njit`` compiles on first call, so importing a kernel module
never imports numba. Paired with every ``freetoken/kernels/<op>.py`` that has a numba ``cpu``.

Kernel code uses these names from here, all valid plain Python too:
  ``njit(**options)``  decorator; nested calls between lazy kernels work (callees compile first)
  ``prange``           ``range`` in Python, ``numba.prange`` inside a compiled kernel
  ``widen(v)``         bf16 bits (uint16) or any float -> float32
  ``narrow(v, arr)``   float32 -> ``arr``'s dtype: bf16 bits (round to nearest even) or float
  ``dot(x, w)``        fp32 dot of an f32 vector with a bf16/float row (the GEMV inner loop)
  ``widen_into(w, o)`` parallel bf16/float -> float32 copy (feeds BLAS on the prefill paths)
"""
import os
import threading
import types as _pytypes

import numpy as np

from freetoken.env import home

HOT = dict(parallel=True, fastmath=True, cache=True, nogil=True)  # options for bandwidth kernels
SERIAL = dict(fastmath=True, cache=True, nogil=True)              # small helpers and serial kernels

_lock = threading.RLock()
_numba = None


def prange(*args):
    """``range`` when run as Python; swapped for ``numba.prange`` when a kernel is compiled."""
    return range(*args)


def widen(v):
    """bf16 bits -> float32 (Python fallback; compiled kernels use the overload below)."""
    if isinstance(v, np.uint16):
        return np.array([int(v) << 16], np.uint32).view(np.float32)[0]
    return np.float32(v)


def narrow(v, like):
    """float32 -> the element type of ``like`` (Python fallback of the compiled overload)."""
    if like.dtype == np.uint16:
        from freetoken.kernels._bf16 import from_f32
        return from_f32(np.array([v], np.float32))[0]
    return like.dtype.type(v)


def _cache_dir_setup():
    """Numba writes its cache next to the sources; use FREETOKEN_HOME when that is read-only."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    pkg = os.path.dirname(os.path.abspath(__file__))
    if not os.access(pkg, os.W_OK):
        path = home() / "numba_cache"
        path.mkdir(parents=True, exist_ok=True)
        os.environ["NUMBA_CACHE_DIR"] = str(path)


def load_numba():
    """Import numba once (setting the cache dir first) and register the bf16 overloads."""
    global _numba
    with _lock:
        if _numba is None:
            _cache_dir_setup()
            import numba
            if os.environ.get("NUMBA_CACHE_DIR"):
                numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
            _register_overloads(numba)
            _numba = numba
    return _numba


def _register_overloads(numba):
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic, overload

    @intrinsic
    def bits_to_f32(typingctx, u):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.uint32), codegen

    @intrinsic
    def f32_to_bits(typingctx, f):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(types.float32), codegen

    @overload(widen, inline="always")
    def _widen(v):
        if v == types.uint16:
            # both shift operands uint32: a mixed shift would widen to int64 and not vectorise
            return lambda v: bits_to_f32(np.uint32(v) << np.uint32(16))
        return lambda v: np.float32(v)

    @overload(narrow, inline="always")
    def _narrow(v, like):
        if like.dtype == types.uint16:
            def to_bf16(v, like):
                bits = f32_to_bits(np.float32(v))
                if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                    return np.uint16(0x7FC0)  # NaN stays a quiet NaN (integer test: fastmath-proof)
                rne = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
                return np.uint16(rne >> np.uint32(16))
            return to_bf16
        dt = like.dtype
        return lambda v, like: dt(v)


class LazyKernel:
    """A function compiled by numba on its first call (numba itself is imported then)."""

    def __init__(self, fn, options):
        self.py_func = fn
        self.options = options
        self._disp = None
        self.__doc__, self.__name__, self.__wrapped__ = fn.__doc__, fn.__name__, fn

    def __call__(self, *args):
        disp = self._disp or self.dispatcher
        return disp(*args)

    @property
    def dispatcher(self):
        """The numba dispatcher; referenced lazy kernels and ``prange`` are resolved first."""
        if self._disp is None:
            numba = load_numba()
            with _lock:
                if self._disp is None:
                    self._disp = numba.njit(**self.options)(self._resolved(numba))
        return self._disp

    def _resolved(self, numba):
        fn = self.py_func
        glb = dict(fn.__globals__)
        for name in fn.__code__.co_names:
            val = glb.get(name)
            if isinstance(val, LazyKernel):
                glb[name] = val.dispatcher
            elif val is prange:
                glb[name] = numba.prange
        new = _pytypes.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__qualname__, new.__module__ = fn.__qualname__, fn.__module__
        return new


def njit(**options):
    """``@njit(**HOT)``: like ``numba.njit`` but compiled on first call (see module doc)."""
    def wrap(fn):
        return LazyKernel(fn, options)
    return wrap


@njit(**SERIAL)
def dot(x, w):
    """sum(x[i] * widen(w[i])) in fp32; x f32[n], w [n]. fastmath lets LLVM use vector partials."""
    acc = np.float32(0.0)
    for i in range(x.shape[0]):
        acc += x[i] * widen(w[i])
    return acc


@njit(**HOT)
def widen_into(w, out):
    """out f32[R,C] = widen(w [R,C]), parallel over rows (both C-contiguous)."""
    for r in prange(w.shape[0]):
        for c in range(w.shape[1]):
            out[r, c] = widen(w[r, c])
