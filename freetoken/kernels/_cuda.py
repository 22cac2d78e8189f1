"""The one CUDA loader: builds each RawModule from cuda/<name>.cu once per process, launches
kernels, and compiles to PTX through NVRTC without a GPU (the CI compile test).

CuPy is imported lazily inside functions: importing this module never touches CUDA.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
from pathlib import Path

import numpy as np

from freetoken.env import flag
from freetoken.cupy_loader import cupy as load_cupy

# What a declared argument type in an ``ARGS`` table means: array dtype for pointers, the exact
# numpy scalar type for values (a Python int would be passed as int64 and misread as int32).
POINTER_DTYPES = {"f32*": np.float32, "u16*": np.uint16, "i32*": np.int32, "u32*": np.uint32,
                  "i64*": np.int64, "u8*": np.uint8}
SCALAR_TYPES = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "f32": np.float32}


# --- sources ---------------------------------------------------------------------------------

def cuda_dir() -> Path:
    """Folder holding the .cu sources: freetoken/_cuda_src in an installed wheel (copied there by
    setup.py), else the checkout's repo-root cuda/. The wheel copy is tried first because an
    installed package's parent is site-packages, where an unrelated ``cuda`` package may live."""
    pkg = Path(__file__).resolve().parent.parent
    for d in (pkg / "_cuda_src", pkg.parent / "cuda"):
        if (d / "common.cuh").is_file():
            return d
    raise FileNotFoundError(f"no CUDA sources: neither {pkg / '_cuda_src'} nor {pkg.parent / 'cuda'} "
                            "holds common.cuh")


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


def launch(kern, grid, block, args, shared_mem=0) -> None:
    """Launch on the current stream. With FREETOKEN_SYNC_LAUNCH set, wait for the kernel and
    re-raise its error naming it (asynchronous errors otherwise surface at a later call);
    skipped while a CUDA graph is being captured, where synchronising is illegal. An empty
    grid (no rows) launches nothing: CUDA rejects a zero grid dimension."""
    if 0 in tuple(grid):
        return
    entry = getattr(kern, "name", repr(kern))
    try:
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


# --- NVRTC without a GPU ---------------------------------------------------------------------

def _nvrtc_candidates():
    """libnvrtc next to the nvidia-cuda-nvrtc wheels (cu13, then the cu12 layout), in the CUDA
    toolkit, then whatever the loader path finds."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else ()):
        yield os.path.join(root, "cu13", "lib", "libnvrtc.so.13")
        yield os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so.12")
    for home in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            yield os.path.join(home, "lib64", "libnvrtc.so")
    yield from ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


@functools.cache
def nvrtc():
    """The NVRTC library through ctypes, or None when none can be loaded."""
    for cand in _nvrtc_candidates():
        if os.sep in cand and not os.path.exists(cand):
            continue
        try:
            # libnvrtc dlopens its builtins by soname at compile time, and a wheel's lib folder
            # is not on the loader path: load the sibling builtins first so the soname resolves
            folder = Path(cand).parent if os.sep in cand else None
            for builtins in sorted(folder.glob("libnvrtc-builtins.so.*") if folder else ()):
                if ".alt." not in builtins.name:
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(cand)
        except OSError:
            continue
    return None


def _check(lib, status, what):
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(status).decode()}")


def _program_log(lib, prog) -> str:
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace")


def compile_to_ptx(path, arch: str = "sm_90") -> bytes:
    """PTX of one .cu file for ``arch`` (sm_80, sm_90, ...) with the loader's options. Needs no
    GPU and no CuPy; raises RuntimeError with NVRTC's log, naming the file, when it fails."""
    lib = nvrtc()
    if lib is None:
        raise RuntimeError("libnvrtc not found (pip install 'nvidia-cuda-nvrtc==13.0.*')")
    path = Path(path).resolve()
    prog = ctypes.c_void_p()
    src = read_source(path).encode()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src, str(path).encode(), 0, None, None),
           f"nvrtcCreateProgram({path})")
    try:
        # compute_XX (virtual arch): PTX is only retrievable for a virtual architecture
        opts = compile_options(path.parent) + (f"-arch=compute_{arch.removeprefix('sm_')}",)
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        if lib.nvrtcCompileProgram(prog, len(opts), arr) != 0:
            raise RuntimeError(f"NVRTC failed to compile {path} for {arch}:\n{_program_log(lib, prog)}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return buf.raw[:size.value].rstrip(b"\0")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
