"""What a real GPU refuses to launch, by the numbers real ptxas gives each entry point of cuda/*.cu
(cuda/launch_limits.json, written by kernels/launch_limits.py): a block whose threads need more
than 64K registers, or whose static plus dynamic shared memory passes 48 KiB without the
max_dynamic_shared_size_bytes opt-in (227 KiB with it, sm_90); CUDA says "too many resources
requested for launch". The emulator (cuda_emu/device_launch.py) refuses the same launches,
naming the limit; wrappers whose block grows with a shape (gdn_rule) bound it by
``max_threads``. Also where the .cu sources live (``cuda_dir``).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

ARCHS = ("sm_80", "sm_90", "sm_120")
REGISTERS_PER_BLOCK = 64 * 1024
REGISTER_UNIT = 8                  # a thread's registers are allocated in 8s (256 per warp)
WARP = 32
SHARED_DEFAULT = 48 * 1024         # static + dynamic, without the opt-in
SHARED_OPTIN = 227 * 1024          # static + dynamic with it (sm_90)
TABLE = "launch_limits.json"


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
    """Registers a block of ``threads`` takes: per thread rounded up to the unit, whole warps."""
    per_thread = -(-registers // REGISTER_UNIT) * REGISTER_UNIT
    return per_thread * WARP * -(-threads // WARP)


def max_threads(entry: str) -> int:
    """The largest block (a multiple of 32, at most 1024) whose registers fit, on every arch."""
    registers = max(table()[entry]["registers"].values())
    return min(1024, REGISTERS_PER_BLOCK // block_registers(registers, WARP) * WARP)


def refusal(file: str, entry: str, threads: int, dynamic_smem: int, max_dynamic: int) -> str | None:
    """Why a real device would refuse this launch of ``entry`` (of cuda/``file``), or None; an
    entry the table does not hold (a test's own kernel) is not judged."""
    row = table().get(entry)
    if row is None or row["file"] != file:
        return None
    arch, registers = max(row["registers"].items(), key=lambda kv: kv[1])
    need = block_registers(registers, threads)
    if need > REGISTERS_PER_BLOCK:
        return (f"too many resources requested for launch: {threads} threads x {registers} "
                f"registers ({arch}, per ptxas) take {need} registers, above the "
                f"{REGISTERS_PER_BLOCK} of a block (at most {max_threads(entry)} threads)")
    static = row["static_smem"]
    limit = SHARED_OPTIN if max_dynamic > SHARED_DEFAULT - static else SHARED_DEFAULT
    if static + dynamic_smem > limit:
        return (f"too many resources requested for launch: {static} bytes of static shared "
                f"memory + {dynamic_smem} dynamic = {static + dynamic_smem}, above {limit} "
                + ("(the opt-in maximum)" if limit == SHARED_OPTIN else
                   "(48 KiB without max_dynamic_shared_size_bytes)"))
    return None
