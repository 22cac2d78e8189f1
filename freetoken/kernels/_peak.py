"""The CPU's compute peak, measured, for the multiply-add instruction a kernel path runs on: the
FLOP/s yardstick of ``kernel --bench`` (commands/kernel.py), as kernels/_membw.py is the bandwidth
one. A datasheet peak would not do: VMs hide the clock, and how many 512-bit dot products a core
issues a cycle differs by family (Zen 4 splits them in two).

Each numba thread runs CHAINS independent accumulators through the instruction, so its latency
is hidden and the figure is the instruction's throughput on all of numba's threads:

  fp32   llvm.fma on 16 lanes (two AVX2 FMAs where the CPU has no AVX-512): 32 flops a call
  bf16   vdpbf16ps (bf16 experts on AVX512-BF16, kernels/_simd_bf16.py): 16 lanes x 2 products
  int8   vpdpbusd as the int8 tile GEMM runs it (kernels/_simd_itile.py: one 512-bit or two
         256-bit, or its widening fallback): 16 lanes x 4 products

A multiply-add counts as two operations, as the cases' flop counts do (kernels/cases.py).
"""
from __future__ import annotations

import functools
import time

import numpy as np

from freetoken.kernels._numba import load_numba

CHAINS = 12                  # independent accumulators a thread: latency (4-5 cycles) x 2-3 pipes
OPS_PER_CALL = {"fp32": 32, "bf16": 64, "int8": 128}


def what_runs(kind: str) -> str:
    """The instruction `kind`'s peak is measured on, in words."""
    from freetoken.kernels._isa import TILE_PATHS, host, int8_tile_path
    if kind == "int8":
        return f"the int8 dots of the {TILE_PATHS[int8_tile_path(host()[1])]}"
    return "vdpbf16ps bf16 pair dots" if kind == "bf16" else "fp32 FMAs"


def measure_peak(kind: str, steps: int = 400_000, repeats: int = 5) -> float:
    """Best-of-``repeats`` operations per second (multiply-add = 2) of instruction `kind` ('fp32',
    'bf16' where _isa.bf16_dots(), 'int8') on numba's current threads, ``steps`` calls of each
    of CHAINS accumulators a thread."""
    numba = load_numba()
    run, (a, b) = _runner(kind), operands(kind)
    out = np.empty(numba.get_num_threads(), np.float64)
    run(a, b, 1, out)                                            # compiles
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(a, b, steps, out)
        best = min(best, time.perf_counter() - start)
    return out.shape[0] * steps * CHAINS * OPS_PER_CALL[kind] / best


def operands(kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The two 64-byte operands of every call: values whose sums neither overflow nor go subnormal
    (int8: 3 and 5, 60 a lane a call; fp32: 2**-10 squared; bf16: pairs of 2**-7, 2**-13 a lane)."""
    if kind == "int8":
        return np.full(64, 3, np.uint8), np.full(64, 5, np.uint8)
    if kind == "bf16":
        pair = np.full(64, 0x3C00 >> 8, np.uint8)        # bf16 0x3C00 = 2**-7: its bytes (0x00, 0x3C)
        pair[0::2] = 0
        return pair, pair.copy()
    value = np.full(16, 2.0 ** -10, np.float32).view(np.uint8)
    return value, value.copy()


@functools.lru_cache(maxsize=None)
def _runner(kind: str):
    """A parallel numba function: every thread runs `kind`'s chains for n steps."""
    numba = load_numba()
    chains = _chains_intrinsic(kind)

    @numba.njit(parallel=True, nogil=True)
    def run(a, b, n, out):
        for t in numba.prange(out.shape[0]):
            out[t] = chains(a, b, n)
    return run


def _chains_intrinsic(kind: str):
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from freetoken.kernels._simd_ir import I32, _function
    from freetoken.kernels._simd_itile import F32x16, I8x64, I32x16, _vnni16, tile_path

    def step(builder, acc, va, vb, features):
        if kind == "fp32":
            return builder.call(_function(builder, "llvm.fma.v16f32", F32x16, [F32x16] * 3), [va, vb, acc])
        if kind == "bf16":
            from freetoken.kernels._simd_bf16 import _dpbf16ps
            return _dpbf16ps(builder, acc, va, vb)
        return _vnni16(builder, acc, va, vb, tile_path(features))

    acc_type = I32x16 if kind == "int8" else F32x16
    operand = {"fp32": F32x16, "bf16": I32x16, "int8": I8x64}[kind]

    @intrinsic
    def chains(typingctx, a, b, n):
        def codegen(context, builder, sig, args):
            va, vb = (builder.load(builder.bitcast(context.make_array(sig.args[i])(context, builder, args[i]).data,
                                                   operand.as_pointer()), align=1) for i in (0, 1))
            slots = [cgutils.alloca_once_value(builder, ir.Constant(acc_type, None)) for _ in range(CHAINS)]
            features = context.codegen()._tm_features
            with cgutils.for_range(builder, args[2]):
                for slot in slots:
                    builder.store(step(builder, builder.load(slot), va, vb, features), slot)
            lane0 = [builder.extract_element(builder.load(slot), ir.Constant(I32, 0)) for slot in slots]
            wide = [builder.sitofp(v, ir.DoubleType()) if kind == "int8" else builder.fpext(v, ir.DoubleType())
                    for v in lane0]
            total = wide[0]
            for v in wide[1:]:
                total = builder.fadd(total, v)
            return total
        ok = all(isinstance(x, types.Array) and x.dtype == types.uint8 for x in (a, b)) and isinstance(n, types.Integer)
        return (types.float64(a, b, n), codegen) if ok else None
    return chains
