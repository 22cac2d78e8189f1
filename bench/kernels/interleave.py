"""q4_0 weights in the file's layout against the same rows interleaved 16 at a time
(kernels/qinterleave.py), int8 dots, interleaved rounds; pairs: freetoken/kernels/qinterleave.py,
freetoken/kernels/_simd_interleave.py.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/kernels/interleave.py \
        [--shapes 2048x1024,65536x1024] [--experts 64,8,1024,512] [--rounds 5]

Two cases: one decode GEMV (linear_quant.gemv, one token) of M x K random q4_0 rows, and one
decode call of a routed-experts layer (experts.cpu, one token; E experts, top k, hidden H,
width I; the bank a fresh draw per call so its experts come from DRAM, as in a decode step).
G weights/s = weights read / seconds; each round times both layouts, the table gives medians,
ranges and the median of the per-round ratios (interleaved / file layout).
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
from freetoken.kernels import experts, linear_quant  # noqa: E402
from freetoken.kernels.qformats import random_blocks  # noqa: E402
from freetoken.kernels.qlayout import interleave_ref  # noqa: E402

LAYOUTS = ("q4_0", "q4_0x16")


def gemv_case(M, K, rng):
    """(weights a call reads, {layout: one call})."""
    w = random_blocks("q4_0", (M,), K, rng)
    x, out = rng.standard_normal((1, K)).astype(np.float32), np.empty((1, M), np.float32)
    ws = {"q4_0": w, "q4_0x16": interleave_ref(w)}
    return M * K, {name: (lambda w=w: linear_quant.gemv(x, w, out, "int8")) for name, w in ws.items()}


def experts_case(E, k, H, I, rng):
    """(weights a call reads, {layout: one call}): each call routes one token to k experts drawn
    afresh, so the bank (E experts) is read from DRAM as a decode step reads it."""
    gu, dn = random_blocks("q4_0", (E, 2 * I), H, rng), random_blocks("q4_0", (E, H), I, rng)
    banks = {"q4_0": (gu, dn), "q4_0x16": (interleave_ref(gu), interleave_ref(dn))}
    x = rng.standard_normal((1, H)).astype(np.float32)
    weights = np.full((1, k), 1.0 / k, np.float32)

    def call(bank):
        ids = rng.choice(E, k, replace=False).astype(np.int32)[None]
        experts.cpu(x, ids, weights, *bank, dots="int8")
    return 3 * k * H * I, {name: (lambda b=b: call(b)) for name, b in banks.items()}


def measure(label, case, rounds):
    per_call, calls = case
    n = max(3, int(2e8 // per_call))
    for fn in calls.values():
        fn(), fn()                                        # compile and warm
    runs = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(n):
                fn()
            runs[name].append(per_call * n / (time.perf_counter() - start) / 1e9)
    ratios = [b / a for a, b in zip(runs["q4_0"], runs["q4_0x16"])]
    return {"case": label, "runs": runs, "ratio": statistics.median(ratios), "ratios": ratios}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2048x1024,65536x1024", help="GEMV M x K list")
    ap.add_argument("--experts", default="64,8,1024,512", help="E,k,H,I of the experts case ('' skips it)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "interleave.json"))
    args = ap.parse_args(argv)
    rng, rows = np.random.default_rng(0), []
    cases = [(f"gemv {s}", gemv_case(*(int(v) for v in s.split("x")), rng)) for s in args.shapes.split(",") if s]
    if args.experts:
        cases.append((f"experts {args.experts}", experts_case(*(int(v) for v in args.experts.split(",")), rng)))
    print(f"{'case':24} {'q4_0 G w/s':>20} {'q4_0x16 G w/s':>20} {'ratio':>18}")
    for label, case in cases:
        r = measure(label, case, args.rounds)
        cells = [spread(v) for v in r["runs"].values()]
        span = f"{r['ratio']:.2f} [{min(r['ratios']):.2f}-{max(r['ratios']):.2f}]"
        print(f"{label:24} {cells[0]:>20} {cells[1]:>20} {span:>18}")
        rows.append(r)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
