"""NVRTC through ctypes, without a GPU and without CuPy: the .cu sources compiled with the loader's
options to PTX (tests/kernels/test_nvrtc_compile.py) or to cubins with ptxas's per-kernel report
(kernels/launch_limits.py). libnvrtc comes from the nvidia-cuda-nvrtc wheel or a CUDA toolkit."""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path

from freetoken.kernels._cuda import CUPY_APPENDED_OPTIONS, compile_options, read_source


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
    # compute_XX (virtual arch): PTX is only retrievable for a virtual architecture
    return _compile(path, (f"-arch=compute_{arch.removeprefix('sm_')}",), arch, "PTX")[0]


def ptxas_log(path, arch: str, defines: tuple[str, ...] = ()) -> str:
    """What real ptxas says compiling one .cu file (with ``defines``) to a cubin for ``arch``
    (sm_80, sm_90, sm_120): per entry point its registers, static shared memory, stack and
    spills (kernels/launch_limits.py reads it). No GPU needed."""
    opts = (f"-arch={arch}", "--ptxas-options=-v", *defines)
    return _compile(path, opts, arch, "CUBIN")[1]


def _compile(path, extra: tuple[str, ...], arch: str, output: str) -> tuple[bytes, str]:
    """(NVRTC's ``output`` (PTX or CUBIN), its log) of one .cu file with the loader's options (and
    what CuPy appends to them) plus ``extra``; RuntimeError with the log, naming the file, when
    it fails."""
    lib = nvrtc()
    if lib is None:
        raise RuntimeError("libnvrtc not found (pip install 'nvidia-cuda-nvrtc==13.0.*')")
    path = Path(path).resolve()
    prog = ctypes.c_void_p()
    src = read_source(path).encode()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src, str(path).encode(), 0, None, None),
           f"nvrtcCreateProgram({path})")
    try:
        opts = compile_options(path.parent) + CUPY_APPENDED_OPTIONS + extra
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        if lib.nvrtcCompileProgram(prog, len(opts), arr) != 0:
            raise RuntimeError(f"NVRTC failed to compile {path} for {arch}:\n{_program_log(lib, prog)}")
        size = ctypes.c_size_t()
        _check(lib, getattr(lib, f"nvrtcGet{output}Size")(prog, ctypes.byref(size)), f"nvrtcGet{output}Size")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, getattr(lib, f"nvrtcGet{output}")(prog, buf), f"nvrtcGet{output}")
        return buf.raw[:size.value].rstrip(b"\0"), _program_log(lib, prog)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
