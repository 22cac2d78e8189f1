"""Every cuda/*.cu compiled as the installed CuPy's RawModule compiles it (CuPy's own option
assembly, its NVRTC binding, the headers its ``[ctk]`` extra installs) for sm_80, sm_90 and
sm_120, with no GPU: what a machine with only a driver runs at its first kernel. CI runs it in a
virtual environment that holds ``pip install ".[cuda13]"`` and nothing else (.ci/run):

    python tools/cupy_compile.py

kernels/_nvrtc.py compiles the same sources through ctypes without CuPy (the launch table and
the PTX test); this check is the one that goes through CuPy, so a CuPy release that changes its
options, or an extra that stops installing NVRTC or the headers, fails here and not on a user's box.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from freetoken.device_limits import ARCHS, cuda_dir, table


def _cubin_arch(arch=None):
    """Stands in for CuPy's one step that asks the current device for its compute capability
    (and so needs a driver): the arch is named here, and CuPy's rule then emits a cubin."""
    return f"-arch=sm_{arch}", "cubin"


def _real_cupy():
    from freetoken.cupy_loader import cupy, emulated
    if emulated():
        raise SystemExit("cupy_compile checks the real CuPy: unset FREETOKEN_CUDA_EMULATE")
    try:
        return cupy()
    except ImportError as err:
        raise SystemExit(f"real CuPy is not installed ({err}): pip install '.[cuda13]'")


@contextlib.contextmanager
def named_arch(compiler):
    """CuPy's compiler with ``_cubin_arch`` in place of its device query, for the duration."""
    saved, compiler._get_arch_for_options_for_nvrtc = \
        compiler._get_arch_for_options_for_nvrtc, _cubin_arch
    try:
        yield compiler
    finally:
        compiler._get_arch_for_options_for_nvrtc = saved


def compile_source(cp, path, arch: str, defines: tuple[str, ...]) -> bytes:
    """The cubin of cuda/<path> for ``arch`` ("sm_90") with RawModule's options: ours
    (kernels/_cuda.py), then what CuPy adds (its include folders, the CUDA headers, -ftz=true).
    Call it under ``named_arch``."""
    from freetoken.kernels import _cuda
    options = cp._core.core.assemble_cupy_compiler_options(
        _cuda.compile_options(cuda_dir()) + tuple(defines)) + ("-ftz=true",)
    cubin, _ = cp.cuda.compiler.compile_using_nvrtc(
        _cuda.module_source(path), options, arch=arch.removeprefix("sm_"))
    return bytes(cubin)


def missing_entries(path, cubin: bytes) -> list[str]:
    """Entry points the launch table lists for this source that the cubin lacks."""
    return [e for e, row in table().items() if row["file"] == path.name and e.encode() not in cubin]


def check(cp, archs=ARCHS) -> list[str]:
    """Compile every source and variant for every arch (NVRTC runs outside the GIL: a thread
    per core); one line per failure."""
    from freetoken.kernels.launch_limits import jobs
    with named_arch(cp.cuda.compiler), ThreadPoolExecutor(os.cpu_count()) as pool:
        results = list(pool.map(lambda job: _one(cp, *job), jobs(archs)))
    return [line for lines in results for line in lines]


def _one(cp, path, arch, defines) -> list[str]:
    where = f"{path.name} {arch} {' '.join(defines)}".rstrip()
    try:
        cubin = compile_source(cp, path, arch, defines)
    except Exception as err:                         # CuPy's CompileException carries NVRTC's log
        return [f"{where}: {type(err).__name__}: {err}"]
    lost = missing_entries(path, cubin)
    print(f"{where}: {len(cubin)} bytes", flush=True)
    return [f"{where}: no entry point {', '.join(lost)} in the cubin"] if lost else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="compile every cuda/*.cu through the installed "
                                 "CuPy (RawModule's options, NVRTC from its [ctk] extra), no GPU")
    ap.add_argument("--arch", action="append", choices=ARCHS, help="default: all of them")
    args = ap.parse_args(argv)
    cp = _real_cupy()
    version = cp.cuda.compiler._get_nvrtc_version()
    print(f"CuPy {cp.__version__}, NVRTC {version[0]}.{version[1]}", flush=True)
    failures = check(cp, tuple(args.arch or ARCHS))
    for line in failures:
        print("FAILED", line, file=sys.stderr)
    print(f"{len(failures)} failure(s)")
    return int(bool(failures))


if __name__ == "__main__":
    sys.exit(main())
