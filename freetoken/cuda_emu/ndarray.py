"""cupy.ndarray of the emulated device: a numpy view over device memory whose every operation is
a closure on the current stream (streams.py), so data appear only when the stream is forced.

Views (basic indexing, reshape of contiguous data, .view, .T) share memory and cost nothing.
Anything that computes runs later, at the stream's pace; a result's shape and dtype come from a dry
run of the same numpy call on zeros. Reading values on the host (.get(), item(), int(), bool(),
repr, data-dependent shapes such as boolean masks) synchronises the current stream and checks that
no never-written (poison) word is read back. Mixing host numpy arrays into device arithmetic is a
TypeError, as in CuPy; np.asarray(device_array) is too.
"""
from __future__ import annotations

import numbers
import operator

import numpy as np

from freetoken.cuda_emu import hazards, memory
from freetoken.cuda_emu.deferred import deferred, enqueue, from_host, sync_current
from freetoken.cuda_emu.pools import MemoryPointer, _Raw, allocate
from freetoken.cuda_emu.streams import get_current_stream


class ndarray:
    """cupy.ndarray over emulated device memory."""

    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        dtype = np.dtype(dtype)
        shape = (int(shape),) if isinstance(shape, numbers.Integral) else tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if memptr is None:
            memptr = allocate(nbytes, f"{dtype.name}{list(shape)}")
            memptr.mem.itemsize = dtype.itemsize      # the width a copy-back checks poison at
        extent = nbytes if strides is None else _extent(shape, strides, dtype.itemsize)
        buf = memory.host_view(memptr.ptr, extent)
        self._a = np.ndarray(shape, dtype, buffer=buf, strides=strides, order=order) if extent else \
            np.empty(shape, dtype)
        self._owner = memptr

    @classmethod
    def _wrap(cls, view: np.ndarray, owner) -> "ndarray":
        obj = cls.__new__(cls)
        obj._a, obj._owner = view, owner
        return obj

    # -- metadata ----------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    device = property(lambda self: _device0())

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(_Raw(self._a.ctypes.data if self._a.size else self._owner.ptr), 0)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    # -- views -------------------------------------------------------------------------------
    def _view(self, v: np.ndarray) -> "ndarray":
        return ndarray._wrap(v, self._owner)

    def view(self, dtype=None) -> "ndarray":
        return self._view(self._a.view() if dtype is None else self._a.view(dtype))

    def reshape(self, *shape, order="C"):
        shape = shape[0] if len(shape) == 1 and not isinstance(shape[0], numbers.Integral) else shape
        v = self._a.reshape(shape, order=order)
        if np.may_share_memory(v, self._a) or v.size == 0:
            return self._view(v)
        return deferred("reshape", lambda a: a.reshape(shape, order=order), (self,))

    def ravel(self, order="C"):
        return self.reshape(-1, order=order)

    def transpose(self, *axes):
        return self._view(self._a.transpose(*axes))

    T = property(lambda self: self.transpose())

    def __getitem__(self, key):
        key = _host_index(key)
        if _basic(key):
            return self._view(self._a[key])
        if _bool_key(key):
            sync_current("boolean-mask indexing")
            return from_host(self._a[_real(key)])
        return deferred("take (advanced indexing)", operator.getitem, (self, key))

    def __setitem__(self, key, value) -> None:
        key, value = _host_index(key), _h2d_source(value, "setitem")
        enqueue("setitem", lambda: self._a.__setitem__(_real(key), _real(value)), (key, value), (self,))

    # -- host reads (synchronise) ---------------------------------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True):
        sync_current("ndarray.get()", stream)
        memory.check_written(self._a, "ndarray.get()", _site(self))
        host = np.array(self._a, order=order)
        if out is not None:
            np.copyto(out, host)
            return out
        return host

    def set(self, arr, stream=None) -> None:
        arr = np.asarray(arr)
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"Shape or dtype mismatch: device {self.shape} {self.dtype}, host "
                             f"{arr.shape} {arr.dtype}")
        src = _h2d_source(arr, "ndarray.set()")
        (stream or get_current_stream()).enqueue(lambda: np.copyto(self._a, _real(src)), "ndarray.set",
                                                 hazards.arrays_ranges((src,), (self,)))

    def item(self):
        return self.get().item()

    def tolist(self):
        return self.get().tolist()

    def __int__(self):
        return int(self.item())

    def __float__(self):
        return float(self.item())

    def __index__(self):
        return operator.index(self.item())

    def __bool__(self):
        return bool(self.item())

    def __array__(self, *args, **kw):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` "
                        "to construct a NumPy array explicitly. (emulated CuPy)")

    def __repr__(self) -> str:
        """The values when they are readable now; never raises (debuggers call repr)."""
        try:
            return f"emulated_cupy.{self.get()!r}"
        except Exception as e:
            return f"<emulated cupy.ndarray {self.dtype}{list(self.shape)}: {e}>"

    # -- compute --------------------------------------------------------------------------------
    def copy(self, order="C"):
        return deferred("copy", lambda a: np.array(a, order=order), (self,))

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return deferred("astype", lambda a: a.astype(dtype, order=order), (self,))

    def fill(self, value) -> None:
        enqueue("fill", lambda: self._a.fill(value), (), (self,))

    def __getattr__(self, name):
        raise AttributeError(f"the emulated cupy.ndarray does not implement .{name} "
                             "(freetoken/cuda_emu/ndarray.py lists what it has)")


def _reducer(name):
    def method(self, *args, **kw):
        return deferred(f"ndarray.{name}", lambda a, *r: getattr(a, name)(*r, **kw), (self,) + args)
    method.__name__ = name
    return method


for _n in ("sum", "max", "min", "any", "all", "argmax", "argmin", "mean", "cumsum", "prod",
           "squeeze", "flatten", "clip", "round"):
    setattr(ndarray, _n, _reducer(_n))


def _binary(op, name):
    def forward(self, other):
        return deferred(name, op, (self, other))

    def reflected(self, other):
        return deferred(name, lambda a, b: op(b, a), (self, other))

    def inplace(self, other):
        enqueue(f"{name} (in place)", lambda: self._a.__setitem__(Ellipsis, op(self._a, _real(other))),
                (self, other), (self,))
        return self
    return forward, reflected, inplace


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv),
                   ("mod", operator.mod), ("pow", operator.pow), ("and", operator.and_),
                   ("or", operator.or_), ("xor", operator.xor), ("lshift", operator.lshift),
                   ("rshift", operator.rshift), ("matmul", operator.matmul)):
    _f, _r, _i = _binary(_op, _name)
    setattr(ndarray, f"__{_name}__", _f)
    setattr(ndarray, f"__r{_name}__", _r)
    setattr(ndarray, f"__i{_name}__", _i)
for _name, _op in (("lt", operator.lt), ("le", operator.le), ("gt", operator.gt),
                   ("ge", operator.ge), ("eq", operator.eq), ("ne", operator.ne)):
    setattr(ndarray, f"__{_name}__", _binary(_op, _name)[0])
for _name, _op in (("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs),
                   ("invert", operator.invert)):
    setattr(ndarray, f"__{_name}__", (lambda op, nm: lambda self: deferred(nm, op, (self,)))(_op, _name))
ndarray.__hash__ = None


# --- the machinery ---------------------------------------------------------------------------

def _device0():
    from freetoken.cuda_emu.runtime import Device
    return Device(0)


def _extent(shape, strides, itemsize) -> int:
    if any(s == 0 for s in shape):
        return 0
    return sum((n - 1) * abs(st) for n, st in zip(shape, strides)) + itemsize


def _site(a: ndarray) -> str:
    site = getattr(getattr(a._owner, "mem", None), "site", None)
    return site or "memory not allocated by the emulated device"


def _basic(key) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (slice, numbers.Integral)) and
               not isinstance(k, (bool, np.bool_)) for k in keys)


def _host_index(key):
    """Host index arrays (CuPy copies them to the device) travel as snapshots."""
    if isinstance(key, tuple):
        return tuple(_host_index(k) for k in key)
    if isinstance(key, (np.ndarray, list)) and not isinstance(key, ndarray):
        return _PinnedSource(np.array(key))
    return key


def _bool_key(key) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, ndarray) and k.dtype == np.bool_ for k in keys)


def _real(x):
    """Arguments as the numpy the closure computes on: device arrays -> their views."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, tuple):
        return tuple(_real(v) for v in x)
    if isinstance(x, list):
        return [_real(v) for v in x]
    if isinstance(x, np.ndarray):
        raise TypeError(f"Unsupported type {type(x)} (a host numpy array in a device operation; "
                        "emulated CuPy rejects it as CuPy does)")
    return x


def _meta(x):
    """Zeros of the same shape and dtype: the dry run that sizes a deferred result."""
    if isinstance(x, ndarray):
        return np.zeros(x.shape, x.dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_meta(v) for v in x)
    return _real(x)


def _h2d_source(value, what: str):
    """A host array about to be copied to the device: snapshotted unless it is pinned memory,
    which an async copy really reads when it runs."""
    if not isinstance(value, np.ndarray):
        return value
    if memory.is_pinned(value.ctypes.data):
        return _PinnedSource(value)
    stream = get_current_stream()
    if stream.is_capturing():
        from freetoken.cuda_emu.memory import CaptureError
        raise CaptureError(f"{what}: a copy from pageable host memory during graph capture")
    return _PinnedSource(value.copy())


class _PinnedSource(ndarray):
    """A host array passed through to the closure as-is (read when the copy runs)."""

    def __init__(self, host: np.ndarray):
        self._a, self._owner = host, None


