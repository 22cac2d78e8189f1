"""Lazy numba for the kernel modules: ``njit`` compiles on first call, so importing a kernel module
never imports numba. Paired with every ``freetoken/kernels/<op>.py`` that has a numba ``cpu``.

Kernel code uses these names from here, all valid plain Python too:
  ``njit(**options)``  decorator; nested calls between lazy kernels work (callees compile first)
  ``prange``           ``range`` in Python, ``numba.prange`` inside a compiled kernel
  ``widen(v)``         bf16 bits (uint16) or any float -> float32
  ``from_bits(u)``     uint32 bit pattern -> float32 (a bitcast); ``to_bits(f)`` the other way
  ``narrow(v, arr)``   float32 -> ``arr``'s dtype: bf16 bits (round to nearest even) or float
and the GEMV inner loops shared by linear, experts and attention (see "row dot products").
"""
import os
import threading
import types as _pytypes
import zlib

import numpy as np

from freetoken.env import home

# error_model="numpy": a float division by zero gives inf or NaN, as the numpy ref does, where
# numba's default raised ZeroDivisionError (rms_norm.cpu on a row holding inf did: a model whose
# activations overflow got an exception instead of ref's answer)
HOT = dict(parallel=True, fastmath=True, cache=True, nogil=True, error_model="numpy")  # bandwidth kernels
SERIAL = dict(fastmath=True, cache=True, nogil=True, error_model="numpy")  # small helpers, serial kernels
# fastmath less nnan and ninf, for kernels with a written rule for non-finite inputs (ref's):
# under those two LLVM may assume NaN and inf away (an exp of a NaN score came out 0, 1/sqrt(inf)
# NaN, a NaN flush test and a test for a NaN sum were folded)
NAN_SAFE_MATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
HOT_NAN_SAFE = dict(HOT, fastmath=NAN_SAFE_MATH)
SERIAL_NAN_SAFE = dict(SERIAL, fastmath=NAN_SAFE_MATH)

# the files whose overloads any kernel may inline, and _isa.py (its weight_prefetch picks what
# _simd_ir emits): part of every kernel's cache stamp (below)
_OVERLOAD_SOURCES = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
                          for name in ("_numba.py", "_simd.py", "_simd_ir.py", "_simd_int8.py",
                                        "_simd_int8_low.py", "_simd_interleave.py", "_simd_itile.py", "_simd_igemm.py", "_simd_bf16.py",
                                        "_simd_attn.py", "_isa.py", "qlayout.py"))

_lock = threading.RLock()
_numba = None
_kernels: list = []      # every LazyKernel made (kernel modules make them at import, a few dozen)


def prange(*args):
    """``range`` when run as Python; swapped for ``numba.prange`` when a kernel is compiled."""
    return range(*args)


def widen(v):
    """bf16 bits -> float32 (Python fallback; compiled kernels use the overload below)."""
    if isinstance(v, np.uint16):
        return np.array([int(v) << 16], np.uint32).view(np.float32)[0]
    return np.float32(v)


def from_bits(u):
    """uint32 bit pattern -> float32 (Python fallback of the compiled bitcast)."""
    return np.array([u], np.uint32).view(np.float32)[0]


def to_bits(f):
    """float32 -> its uint32 bit pattern (Python fallback of the compiled bitcast)."""
    return np.array([f], np.float32).view(np.uint32)[0]


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
    """Import numba once (setting the cache dir first) and register the bf16 overloads and the
    vector row dots (kernels/_simd.py)."""
    global _numba
    with _lock:
        if _numba is None:
            _cache_dir_setup()
            import numba
            if os.environ.get("NUMBA_CACHE_DIR"):
                numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
            _register_overloads(numba)
            from freetoken.kernels import _simd
            _simd.register(numba)
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

    overload(from_bits, inline="always")(lambda u: lambda u: bits_to_f32(np.uint32(u)))

    def by_row_type(pairs, plain):
        return lambda w: pairs if w.dtype == types.uint32 else plain

    overload(dot)(lambda xs, w: by_row_type(_dot_pairs, _dot_plain)(w))
    overload(dot4)(lambda xs, t0, t1, t2, t3, w: by_row_type(_dot4_pairs, _dot4_plain)(w))
    overload(axpy)(lambda a, w, acc: by_row_type(_axpy_pairs, _axpy_plain)(w))
    # an overload inlined at numba IR level: a call into another compiled function costs each
    # row a call and reference counting of its array views (measured ~15% of a 1 KB row)
    overload(dots, inline="always")(lambda xs, toks, w, res: dots)

    overload(to_bits, inline="always")(lambda f: lambda f: f32_to_bits(np.float32(f)))

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
        self.sources = set()  # files whose code this kernel compiles in (set when resolved)
        self.__doc__, self.__name__, self.__wrapped__ = fn.__doc__, fn.__name__, fn
        _kernels.append(self)

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
        self.sources = {fn.__code__.co_filename, *_OVERLOAD_SOURCES}
        for name in fn.__code__.co_names:
            val = glb.get(name)
            if isinstance(val, LazyKernel):
                glb[name] = val.dispatcher
                self.sources |= val.sources
            elif val is prange:
                glb[name] = numba.prange
        new = _pytypes.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)
        # numba's cache only checks the kernel's own file; naming the cache entry after the
        # state of every file it inlines from keeps an edited helper from loading stale code
        stamp = ";".join(f"{p}:{os.stat(p).st_mtime_ns}:{os.stat(p).st_size}"
                         for p in sorted(self.sources))
        new.__qualname__ = f"{fn.__qualname__}.v{zlib.crc32(stamp.encode()):08x}"
        new.__module__ = fn.__module__
        return new


def in_use() -> list:
    """The dispatchers of the kernels this process has run (compiled here or loaded from cache)."""
    return [k._disp for k in _kernels if k._disp is not None and k._disp.overloads]


def njit(**options):
    """``@njit(**HOT)``: like ``numba.njit`` but compiled on first call (see module doc)."""
    def wrap(fn):
        return LazyKernel(fn, options)
    return wrap


# ---- row dot products: the GEMV inner loops -----------------------------------------------------
# A bf16 row of even length K is read as K/2 uint32 pairs: the low half is the even element, the
# high half the odd one (little endian), so widening costs one shift or one mask per element and
# no shuffles; the activations are then stored split into even and odd halves, xs [T, 2, K/2].
# Every other row (fp32, or bf16 of odd length) is read element by element with xs [T, 1, K].
# Measured on the 2-core dev box: 1.8x the in-cache throughput of zero-extend-and-shift.

def weight_rows(w):
    """The view of a weight array [.., K] the row dots read (see the comment above)."""
    if w.dtype == np.uint16 and w.shape[-1] % 2 == 0 and w.flags.c_contiguous:
        return w.view(np.uint32)
    return w


def split_x(x, rows):
    """x f32[..,K] -> xs f32[..,L,K/L], the activation layout for weight rows ``rows``:
    xs[.., l, i] = x[.., i*L + l]."""
    x = np.asarray(x, np.float32)
    if rows.dtype == np.uint32:
        return np.ascontiguousarray(x.reshape(*x.shape[:-1], -1, 2).swapaxes(-1, -2))
    return np.ascontiguousarray(x).reshape(*x.shape[:-1], 1, x.shape[-1])


def _dot_plain(xs, w):
    x = xs[0]
    acc = np.float32(0.0)
    for i in range(w.shape[0]):
        acc += x[i] * widen(w[i])
    return acc


def _dot_pairs(xs, w):
    xe, xo = xs[0], xs[1]
    ae = np.float32(0.0)
    ao = np.float32(0.0)
    for i in range(w.shape[0]):
        ae += xe[i] * from_bits(w[i] << np.uint32(16))
        ao += xo[i] * from_bits(w[i] & np.uint32(0xFFFF0000))
    return ae + ao


def _dot4_plain(xs, t0, t1, t2, t3, w):
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for i in range(w.shape[0]):
        v = widen(w[i])
        a0 += xs[t0, 0, i] * v
        a1 += xs[t1, 0, i] * v
        a2 += xs[t2, 0, i] * v
        a3 += xs[t3, 0, i] * v
    return a0, a1, a2, a3


def _dot4_pairs(xs, t0, t1, t2, t3, w):
    # four tokens share each widened weight: 8 independent FMA chains, one weight load
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    for i in range(w.shape[0]):
        ve = from_bits(w[i] << np.uint32(16))
        vo = from_bits(w[i] & np.uint32(0xFFFF0000))
        a0 += xs[t0, 0, i] * ve
        b0 += xs[t0, 1, i] * vo
        a1 += xs[t1, 0, i] * ve
        b1 += xs[t1, 1, i] * vo
        a2 += xs[t2, 0, i] * ve
        b2 += xs[t2, 1, i] * vo
        a3 += xs[t3, 0, i] * ve
        b3 += xs[t3, 1, i] * vo
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


def dot(xs, w):
    """fp32 dot of one activation xs f32[L,K/L] with one weight row w (layouts above)."""
    return (_dot_pairs if w.dtype == np.uint32 else _dot_plain)(xs, w)


def dot4(xs, t0, t1, t2, t3, w):
    """Four dots at once: (dot(xs[t0], w), ..., dot(xs[t3], w)), xs f32[T,L,K/L]."""
    return (_dot4_pairs if w.dtype == np.uint32 else _dot4_plain)(xs, t0, t1, t2, t3, w)


def _axpy_plain(a, w, acc):
    for i in range(w.shape[0]):
        acc[0, i] += a * widen(w[i])


def _axpy_pairs(a, w, acc):
    for i in range(w.shape[0]):
        acc[0, i] += a * from_bits(w[i] << np.uint32(16))
        acc[1, i] += a * from_bits(w[i] & np.uint32(0xFFFF0000))


def axpy(a, w, acc):
    """acc f32[L,K/L] += a * row w, in the split layout of ``split_x``."""
    (_axpy_pairs if w.dtype == np.uint32 else _axpy_plain)(a, w, acc)


def dots(xs, toks, w, res):
    """res[j] = dot(xs[toks[j]], w) for every j; xs f32[T,L,K/L], toks int32[n], res f32[>=n]."""
    n4 = toks.shape[0] // 4 * 4
    for j in range(0, n4, 4):
        res[j], res[j + 1], res[j + 2], res[j + 3] = dot4(
            xs, toks[j], toks[j + 1], toks[j + 2], toks[j + 3], w)
    for j in range(n4, toks.shape[0]):
        res[j] = dot(xs[toks[j]], w)

