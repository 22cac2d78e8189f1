"""gdn_rule.cpu at Qwen3.6's Gated DeltaNet shape (Hk 16, Hv 32, Dk = Dv = 128: a 2 MiB fp32
state per sequence per layer) against this machine's memory read bandwidth; pairs:
freetoken/kernels/gdn_rule.py, freetoken/kernels/_gdn_cpu.py, freetoken/kernels/_gdn_chunked.py.

    python bench/gdn.py [--batches 1,4,16] [--prefill 512,2048] [--threads N] [--repeats 20]
        [--pool-mib 1024] [--out bench/results/gdn.json]

Decode: B sequences x 1 token per call, their state rows drawn at random from a pool of
--pool-mib MiB (far above the last-level cache by default), so every call streams its states
from DRAM. GB/s counts the state bytes a call must move: each row read once and written once
(2 x B x 2 MiB); ``frac`` compares it with a numba parallel read of 1 GiB measured just before.
Prefill: one sequence of T tokens from a zero state, once with each form (recurrent: the
per-token loop; chunked: chunks of 64 with the WY/UT transform) and as ``cpu`` picks by
length (gdn_rule.CHUNKED_MIN_T). Times are best-of-N wall clock; the machine may be shared
(its load is printed), so compare rows of one run.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from freetoken.kernels import gdn_rule  # noqa: E402
from freetoken.kernels._membw import measure_read_bandwidth  # noqa: E402
from freetoken.kernels._numba import load_numba  # noqa: E402

HK, HV, DK, DV = 16, 32, 128, 128
STATE_BYTES = HV * DK * DV * 4


def inputs(rng, T, N):
    """q, k, v, a, b, A_log, dt_bias and N zero-initialised state rows for T tokens."""
    f = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    A_log = np.log(rng.uniform(1.0, 16.0, HV)).astype(np.float32)
    return (f(T, HK, DK), f(T, HK, DK), f(T, HV, DV), f(T, HV) * 2, f(T, HV), A_log,
            f(HV) - 2, np.zeros((N, HV, DK, DV), np.float32))


def timed(fn, repeats):
    """Seconds of ``repeats`` calls fn(i) after one warm-up (numba compiles on the first)."""
    fn(-1)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return times


def bench_decode(rng, B, pool_mib, repeats):
    N = max(2 * B, pool_mib * 2 ** 20 // STATE_BYTES)
    *ins, states = inputs(rng, B, N)
    states += np.float32(0.01)                       # touch every page
    slot_sets = [rng.permutation(N)[:B].astype(np.int32) for _ in range(repeats + 1)]
    starts = np.arange(B + 1, dtype=np.int32)
    out = np.empty((B, HV, DV), np.float32)
    times = timed(lambda i: gdn_rule.cpu(*ins, states, slot_sets[i], starts, out), repeats)
    return row("decode", B, B, times, 2 * B * STATE_BYTES)


def bench_prefill(rng, T, form, repeats):
    *ins, states = inputs(rng, T, 1)
    fresh = [states.copy() for _ in range(repeats + 1)]     # zero states, made outside the timing
    slots, starts = np.zeros(1, np.int32), np.array([0, T], np.int32)
    out = np.empty((T, HV, DV), np.float32)
    saved = gdn_rule.CHUNKED_MIN_T
    if form != "cpu":
        gdn_rule.CHUNKED_MIN_T = 64 if form == "chunked" else None
    try:
        times = timed(lambda i: gdn_rule.cpu(*ins, fresh[i], slots, starts, out), repeats)
    finally:
        gdn_rule.CHUNKED_MIN_T = saved
    return row(f"prefill {form}", 1, T, times, 2 * STATE_BYTES)


def row(name, B, tokens, times, nbytes):
    best, med = min(times), statistics.median(times)
    return dict(case=name, batch=B, tokens=tokens, ms_best=1e3 * best, ms_median=1e3 * med,
                tok_s=tokens / best, gbs_best=nbytes / best / 1e9)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16", help="decode batch sizes")
    ap.add_argument("--prefill", default="512", help="prefill lengths ('' off)")
    ap.add_argument("--threads", type=int, default=None, help="numba threads (default: all)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--pool-mib", type=int, default=1024, help="decode state pool size")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gdn.json"))
    args = ap.parse_args(argv)
    numba = load_numba()
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    bw = measure_read_bandwidth(nbytes=1 << 30, repeats=5)
    rows = [bench_decode(rng, int(B), args.pool_mib, args.repeats)
            for B in args.batches.split(",") if B]
    for T in (int(t) for t in args.prefill.split(",") if t):
        rows += [bench_prefill(rng, T, form, max(3, args.repeats // 4))
                 for form in ("recurrent", "chunked", "cpu")]
    for r in rows:
        r["read_gbs"], r["fraction"] = bw, r["gbs_best"] / bw
    report(rows, args, numba.get_num_threads())


def report(rows, args, threads):
    print(f"{'case':<18} {'B':>3} {'tokens':>6} {'ms best':>8} {'median':>8} {'tok/s':>8} "
          f"{'GB/s':>7} {'frac':>6}")
    for r in rows:
        print(f"{r['case']:<18} {r['batch']:>3} {r['tokens']:>6} {r['ms_best']:>8.3f} "
              f"{r['ms_median']:>8.3f} {r['tok_s']:>8.0f} {r['gbs_best']:>7.2f} "
              f"{r['fraction']:>6.0%}")
    meta = dict(threads=threads, cpu=platform.processor() or platform.machine(),
                cores=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M"),
                load=os.getloadavg()[0], repeats=args.repeats, pool_mib=args.pool_mib,
                chunked_min_t=gdn_rule.CHUNKED_MIN_T, shape=dict(Hk=HK, Hv=HV, Dk=DK, Dv=DV))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"GB/s: state bytes read + written per call; frac: of a {rows[0]['read_gbs']:.1f} GB/s "
          f"numba read. threads {threads}, load {meta['load']:.1f}; wrote {args.out}")


if __name__ == "__main__":
    main()
