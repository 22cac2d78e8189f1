"""The stand-in for CuPy that FREETOKEN_CUDA_EMULATE=1 swaps in (freetoken/cupy_loader.py is the
only place that chooses): host memory plays device memory and cuda/*.cu runs on the CPU.

The slice of CuPy it implements (anything else raises AttributeError naming the call at once):
- ``ndarray`` (ndarray.py): shape/dtype/strides/flags/size/nbytes, ``.data.ptr``, ``.get()``,
  ``.set()``, basic-index views, advanced-index gathers, ``__setitem__``, ``reshape``/``ravel``/
  ``view``/``T``, ``copy``, ``astype``, ``fill``, arithmetic and comparisons (also in place),
  ``sum``/``max``/``min``/``any``/``all``/``argmax``/``argmin``/``mean``/``cumsum``, ``item``,
  ``int()``/``float()``/``bool()``; ``ndarray(shape, dtype, memptr)`` over any memory pointer.
- creation: ``empty``, ``zeros``, ``ones``, ``full``, their ``*_like``, ``arange``, ``asarray``,
  ``array``, ``ascontiguousarray``, ``asnumpy``; numpy-style functions in DEFERRED (run on the
  stream) and SYNCHRONISING (data-dependent shapes: they synchronise the current stream).
- ``random``: ``randint``, ``random``, ``rand``, ``randn``, ``standard_normal``, ``uniform``,
  ``normal``, ``seed``.
- ``cuda``: ``Stream`` (``null``, ``non_blocking``, context manager, ``synchronize``,
  ``wait_event``, ``record``, ``begin_capture``/``end_capture``/``is_capturing``, ``ptr``),
  ``Event`` (``record``, ``synchronize``, ``query``), ``get_elapsed_time``, ``Graph.launch``,
  ``Device`` (``id``, ``synchronize``), ``get_current_stream``, ``MemoryPool``, ``using_allocator``,
  ``set_allocator``, ``PinnedMemory``, ``PinnedMemoryPointer``, ``alloc_pinned_memory``,
  ``MemoryPointer``, ``UnownedMemory``, ``memory.OutOfMemoryError``, ``runtime`` (runtime.py:
  ``memGetInfo`` with a configurable size, ``getDeviceCount``, ``getDeviceProperties``,
  ``deviceGetAttribute``, ``memcpyAsync``, ``hostRegister``/``hostUnregister``).
- ``RawModule(code=, options=)`` / ``RawKernel``: launch with the real grid, block and dynamic
  shared memory (kernels.py, device_code.py).
- ``get_default_memory_pool``, ``get_default_pinned_memory_pool``, ``get_array_module``;
  ``cupyx.zeros_pinned`` / ``cupyx.empty_pinned``.
"""
from __future__ import annotations

import numbers

import numpy as np

from freetoken.cuda_emu import memory, pools, runtime as _runtime, streams
from freetoken.cuda_emu.hazards import declared as _declared_touches  # noqa: F401 (kernels/_cuda.launch)
from freetoken.cuda_emu.kernels import RawKernel, RawModule
from freetoken.cuda_emu.deferred import deferred, enqueue, from_host, sync_current
from freetoken.cuda_emu.ndarray import _real, ndarray
from freetoken.cuda_emu.pools import MemoryPointer, UnownedMemory

__version__ = "13.6.0+freetoken-emulated"

for _t in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
           "uint32", "uint64", "bool_", "complex64", "intp", "dtype", "newaxis", "inf", "nan", "pi",
           "e", "float_", "integer", "floating", "number", "generic"):
    if hasattr(np, _t):
        globals()[_t] = getattr(np, _t)


class _Namespace:
    """A sub-namespace (cupy.cuda, cupy.random, ...) whose missing names fail loudly."""

    def __init__(self, name: str, **members):
        self._name = name
        self.__dict__.update(members)

    def __getattr__(self, attr):
        raise AttributeError(f"the emulated CuPy does not implement {self._name}.{attr} "
                             "(freetoken/cuda_emu/cupy_standin.py lists the slice it has)")


# --- creation ----------------------------------------------------------------------------------

def _shape(shape):
    return (int(shape),) if isinstance(shape, numbers.Integral) else tuple(shape)


def empty(shape, dtype=float, order="C"):
    return ndarray(_shape(shape), dtype, order=order)


def full(shape, fill_value, dtype=None, order="C"):
    dtype = np.asarray(fill_value).dtype if dtype is None else dtype
    a = ndarray(_shape(shape), dtype, order=order)
    a.fill(fill_value)
    return a


def zeros(shape, dtype=float, order="C"):
    return full(shape, 0, dtype, order)


def ones(shape, dtype=float, order="C"):
    return full(shape, 1, dtype, order)


def empty_like(a, dtype=None, order="K", shape=None):
    return empty(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def zeros_like(a, dtype=None, order="K", shape=None):
    return zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def ones_like(a, dtype=None, order="K", shape=None):
    return ones(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)


def full_like(a, fill_value, dtype=None, order="K", shape=None):
    return full(a.shape if shape is None else shape, fill_value, a.dtype if dtype is None else dtype)


def arange(start, stop=None, step=1, dtype=None):
    return deferred("arange", lambda: np.arange(start, stop, step, dtype=dtype) if stop is not None
                    else np.arange(start, dtype=dtype), ())


def asarray(a, dtype=None, order=None, *, blocking=False):
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    if streams.get_current_stream().is_capturing():
        raise memory.CaptureError("cupy.asarray of host data during graph capture (a pageable copy)")
    return from_host(np.asarray(a, dtype=dtype))


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        out = obj.astype(dtype or obj.dtype) if copy else asarray(obj, dtype)
        return out
    return asarray(np.array(obj, dtype=dtype, ndmin=ndmin))


def ascontiguousarray(a, dtype=None):
    if isinstance(a, ndarray):
        if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return deferred("ascontiguousarray", lambda x: np.ascontiguousarray(x, dtype=dtype), (a,))
    return asarray(np.ascontiguousarray(a, dtype=dtype))


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out)
    return np.asarray(a, order=order)


def copyto(dst, src, casting="same_kind", where=None) -> None:
    enqueue("copyto", lambda: np.copyto(dst._a, _real(src), casting=casting), (src,), (dst,))


def get_array_module(*args):
    import sys
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


# --- numpy-style functions ------------------------------------------------------------------------

DEFERRED = ("concatenate", "stack", "hstack", "vstack", "take", "maximum", "minimum", "exp", "log",
            "sqrt", "abs", "absolute", "isnan", "isfinite", "isinf", "sum", "max", "min", "amax",
            "amin", "argmax", "argmin", "argsort", "sort", "cumsum", "clip", "any", "all",
            "allclose", "array_equal", "dot", "matmul", "einsum", "count_nonzero", "add",
            "subtract", "multiply", "divide", "negative", "square", "tanh", "sign", "floor",
            "ceil", "round", "logical_and", "logical_or", "logical_not", "equal", "not_equal",
            "less", "greater", "less_equal", "greater_equal", "broadcast_to",
            "repeat", "tile", "flip", "expand_dims", "squeeze", "transpose", "mean", "prod")
SYNCHRONISING = ("unique", "nonzero", "argwhere", "flatnonzero", "bincount")


def _deferred_fn(name):
    fn = getattr(np, name)
    return lambda *args, **kw: deferred(f"cupy.{name}", fn, args, kw)


def _sync_fn(name):
    fn = getattr(np, name)

    def call(*args, **kw):
        sync_current(f"cupy.{name}")
        result = fn(*_real(args), **_real(kw))
        return tuple(from_host(r) for r in result) if isinstance(result, tuple) else from_host(result)
    return call


for _n in DEFERRED:
    if hasattr(np, _n):
        globals()[_n] = _deferred_fn(_n)
for _n in SYNCHRONISING:
    globals()[_n] = _sync_fn(_n)


def where(cond, x=None, y=None):
    if x is None and y is None:
        return nonzero(cond)
    return deferred("cupy.where", np.where, (cond, x, y))


# --- random ---------------------------------------------------------------------------------------

_rng = [np.random.default_rng(0)]


def _random(name, make):
    def call(*args, **kw):
        return from_host(np.asarray(make(_rng[0], *args, **kw)))
    call.__name__ = name
    return call


random = _Namespace(
    "cupy.random",
    seed=lambda s=None: _rng.__setitem__(0, np.random.default_rng(s)),
    randint=_random("randint", lambda g, low, high=None, size=None, dtype=int:
                    g.integers(low, high, size=size, dtype=dtype) if high is not None
                    else g.integers(0, low, size=size, dtype=dtype)),
    random=_random("random", lambda g, size=None, dtype=np.float64: g.random(size, dtype=dtype)),
    rand=_random("rand", lambda g, *shape: g.random(shape)),
    randn=_random("randn", lambda g, *shape: g.standard_normal(shape)),
    standard_normal=_random("standard_normal", lambda g, size=None, dtype=np.float64:
                            g.standard_normal(size, dtype=dtype)),
    uniform=_random("uniform", lambda g, low=0.0, high=1.0, size=None, dtype=np.float64:
                    g.uniform(low, high, size).astype(dtype)),
    normal=_random("normal", lambda g, loc=0.0, scale=1.0, size=None, dtype=np.float64:
                   g.normal(loc, scale, size).astype(dtype)),
)

# --- cuda -----------------------------------------------------------------------------------------

cuda = _Namespace(
    "cupy.cuda",
    Stream=streams.Stream, Event=streams.Event, Graph=streams.Graph, Device=_runtime.Device,
    get_current_stream=streams.get_current_stream, get_elapsed_time=streams.get_elapsed_time,
    MemoryPool=pools.MemoryPool, PinnedMemoryPool=pools.PinnedMemoryPool,
    using_allocator=pools.using_allocator, set_allocator=pools.set_allocator,
    PinnedMemory=memory.PinnedMemory, PinnedMemoryPointer=memory.PinnedMemoryPointer,
    alloc_pinned_memory=memory.alloc_pinned_memory, MemoryPointer=MemoryPointer,
    UnownedMemory=UnownedMemory, runtime=_runtime, is_available=lambda: True,
    memory=_Namespace("cupy.cuda.memory", OutOfMemoryError=memory.OutOfMemoryError),
    get_device_id=lambda: 0,
)
get_default_memory_pool = pools.get_default_memory_pool
get_default_pinned_memory_pool = pools.get_default_pinned_memory_pool


def _pinned(shape, dtype=float, order="C", fill=None):
    dtype, shape = np.dtype(dtype), _shape(shape)
    n = int(np.prod(shape, dtype=np.int64))
    mem = memory.PinnedMemory(n * dtype.itemsize)
    out = np.frombuffer(memory.PinnedMemoryPointer(mem, 0), dtype, n).reshape(shape, order=order)
    if fill is not None:
        out[...] = fill
    return out


cupyx = _Namespace("cupyx", empty_pinned=lambda shape, dtype=float, order="C": _pinned(shape, dtype, order),
                   zeros_pinned=lambda shape, dtype=float, order="C": _pinned(shape, dtype, order, 0))


def __getattr__(name):
    raise AttributeError(f"the emulated CuPy does not implement cupy.{name} "
                         "(freetoken/cuda_emu/cupy_standin.py lists the slice it has)")
