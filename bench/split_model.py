"""B_H of the CPU expert executor, and the modelled decode step time of the q* split.

1. Measures B_H here: the CPU executor (freetoken.moe.executor.CpuExecutor running
   freetoken.kernels.experts.cpu) at batch 1, top-k bf16 experts of a real shape (default H 2048,
   I 768, the upstream bf16 workload), each step routed to the next k experts of a bank much
   larger than the last-level cache, so every step streams its weights from DRAM.
   B_H = k * expert_bytes / median step time.
2. For the six reference machines (TABLE1 below; docs/design.md, The q* split) and m = 1..16
   misses, prints the modelled time of one layer-step's misses for q* (phi = B_P/B_H), q* with
   min-fill, qp (the same rule at phi' = B_P/(B_P+B_H), upstream's contended-pair form), pure
   offload (q = m) and pure CPU (q = 0), in two models:
     independent  fills and CPU run side by side at B_P and B_H: max(q/B_P, (m-q)/B_H) * bytes.
                  The rule's cost is exactly this makespan when its fraction is phi', so qp is
                  the optimum here ("best" column: brute force) and q* over-fetches.
     shared-DRAM  the fills' host reads take B_P of the CPU's DRAM bandwidth B_H while they run.
                  Every q <= m*phi then costs exactly m/B_H, the pure-CPU time: q* = m*phi is
                  the most misses that can be fetched for free (cache learning at no step cost).
   Real machines sit between the two; the bandwidth profile's contended pair measures where.

  .venv/bin/python bench/split_model.py --out split.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from freetoken.moe.split import fetch_count, frac_q16           # noqa: E402

BLOCK = 8                            # steps per measurement block
# The six reference machines: (B_P, B_H) in GB/s of desktop and workstation GPU boxes, PCIe fill
# bandwidth next to CPU expert bandwidth; phi 0.25-0.91, q(4) = 3, 1, 2, 4, 1, 1 (docs/design.md).
TABLE1 = [(52.7, 77.3), (25.1, 63.2), (25.3, 56.7), (49.0, 53.8), (11.8, 47.5), (51.5, 178.0)]


def measure_b_h(hidden, width, top_k, bank_mib, steps, threads):
    """GB/s of expert weights streamed at batch 1 through the executor, and by a direct call of
    the same kernel on this thread, in alternating blocks so machine noise hits both alike."""
    from freetoken.kernels.experts import cpu as experts_cpu
    from freetoken.moe.executor import CpuExecutor
    expert_bytes = 2 * (2 * width * hidden + hidden * width)
    E = max(4 * top_k, int(bank_mib * 2**20 // expert_bytes))
    rng = np.random.default_rng(0)
    # bf16 bits of positive normal numbers in [2^-7, 1): no denormals, no NaNs
    gate_up = rng.integers(0x3C00, 0x3F80, (E, 2 * width, hidden), dtype=np.uint16)
    down = rng.integers(0x3C00, 0x3F80, (E, hidden, width), dtype=np.uint16)
    x = (rng.standard_normal((1, hidden)) * 0.01).astype(np.float32)
    w = np.full((1, top_k), 1.0 / top_k, np.float32)
    times = {"executor": [], "direct": []}
    rounds = max(1, -(-steps // BLOCK))
    # Alternate blocks (not single steps: an OpenMP team that just finished spins for a while
    # and slows the other thread's team); one unscored warm-up block each, and each block's
    # first step unscored.
    plan = [("direct", False), ("executor", False)] + [("direct", True), ("executor", True)] * rounds
    s = 0
    with CpuExecutor(experts_cpu, threads=threads) as ex:
        run = {"direct": experts_cpu, "executor": ex.run}
        for name, scored in plan:
            for i in range(BLOCK + 1):
                ids = ((np.arange(top_k) + s * top_k) % E).astype(np.int32)[None, :]
                s += 1
                t0 = time.perf_counter()
                run[name](x, ids, w, gate_up, down)
                if scored and i:
                    times[name].append(time.perf_counter() - t0)
    step_bytes = top_k * expert_bytes
    out = {"expert_bytes": expert_bytes, "bank_experts": E, "bank_mib": E * expert_bytes / 2**20,
           "hidden": hidden, "width": width, "top_k": top_k,
           "scored_steps": {name: len(ts) for name, ts in times.items()}}
    for name, ts in times.items():
        out[f"{name}_median_gbs"] = step_bytes / float(np.median(ts)) / 1e9
        out[f"{name}_best_gbs"] = step_bytes / float(np.min(ts)) / 1e9
    out["b_h_gbs"] = out["executor_median_gbs"]
    return out


def t_independent(q, m, b_p, b_h):
    """Seconds per expert byte of a step that fetches q of m misses: max(q/B_P, (m-q)/B_H)."""
    return max(q / b_p, (m - q) / b_h)


def t_shared(q, m, b_p, b_h):
    """Same, but the fills' host reads (rate B_P) take B_P of the CPU's DRAM bandwidth B_H while
    they run; the CPU gets all of B_H once the fills are done."""
    t_fill, cpu_work = q / b_p, m - q
    if cpu_work == 0:
        return t_fill
    slow = max(b_h - b_p, 0.0)
    if cpu_work <= slow * t_fill:
        return max(t_fill, cpu_work / slow)
    return t_fill + (cpu_work - slow * t_fill) / b_h


def model_rows(b_p, b_h, expert_bytes, max_m):
    """Per m: q* (phi = B_P/B_H), q* with min-fill, q' (phi = B_P/(B_P+B_H)), the brute-force
    best q, and the step time (ms) of each split under both models."""
    ms = expert_bytes * 1e3                                  # (s per expert byte) -> ms
    frac, frac_pair, rows = frac_q16(b_p / b_h), frac_q16(b_p / (b_p + b_h)), []
    for m in range(1, max_m + 1):
        qs = {"q_star": fetch_count(m, frac), "q_pair": fetch_count(m, frac_pair)}
        qs["q_star_min_fill"] = max(qs["q_star"], 1)
        row = {"m": m, **qs}
        for name, t in (("independent", t_independent), ("shared_dram", t_shared)):
            best = min(range(m + 1), key=lambda f: (t(f, m, b_p, b_h), f))
            times = {k: t(q, m, b_p, b_h) * ms for k, q in qs.items()}
            row[name] = {**times, "best_q": best, "best": t(best, m, b_p, b_h) * ms,
                         "offload": t(m, m, b_p, b_h) * ms, "cpu": t(0, m, b_p, b_h) * ms}
        rows.append(row)
    return rows


COLS = ("q_star", "q_star_min_fill", "q_pair", "offload", "cpu")


def print_machine(label, b_p, b_h, rows):
    print(f"\n{label}: B_P {b_p:g} GB/s, B_H {b_h:g} GB/s, phi {b_p / b_h:.3f}, "
          f"phi' {b_p / (b_p + b_h):.3f}; ms per layer-step")
    head = " ".join(f"{c:>8}" for c in ("q*", "q*+fill", "qp", "offload", "cpu"))
    print(f"{'m':>3} {'q*':>3} {'qp':>3} {'best':>4} | independent {head} | shared-DRAM {head}")
    for r in rows:
        ind, sh = r["independent"], r["shared_dram"]
        a = " ".join(f"{ind[c]:>8.3f}" for c in COLS)
        b = " ".join(f"{sh[c]:>8.3f}" for c in COLS)
        print(f"{r['m']:>3} {r['q_star']:>3} {r['q_pair']:>3} {ind['best_q']:>4} | {'':>11} {a} |"
              f" {'':>11} {b}")


def min_fill_summary(machines):
    """Mean step-time ratio of q*+min-fill over q*, per model, over every machine and m."""
    out = {}
    for model in ("independent", "shared_dram"):
        ratios = [r[model]["q_star_min_fill"] / r[model]["q_star"] for m in machines for r in m["rows"]]
        out[model] = {"mean_ratio": float(np.mean(ratios)), "max_ratio": float(np.max(ratios))}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--bank-mib", type=float, default=1024, help="host bank size (>> last-level cache)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="executor threads (0: numba default)")
    ap.add_argument("--max-m", type=int, default=16)
    ap.add_argument("--pcie", type=float, help="also model this machine with this B_P (GB/s)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    bh = measure_b_h(args.hidden, args.width, args.top_k, args.bank_mib, args.steps, args.threads)
    print(f"B_H here: {bh['b_h_gbs']:.2f} GB/s median, {bh['executor_best_gbs']:.2f} best (CPU "
          f"executor thread; direct call {bh['direct_median_gbs']:.2f} / {bh['direct_best_gbs']:.2f}); "
          f"batch 1, top-{args.top_k} cold bf16 experts H {args.hidden} I {args.width}, "
          f"{bh['expert_bytes'] / 2**20:.2f} MiB each, {bh['scored_steps']['executor']} steps, "
          f"bank {bh['bank_mib']:.0f} MiB")
    machines = [(f"reference machine #{i + 1}", bp, bhh) for i, (bp, bhh) in enumerate(TABLE1)]
    if args.pcie:
        machines.append(("this machine", args.pcie, round(bh["b_h_gbs"], 2)))
    results = []
    for label, b_p, b_h in machines:
        rows = model_rows(b_p * 1e9, b_h * 1e9, bh["expert_bytes"], args.max_m)
        print_machine(label, b_p, b_h, rows)
        results.append({"label": label, "b_p_gbs": b_p, "b_h_gbs": b_h, "rows": rows})
    summary = min_fill_summary(results)
    print(f"\nmin-fill vs q*, step time ratio over all machines and m: "
          + ", ".join(f"{k} mean {v['mean_ratio']:.3f} max {v['max_ratio']:.3f}" for k, v in summary.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"measured": bh, "machines": results,
                                              "min_fill": summary}, indent=1))
    return bh, results


if __name__ == "__main__":
    main()
