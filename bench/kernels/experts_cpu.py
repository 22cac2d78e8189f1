"""CPU expert (and dense linear) kernels against this machine's memory read bandwidth; pairs:
freetoken/kernels/experts.py, freetoken/kernels/linear.py, freetoken/kernels/_membw.py.

    python bench/kernels/experts_cpu.py [--threads N] [--out bench/results/experts_cpu.json]

Weights are random bf16 banks far larger than the last-level cache and routing is uniformly
random, so every call streams its experts from DRAM (the decode case of the CPU executor).
GB/s counts the weight bytes a call must read once (unique experts x expert bytes); ``frac``
compares the best call with the best of a numba parallel read measured just before the row (on a
shared, noisy machine best-of-N is the most repeatable statistic of both).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from freetoken.kernels import experts, linear  # noqa: E402
from freetoken.kernels._membw import measure_read_bandwidth  # noqa: E402
from freetoken.kernels._numba import load_numba  # noqa: E402

COLD_BYTES = 384 << 20  # linear weights are cycled through copies of at least this many bytes


def bf16_bank(rng, shape):
    """Random bf16 bit patterns of moderate magnitude (exponent near 1), no NaN or inf."""
    return (rng.integers(0x3C00, 0x3F80, size=shape, dtype=np.uint16)
            | rng.choice(np.array([0, 0x8000], np.uint16), size=shape))


def time_calls(fn, calls, repeats):
    """Seconds per call for ``repeats`` calls after two warm-ups; calls(i) -> args of call i."""
    for i in range(2):
        fn(*calls(i))
    times = []
    for i in range(repeats):
        args = calls(i + 2)
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return times


def bench_experts(rng, H, I, E, k, T, repeats):
    gate_up, down = bf16_bank(rng, (E, 2 * I, H)), bf16_bank(rng, (E, H, I))
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, k)).astype(np.float32)
    out = np.empty((T, H), np.float32)
    routes = [np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
              for _ in range(repeats + 2)]
    times = time_calls(lambda ids: experts.cpu(x, ids, w, gate_up, down, out),
                       lambda i: (routes[i],), repeats)
    per_expert = gate_up[0].nbytes + down[0].nbytes
    nbytes = [len(np.unique(r)) * per_expert for r in routes[2:]]
    return f"experts H{H} I{I} k{k} E{E}", T, times, nbytes


def bench_linear(rng, M, K, T, repeats):
    copies = max(1, COLD_BYTES // (M * K * 2))
    ws = [bf16_bank(rng, (M, K)) for _ in range(copies)]
    x = rng.standard_normal((T, K)).astype(np.float32)
    out = np.empty((T, M), np.float32)
    times = time_calls(lambda w: linear.cpu(x, w, out), lambda i: (ws[i % copies],), repeats)
    return f"linear M{M} K{K}", T, times, [M * K * 2] * repeats


def row(name, T, times, nbytes, bw):
    gbs = [b / t / 1e9 for b, t in zip(nbytes, times)]
    return dict(kernel=name, tokens=T, ms_median=1e3 * statistics.median(times),
                gbs_median=statistics.median(gbs), gbs_best=max(gbs), read_gbs=bw,
                fraction=max(gbs) / bw)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="numba threads (default: all)")
    ap.add_argument("--shapes", default="1024x512,2048x768", help="expert H x I list")
    ap.add_argument("--tokens", default="1,4,8", help="tokens per call")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--linear", default="4096x2048,8192x1024", help="dense M x K list ('' off)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "experts_cpu.json"))
    args = ap.parse_args(argv)
    numba = load_numba()
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    cases = [("e", *map(int, s.split("x"))) for s in args.shapes.split(",") if s]
    cases += [("l", *map(int, s.split("x"))) for s in args.linear.split(",") if s]
    rows = []
    for kind, a, b in cases:
        for T in tokens:
            bw = measure_read_bandwidth(nbytes=512 << 20, repeats=10)
            res = (bench_experts(rng, a, b, args.experts, args.k, T, args.repeats) if kind == "e"
                   else bench_linear(rng, a, b, T, args.repeats))
            rows.append(row(*res, bw))
    report(rows, args, numba.get_num_threads())


def report(rows, args, threads):
    print(f"{'kernel':<30} {'T':>3} {'ms':>8} {'GB/s':>7} {'best':>7} {'read':>6} {'frac':>6}")
    print(f"{'':<30} {'':>3} {'median':>8} {'median':>7} {'GB/s':>7} {'best':>6} {'best':>6}")
    for r in rows:
        print(f"{r['kernel']:<30} {r['tokens']:>3} {r['ms_median']:>8.3f} {r['gbs_median']:>7.2f} "
              f"{r['gbs_best']:>7.2f} {r['read_gbs']:>6.1f} {r['fraction']:>6.0%}")
    meta = dict(threads=threads, cpu=platform.processor() or platform.machine(),
                cores=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M"),
                load=os.getloadavg()[0], repeats=args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"threads {threads}, load {meta['load']:.1f}; wrote {args.out}")


if __name__ == "__main__":
    main()
