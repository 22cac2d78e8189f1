"""Quantized prefill on the CPU: the int8 tile GEMM against what it replaced, interleaved; pairs:
freetoken/kernels/qgemm.py, freetoken/kernels/_simd_itile.py, freetoken/kernels/experts_quant.py.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/kernels/quant_gemm.py \
        [--formats q4_k,q6_k,q8_0] [--shape 1024x1024x64] [--rounds 5] [--cutover]

Table 1, per format: one M x K weight against T tokens (one expert's share of a prefill), G
multiply-adds/s of the tile GEMM (tiles made inside the timing) on the engine's threads and on one,
against dequantize + sgemm on one thread (linear_quant.dequant_rows, then numpy's BLAS: the old
prefill path, one expert per pool thread). --cutover adds table 2: a 64-expert top-8 layer of
q4_k gate_up / q6_k down (H 1024, I 512) at a few tokens per expert and a 1024 x 1024 q4_k
linear at a few tokens, the int8 GEMV against the tile GEMM: where experts_quant.GEMM_MIN_PAIRS
and linear_quant.GEMM_MIN_T come from. Each
round runs every variant once; medians and ranges over the rounds.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from _machine import machine  # noqa: E402
from freetoken.kernels import _isa, _numba, experts, experts_quant, linear_quant, qact, qgemm  # noqa: E402
from freetoken.kernels.qformats import format_named, random_blocks  # noqa: E402


def seconds(fn, calls=3):
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _one_thread(fn):
    def run():
        from threadpoolctl import threadpool_limits
        numba = _numba.load_numba()
        before = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            with threadpool_limits(1):
                return fn()
        finally:
            numba.set_num_threads(before)
    return run


def gemm_variants(fmt, M, K, T, rng):
    w = random_blocks(fmt, (1, M), K, rng)
    x = rng.standard_normal((T, K)).astype(np.float32)
    offs, uniq = np.array([0, T], np.int32), np.zeros(1, np.int32)
    res, buf = np.empty((T, M), np.float32), np.empty((M, K), np.float32)

    code = format_named(fmt).code

    def tile_gemm(kernel):
        def run():
            q, d, _ = qact.quantize(x)
            src, first = qgemm.lane_sources(offs, np.arange(T, dtype=np.int32))
            kernel(w, code, qgemm.tiles(q, d, src, code), uniq, offs, first, res, qgemm.into(False))
        return run

    def dequant_sgemm():
        linear_quant.dequant_rows(w[0], buf) @ qact.rounded(x, parallel=False).T
    kernels = {"VNNI": qgemm.vnni}
    if _isa.amx_int8() and code in qgemm.AMX_CODES:
        from freetoken.kernels import qgemm_amx
        kernels["AMX"] = lambda w, code, *rest: qgemm_amx.gemm(w, code, qgemm.GROUPS[code][0], *rest)
    variants = {}
    for name, kernel in kernels.items():
        variants[f"tile GEMM {name}"] = tile_gemm(kernel)
        variants[f"tile GEMM {name}, 1 thread"] = _one_thread(tile_gemm(kernel))
    return {**variants, "dequantize+sgemm, 1 thread": _one_thread(dequant_sgemm)}


def table(variants, macs, rounds):
    runs = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            runs[name].append(macs / seconds(fn) / 1e9)
    return runs


def cutover_variants(rng, per_expert):
    E, k, H, I = 64, 8, 1024, 512
    gu, dn = random_blocks("q4_k", (E, 2 * I), H, rng), random_blocks("q6_k", (E, H), I, rng)
    T = per_expert * E // k
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    plan = experts._plan(ids, rng.random((T, k)).astype(np.float32), E)
    out = np.empty((T, H), np.float32)
    return {"GEMV": lambda: experts_quant.gemv(x, gu, dn, *plan, out, "int8"),
            "tile GEMM": lambda: experts_quant.gemm(x, gu, dn, *plan, out)}


def linear_variants(rng, T):
    w, x = random_blocks("q4_k", (1024,), 1024, rng), rng.standard_normal((T, 1024)).astype(np.float32)
    out = np.empty((T, 1024), np.float32)
    return {"GEMV": lambda: linear_quant.gemv(x, w, out, "int8"), "tile GEMM": lambda: linear_quant.gemm(x, w, out)}


def cutover(rng, rounds):
    """Table 2's rows: (what, GEMV ms, tile GEMM ms) medians."""
    cases = [(f"experts, {n} tokens an expert", cutover_variants(rng, n)) for n in (2, 4, 8, 16)]
    cases += [(f"linear, {T} tokens", linear_variants(rng, T)) for T in (4, 8, 16)]
    rows = []
    for what, variants in cases:
        ms = {n: [] for n in variants}
        for _ in range(rounds):
            for n, fn in variants.items():
                ms[n].append(seconds(fn) * 1e3)
        rows.append((what, statistics.median(ms["GEMV"]), statistics.median(ms["tile GEMM"])))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="q4_k,q6_k,q8_0")
    ap.add_argument("--shape", default="1024x1024x64", help="M x K x T")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cutover", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant_gemm.json"))
    args = ap.parse_args(argv)
    M, K, T = (int(v) for v in args.shape.split("x"))
    rng, rows = np.random.default_rng(0), []
    print(f"# {machine()['cpu']}; {_isa.describe()}")
    print(f"{'format':7} {'variant':28} {'G multiply-adds/s':>22}")
    for fmt in args.formats.split(","):
        runs = table(gemm_variants(fmt, M, K, T, rng), M * K * T, args.rounds)
        for name, r in runs.items():
            print(f"{fmt:7} {name:28} {statistics.median(r):8.1f} [{min(r):.1f}-{max(r):.1f}]")
        rows.append({"format": fmt, "M": M, "K": K, "T": T, "runs": runs})
    if args.cutover:
        print(f"\n{'case':30} {'GEMV ms':>10} {'tile GEMM ms':>13} {'GEMV / GEMM':>12}")
        for what, a, b in cutover(rng, args.rounds):
            print(f"{what:30} {a:10.3f} {b:13.3f} {a / b:12.2f}")
            rows.append({"cutover": what, "gemv_ms": a, "gemm_ms": b})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
