"""Which CPU instructions the numba kernels run with on this machine: numba compiles for the host
CPU (LLVM's name for it and its feature flags), so the vector width and the dot-product
instructions available differ from box to box. Used by ``kernel --bench`` and the engine's
start-up log; numba's cache is keyed on the same CPU name and features."""
from __future__ import annotations

import ctypes
import functools

# (LLVM feature, what the kernels would use it for)
DOT_FEATURES = (("avx512bf16", "AVX512-BF16 bf16 dots"), ("avx512vnni", "AVX512-VNNI int8 dots"),
                ("avxvnni", "AVX-VNNI int8 dots"), ("amx-bf16", "AMX-BF16 tiles"),
                ("amx-int8", "AMX-INT8 tiles"))
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
INT8_PATHS = {"vnni": "VNNI vpdpbusd", "avx2": "AVX2 pmaddubsw+pmaddwd", "generic": "widening multiplies"}
TILE_PATHS = {"vnni512": "int8 tile GEMM, 512-bit vpdpbusd", "vnni": "int8 tile GEMM, 256-bit vpdpbusd",
              "generic": "dequantize + fp32 BLAS (no vpdpbusd for the int8 tile GEMM)"}


def int8_dot_path(features) -> str:
    """'vnni', 'avx2' or 'generic': what the int8 row dots (kernels/_simd_int8.py) compile to for a
    set of enabled LLVM features (256-bit vpdpbusd: AVX-VNNI, or AVX512-VNNI with AVX512-VL)."""
    if "avxvnni" in features or {"avx512vnni", "avx512vl"} <= set(features):
        return "vnni"
    return "avx2" if "avx2" in features else "generic"


def int8_tile_path(features) -> str:
    """'vnni512', 'vnni' or 'generic': what the int8 tile GEMM (kernels/_simd_itile.py, quantized
    prefill) compiles to; AVX2's pmaddubsw is no path there (it saturates on q8_0's u up to 255)."""
    if "avx512vnni" in features:
        return "vnni512"
    return "vnni" if int8_dot_path(features) == "vnni" else "generic"


def bf16_dots(features=None) -> bool:
    """Whether bf16 experts run on vdpbf16ps (prefill tiles, kernels/experts_bf16.py; decode row dots,
    kernels/_simd_bf16.py): AVX512-BF16 with AVX-512 (the host's features unless given)."""
    features = host()[1] if features is None else features
    return {"avx512bf16", "avx512f"} <= set(features)


@functools.lru_cache(maxsize=1)
def amx_int8() -> bool:
    """Whether the quantized GEMM runs on AMX-INT8 tiles (kernels/qgemm_amx.py): the CPU has
    them, Linux grants this process the tile state, and FREETOKEN_VNNI_TILES=1 does not ask for
    the VNNI kernel instead (read once)."""
    from freetoken.env import flag
    if flag("VNNI_TILES") or not {"amx-int8", "amx-tile"} <= host()[1]:
        return False
    try:        # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux's grant of the tile state
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=1)
def host() -> tuple[str, frozenset]:
    """(LLVM CPU name, the features LLVM enables for it) of numba's code generation: the host's,
    unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name another target (a portable cache is built
    with NUMBA_CPU_NAME=generic: no AVX at all). The kernels' choices read this, not the host's
    CPUID: inline asm of an instruction the target lacks aborts LLVM's code generation."""
    from freetoken.kernels._numba import load_numba
    load_numba()
    from numba.core.registry import cpu_target
    codegen = cpu_target.target_context.codegen()
    features = codegen._tm_features        # '+avx2,-amx-int8,...' (what _simd_int8 compiles for)
    return codegen._get_host_cpu_name(), frozenset(f[1:] for f in features.split(",") if f.startswith("+"))


def weight_prefetch(name=None) -> bool:
    """Whether the decode GEMVs ask for their weight rows ahead (_simd.prefetch_ahead), by LLVM's
    CPU name (the host's unless given; numba's cache is keyed on it). Not on AMD Zen ('znver*'):
    its hardware prefetchers already stream the rows, and the hints made a bf16 decode step of the
    medium model 1.5-1.7x as long on the Zen 4 VM (quantized files: no gain); on the Xeon EMR VM
    they took a cold q4_k GEMV from 9.4 to 14-15 GB/s (docs/performance.md)."""
    return not (host()[0] if name is None else name).startswith("znver")


def vector_width(features) -> str:
    if "avx512f" in features:
        return "AVX-512 (16 fp32 lanes)"
    if "avx2" in features and "fma" in features:
        return "AVX2+FMA (8 fp32 lanes)"
    return "SSE (4 fp32 lanes)"


def describe() -> str:
    """One line: the target, its vector width, the int8 dots' instructions (quantized weights,
    --cpu-dots int8), how bf16 experts multiply at prefill and decode (vdpbf16ps tiles and row dots
    where the CPU has AVX512-BF16, else widened to fp32: BLAS, fp32 FMAs), and the dot-product
    instructions the CPU has that the kernels do not use yet."""
    name, features = host()
    path = int8_dot_path(features)
    used = {"avx512vnni", "avxvnni"} if path == "vnni" else set()
    used |= {"avx512bf16"} if bf16_dots(features) else set()
    amx = {"amx-int8", "amx-tile"} <= features and amx_int8()
    used |= {"amx-int8"} if amx else set()
    present = [what for flag, what in DOT_FEATURES if flag in features and flag not in used]
    unused = f"; present but unused: {', '.join(present)}" if present else ""
    prefill = (("int8 tile GEMM on AMX-INT8 tiles (tdpbusd: q8_0, q4_k, q5_k, q6_k; the other formats on VNNI "
                "tiles)") if amx else TILE_PATHS[int8_tile_path(features)])
    bf16 = ("prefill by vdpbf16ps tiles, decode by vdpbf16ps row dots (AVX512-BF16)" if bf16_dots(features)
            else "prefill widened to fp32 for BLAS, decode by fp32 FMAs")
    ahead = "asked for ahead" if weight_prefetch(name) else "left to the hardware prefetchers (AMD Zen)"
    return (f"numba target {name}, {vector_width(features)}, fp32 FMA, int8 dots by {INT8_PATHS[path]}, "
            f"quantized prefill by {prefill}, bf16 experts' {bf16}, decode weight rows "
            f"{ahead}{unused}")
