"""The one CUDA loader: builds each RawModule from cuda/<name>.cu once per process, launches
kernels, and compiles to PTX through NVRTC without a GPU (the CI compile test).

CuPy is imported lazily inside functions: importing this module never touches CUDA.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
from pathlib import Path

import numpy as np

from freetoken.env import flag
from freetoken.cupy_loader import cupy as load_cupy
from freetoken.device_limits import cuda_dir

# What a declared argument type in an ``ARGS`` table means: array dtype for pointers, the exact
# numpy scalar type for values (a Python int would be passed as int64 and misread as int32).
POINTER_DTYPES = {"f32*": np.float32, "u16*": np.uint16, "i32*": np.int32, "u32*": np.uint32,
                  "i64*": np.int64, "u8*": np.uint8}
SCALAR_TYPES = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "f32": np.float32}


# --- sources ---------------------------------------------------------------------------------

def read_source(path) -> str:
    """The file's text behind a #line directive, so compiler errors name the real file."""
    path = Path(path).resolve()
    return f'#line 1 "{path}"\n' + path.read_text()


def header_key(folder) -> str:
    """A digest of every .cuh header beside the sources. CuPy's kernel disk cache keys on the code
    text alone, so the module text carries this digest: an edited header means a new binary."""
    digest = hashlib.sha256()
    for h in sorted(Path(folder).glob("*.cuh")):
        digest.update(h.name.encode() + b"\0" + h.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def module_source(path) -> str:
    """read_source plus the header digest as a trailing comment (what RawModule compiles)."""
    path = Path(path).resolve()
    return read_source(path) + f"\n// freetoken headers {header_key(path.parent)}\n"


# CuPy's compiler appends these to every RawModule's options (cupy/cuda/compiler.py): f32
# subnormals are zero on the device (an H200 zeroed the subnormal MXFP4 scales that the
# emulator kept). Offline compiles (_nvrtc.py: launch limits, PTX checks) add them too, so they
# build what CuPy loads; the emulated device flushes f32 subnormals during a launch
# (cuda_emu/emu/launch.cpp).
CUPY_APPENDED_OPTIONS = ("-ftz=true",)


def compile_options(include_dir) -> tuple[str, ...]:
    opts = ("-std=c++17", f"-I{include_dir}")
    return opts + ("-lineinfo",) if flag("KERNEL_DEBUG") else opts


# --- CuPy modules and launches ---------------------------------------------------------------

@functools.cache
def module(name: str, defines: tuple[str, ...] = ()):
    """The RawModule of cuda/<name>.cu built with ``defines`` ("-DQFMT=7", ...), once per process
    (CuPy also caches on disk)."""
    cupy = load_cupy()
    d = cuda_dir()
    return cupy.RawModule(code=module_source(d / f"{name}.cu"), options=compile_options(d) + tuple(defines))


@functools.cache
def kernel(name: str, entry: str, defines: tuple[str, ...] = ()):
    """Entry point ``entry`` of cuda/<name>.cu (built with ``defines``)."""
    return module(name, defines).get_function(entry)


def quant_defines(w) -> tuple[str, ...]:
    """The defines of a *_quant.cu / qblocks.cu module for the quantized weight ``w``'s format: each
    format is its own module, built when a model first uses it (cuda/qblocks.cuh)."""
    from freetoken.kernels.qformats import format_of
    return (f"-DQFMT={format_of(w).code}",)


def flat_span(a):
    """``a`` as one contiguous 1-D array of its dtype from its first element to its last, for a
    kernel that takes the strides itself: an expert-slot view of a pool shared by layers of
    several formats (moe/pool.slot_views; each slot contiguous, the slots a stride apart), or some
    columns of a matrix (a part of a weight writing its columns). Contiguous ``a``: a.reshape(-1)."""
    if a.flags.c_contiguous:
        return a.reshape(-1)
    assert a[0].flags.c_contiguous and a.strides[0] > 0, (a.shape, a.strides)   # only axis 0 strided
    cupy = load_cupy()
    span = sum((n - 1) * s for n, s in zip(a.shape, a.strides)) // a.itemsize + 1
    return cupy.ndarray((span,), a.dtype, memptr=a.data)


def launch(kern, grid, block, args, shared_mem=0, touches=()) -> None:
    """Launch on the current stream. With FREETOKEN_SYNC_LAUNCH set, wait for the kernel and
    re-raise its error naming it (asynchronous errors otherwise surface at a later call);
    skipped while a CUDA graph is being captured, where synchronising is illegal. An empty
    grid (no rows) launches nothing: CUDA rejects a zero grid dimension. ``touches``: (array,
    written) pairs that say which part of a wider argument (a whole pool's flat_span) the launch
    really reads and writes, for the emulated device's cross-stream hazard check; a GPU ignores
    them."""
    if 0 in tuple(grid):
        return
    entry = getattr(kern, "name", repr(kern))
    declared = getattr(load_cupy(), "_declared_touches", None) if touches else None
    try:
        with declared(touches) if declared is not None else contextlib.nullcontext():
            kern(tuple(grid), tuple(block), tuple(args), shared_mem=int(shared_mem))
    except Exception as e:
        raise RuntimeError(f"launch of kernel {entry} failed: {e}") from e
    if flag("SYNC_LAUNCH"):
        cupy = load_cupy()
        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing():
            return
        try:
            stream.synchronize()
        except Exception as e:
            raise RuntimeError(f"kernel {entry} failed: {e}") from e


def bind(decl, **values) -> tuple:
    """Arguments in the order of ``decl`` (an ``ARGS`` entry such as ("x:f32*", "H:i32")),
    checking each array's dtype and contiguity and casting each scalar to its exact type."""
    args = []
    for item in decl:
        name, kind = item.split(":")
        v = values.pop(name)
        if kind in POINTER_DTYPES:
            assert v.dtype == POINTER_DTYPES[kind], f"{name}: dtype {v.dtype}, kernel wants {kind}"
            assert v.flags.c_contiguous, f"{name}: not C-contiguous (strides {v.strides})"
            args.append(v)
        else:
            args.append(SCALAR_TYPES[kind](v))
    assert not values, f"arguments not in the kernel signature: {sorted(values)}"
    return tuple(args)


def dtype_tag(a) -> str:
    """Kernel-name suffix of an array's dtype: uint16 (bf16 bits) -> bf16, float32 -> f32, uint8
    (quantized blocks, for the format-free copies) -> u8."""
    tags = {np.dtype(np.uint16): "bf16", np.dtype(np.float32): "f32", np.dtype(np.uint8): "u8"}
    try:
        return tags[np.dtype(a.dtype)]
    except KeyError:
        raise TypeError(f"no kernel variant for dtype {a.dtype}; expected uint16 (bf16) or float32")


def threads(n: int, most: int = 1024) -> int:
    """Block size for n work items: a multiple of 32 (whole warps, the reductions assume it),
    at least 32 and at most ``most``."""
    return max(32, min(most, (int(n) + 31) // 32 * 32))
