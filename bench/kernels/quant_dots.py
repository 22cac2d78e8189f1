"""Quantized row dots on the CPU, fp32 against int8 (--cpu-dots), interleaved; pairs:
freetoken/kernels/linear_quant.py, freetoken/kernels/qact.py, freetoken/kernels/_simd_int8.py.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/kernels/quant_dots.py \
        [--formats q8_0,q4_k,q5_k,q6_k] [--shapes 4096x2048,16384x4096] [--rounds 5]

One decode GEMV (one token, linear_quant.gemv: the experts' decode path runs the same row dots)
per call over random blocks (qformats.random_blocks); the activation's rounding is inside the int8
timing. G weights/s = M*K / seconds; the two modes alternate call batches in every round, and the
table gives each mode's median and range over the rounds and the median of the per-round ratios.
A small shape stays in the last-level cache (compute bound); a big one streams from DRAM.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from _machine import spread, write_results  # noqa: E402
from freetoken.kernels import linear_quant  # noqa: E402
from freetoken.kernels.qformats import format_named, random_blocks  # noqa: E402

MODES = ("f32", "int8")


def rate(w, x, out, dots, calls):
    """G weights/s of `calls` GEMVs in mode `dots`."""
    start = time.perf_counter()
    for _ in range(calls):
        linear_quant.gemv(x, w, out, dots)
    return w.shape[0] * x.shape[1] * calls / (time.perf_counter() - start) / 1e9


def measure(fmt, M, K, rounds, rng):
    w = random_blocks(fmt, (M,), K, rng)
    x, out = rng.standard_normal((1, K)).astype(np.float32), np.empty((1, M), np.float32)
    calls = max(3, int(2e8 // (M * K)))                      # ~0.1 s a batch at 20 G weights/s
    for dots in MODES:
        rate(w, x, out, dots, 2)                             # compile and warm
    runs = {dots: [] for dots in MODES}
    for _ in range(rounds):
        for dots in MODES:
            runs[dots].append(rate(w, x, out, dots, calls))
    ratios = [b / a for a, b in zip(runs["f32"], runs["int8"])]
    return {"format": fmt, "M": M, "K": K, "MB": w.nbytes / 1e6, "runs": runs, "ratio": statistics.median(ratios)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="q8_0,q4_k,q5_k,q6_k")
    ap.add_argument("--shapes", default="4096x2048,16384x4096", help="M x K list")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant_dots.json"))
    args = ap.parse_args(argv)
    rng, rows = np.random.default_rng(0), []
    print(f"{'format':7} {'M x K':>12} {'MB':>6} {'f32 G w/s':>20} {'int8 G w/s':>20} {'int8/f32':>8}")
    for shape in args.shapes.split(","):
        M, K = (int(v) for v in shape.split("x"))
        for fmt in args.formats.split(","):
            format_named(fmt)
            r = measure(fmt, M, K, args.rounds, rng)
            cells = [spread(r["runs"][d]) for d in MODES]
            print(f"{fmt:7} {shape:>12} {r['MB']:6.1f} {cells[0]:>20} {cells[1]:>20} {r['ratio']:8.2f}")
            rows.append(r)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
