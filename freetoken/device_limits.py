"""What a real GPU refuses to launch, by the numbers real ptxas gives each entry point of cuda/*.cu
(cuda/launch_limits.json, written by kernels/launch_limits.py): a block whose threads need more
than 64K registers, or whose static plus dynamic shared memory passes 48 KiB without the
max_dynamic_shared_size_bytes opt-in (227 KiB with it, sm_90). The driver answers the first
with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES and the second with CUDA_ERROR_INVALID_VALUE (both seen
on an H200); the emulator (cuda_emu/device_launch.py) refuses the same launches with the same
codes, then names the limit. The count of the code a device loads can differ from this table's
(another NVRTC), so a wrapper whose block grows with a shape (gdn_rule) asks the loaded kernel
(``max_threads_per_block``, which the emulated one answers from ``max_threads``). Also where the
.cu sources live (``cuda_dir``).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

ARCHS = ("sm_80", "sm_90", "sm_120")
REGISTERS_PER_BLOCK = 64 * 1024
REGISTER_UNIT = 8                  # a thread's registers are allocated in 8s (256 per warp)
WARP = 32
# warps take registers in groups of 4: an H200 reported 512 threads, not 544, as the most for
# gdn_rule at 113 registers (120 a thread: 17 warps need 20 warps' registers, 76,800)
WARP_GROUP = 4
SHARED_DEFAULT = 48 * 1024         # static + dynamic, without the opt-in
SHARED_OPTIN = 227 * 1024          # static + dynamic with it (sm_90)
TABLE = "launch_limits.json"
TOO_MANY_REGISTERS = "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: too many resources requested for launch"
TOO_MUCH_SHARED = "CUDA_ERROR_INVALID_VALUE: invalid argument"


def cuda_dir() -> Path:
    """Folder holding the .cu sources: freetoken/_cuda_src in an installed wheel (copied there by
    setup.py), else the checkout's repo-root cuda/. The wheel copy is tried first because an
    installed package's parent is site-packages, where an unrelated ``cuda`` package may live."""
    pkg = Path(__file__).resolve().parent
    for d in (pkg / "_cuda_src", pkg.parent / "cuda"):
        if (d / "common.cuh").is_file():
            return d
    raise FileNotFoundError(f"no CUDA sources: neither {pkg / '_cuda_src'} nor {pkg.parent / 'cuda'} "
                            "holds common.cuh")


@functools.cache
def table() -> dict[str, dict]:
    """cuda/launch_limits.json: {entry: {file, registers: {arch: n}, static_smem, stack, spills}},
    read once (every emulated launch consults it)."""
    return json.loads((cuda_dir() / TABLE).read_text())


def block_registers(registers: int, threads: int) -> int:
    """Registers a block of ``threads`` takes: per thread rounded up to the unit, warps in whole
    groups of WARP_GROUP."""
    per_thread = -(-registers // REGISTER_UNIT) * REGISTER_UNIT
    group = WARP * WARP_GROUP
    return per_thread * group * -(-threads // group)


def max_threads(entry: str) -> int:
    """The largest block (a multiple of 32, at most 1024) whose registers fit, on every arch."""
    registers = max(table()[entry]["registers"].values())
    group = WARP * WARP_GROUP
    return min(1024, REGISTERS_PER_BLOCK // block_registers(registers, group) * group)


def row_of(file: str, entry: str) -> dict | None:
    """The table's row of ``entry`` of cuda/``file``; None for a kernel that is not the
    project's (a test's own, or one of another file with the same name)."""
    row = table().get(entry)
    return row if row is not None and row["file"] == file else None


def refusal(file: str, entry: str, threads: int, dynamic_smem: int, max_dynamic: int) -> str | None:
    """Why a real device would refuse this launch of ``entry`` (of cuda/``file``), or None; an
    entry the table does not hold (a test's own kernel) is not judged."""
    row = row_of(file, entry)
    if row is None:
        return None
    arch, registers = max(row["registers"].items(), key=lambda kv: kv[1])
    need = block_registers(registers, threads)
    if need > REGISTERS_PER_BLOCK:
        return (f"{TOO_MANY_REGISTERS} ({threads} threads x {registers} "
                f"registers ({arch}, per ptxas) take {need} registers, above the "
                f"{REGISTERS_PER_BLOCK} of a block: at most {max_threads(entry)} threads)")
    static = row["static_smem"]
    limit = SHARED_OPTIN if max_dynamic > SHARED_DEFAULT - static else SHARED_DEFAULT
    if static + dynamic_smem > limit:
        return (f"{TOO_MUCH_SHARED} ({static} bytes of static shared "
                f"memory + {dynamic_smem} dynamic = {static + dynamic_smem}, above {limit} "
                + ("(the opt-in maximum))" if limit == SHARED_OPTIN else
                   "(48 KiB without max_dynamic_shared_size_bytes))"))
    return None
