"""Decide three MoE defaults by measurement on the demo model's recorded routing (table + JSON).

(a) --moe-min-fill 0 or 1 and (b) the fill-set order (recency descending vs lowest id): replay
    bench/traces/demo_{code,chat,agent}.npz through SlotCache under the hybrid q* rule at each phi and
    cache size, and model each layer-step's time with bench/split_model.py's makespan models
    (independent: max(q/B_P, (m-q)/B_H); shared-DRAM: the fills' host reads take B_P of B_H).
(c) the prefill threshold: windows of T real prefill tokens (demo_prefill.npz), and for the
    qwen3-30b-a3b shape (E 128, k 8) synthetic routing calibrated to the demo's locality. Per
    layer: decode path = the residency step (q* fills over PCIe, the other misses on the CPU,
    each costing max(1, n/n_c) expert reads for n tokens) vs streaming the layer's E - R
    non-resident experts at B_P (double-buffered, compute hidden). Threshold = the smallest T
    from which streaming is cheaper (or the decode path cannot run: distinct experts > slots).
Times are in units of one expert read by the CPU (b/B_H), so only phi = B_P/B_H matters; B_H and
n_c (tokens per expert from which the CPU kernel is compute-bound) are measured here, B_P comes
from the six reference machines (split_model.TABLE1; this machine has no GPU).

  .venv/bin/python bench/policy_decisions.py --out bench/results/policy_decisions.json  # ~6 min
  .venv/bin/python bench/policy_decisions.py --skip-fill --n-c 2 --b-h 20     # (c) alone, given n_c
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]                     # run from a checkout

import split_model                                               # noqa: E402
from _machine import cpu_info                                    # noqa: E402
from freetoken.engine.plan_moe import rate_slots, step_need     # noqa: E402
from freetoken.moe.residency import SlotCache                    # noqa: E402
from freetoken.moe.split import FetchPolicy, fetch_count, frac_q16   # noqa: E402
from freetoken.moe.trace import load_trace, shared_consecutive, synthetic_trace  # noqa: E402

RATES = (0.10, 0.25, 0.50)
PHIS = sorted({round(bp / bh, 3) for bp, bh in split_model.TABLE1} | {0.1, 0.25})
VARIANTS = (("fill0/recency", 0, "recency"), ("fill1/recency", 1, "recency"),
            ("fill0/lowest_id", 0, "lowest_id"), ("fill1/lowest_id", 1, "lowest_id"))
T_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
QWEN3 = dict(name="qwen3-30b-a3b", layers=48, experts=128, top_k=8)
MACHINES = [(f"reference #{i + 1}", round(bp / bh, 3)) for i, (bp, bh) in enumerate(split_model.TABLE1)]


def slots_for(rate, L, E, k):
    """--moe-cache-rate as slots, at least one decode step's k experts for one running request
    (the least offload runs on)."""
    return min(L * E, max(rate_slots(rate, L * E), step_need(E, k, 1)))


def replay_mq(steps, L, E, S, policy, start):
    """Misses m and fills q of every layer-step from `start` on (int64 arrays), and the miss rate."""
    cache, m, q, hits = SlotCache(L, E, S), [], [], 0
    mc, hc = cache.counters["misses"], cache.counters["hits"]
    for i, (j, ids) in enumerate(steps):
        before, hit = int(mc[j]), int(hc[j])
        fills = cache.step(j, ids.copy(), policy)
        if i >= start:
            m.append(int(mc[j]) - before)
            q.append(len(fills))
            hits += int(hc[j]) - hit
    return np.asarray(m), np.asarray(q), sum(m) / max(sum(m) + hits, 1)


def token_times(m, q, phi, L):
    """Mean modelled time per token (units b/B_H) in both makespan models of split_model."""
    pairs, tokens = Counter(zip(m.tolist(), q.tolist())), len(m) / L
    out = {}
    for name, fn in (("independent", split_model.t_independent), ("shared_dram", split_model.t_shared)):
        out[name] = sum(n * fn(qq, mm, phi, 1.0) for (mm, qq), n in pairs.items() if mm) / tokens
    return out


def decide_fill(traces, warmup):
    """(a) and (b): one row per trace, cache rate, phi and variant."""
    rows = []
    for name, trace in traces.items():
        L, E, k = trace.num_layers, trace.num_experts, trace.top_k
        steps = list(trace.layer_steps())
        start = int(len(steps) * warmup)
        for rate in RATES:
            S = slots_for(rate, L, E, k)
            for phi in PHIS:
                for label, fill, order in VARIANTS:
                    m, q, miss = replay_mq(steps, L, E, S, FetchPolicy.fraction(phi, fill, order), start)
                    rows.append({"trace": name, "rate": rate, "slots": S, "phi": phi,
                                 "variant": label, "miss_rate": miss,
                                 "fills_per_token": float(q.sum() * L / len(m)),
                                 **token_times(m, q, phi, L)})
    return rows


def compare(rows, base, alt):
    """Ratio alt/base of the modelled time per (trace, rate, phi) cell, per model."""
    index = {(r["trace"], r["rate"], r["phi"], r["variant"]): r for r in rows}
    out = {}
    for model in ("independent", "shared_dram"):
        ratios = [index[key[:3] + (alt,)][model] / index[key][model]
                  for key in index if key[3] == base and index[key][model] > 0]
        out[model] = {"geomean": float(np.exp(np.mean(np.log(ratios)))), "min": float(min(ratios)),
                      "max": float(max(ratios)), "cells": len(ratios), "alt_better": int(sum(
                          r < 0.995 for r in ratios)), "alt_worse": int(sum(r > 1.005 for r in ratios))}
    return out


def print_fill(rows):
    print("\n(a, b) modelled decode time per token, units of one CPU expert read (b/B_H);"
          " independent | shared-DRAM; miss rate of fill0/recency")
    head = " ".join(f"{v[0]:>15}" for v in VARIANTS)
    print(f"{'trace':>9} {'rate':>4} {'phi':>5} {'miss':>5} | {head} | {head}")
    cells = {}
    for r in rows:
        cells.setdefault((r["trace"], r["rate"], r["phi"]), {})[r["variant"]] = r
    for (trace, rate, phi), v in cells.items():
        a, b = (" ".join(f"{v[x[0]][m]:>15.3f}" for x in VARIANTS) for m in ("independent", "shared_dram"))
        print(f"{trace[5:]:>9} {rate:>4.0%} {phi:>5.3f} {v['fill0/recency']['miss_rate']:>5.3f} | {a} | {b}")


def measure_cpu_curve(hidden, width, top_k, ns, bank_mib, reps):
    """CPU time of one expert for n tokens, relative to 1 token (the experts op as dispatched),
    measured in interleaved rounds over cold experts of a bank larger than the LLC."""
    from freetoken.kernels.experts import cpu as experts_cpu
    E = max(4 * top_k, int(bank_mib * 2**20 // (6 * width * hidden)))
    rng = np.random.default_rng(0)
    gate_up = rng.integers(0x3C00, 0x3F80, (E, 2 * width, hidden), dtype=np.uint16)
    down = rng.integers(0x3C00, 0x3F80, (E, hidden, width), dtype=np.uint16)
    times, s = {n: [] for n in ns}, 0
    for rep in range(reps + 1):
        for n in ns:
            ids = np.tile((np.arange(top_k) + s * top_k) % E, (n, 1)).astype(np.int32)
            s += 1
            x = (rng.standard_normal((n, hidden)) * 0.01).astype(np.float32)
            t0 = time.perf_counter()
            experts_cpu(x, ids, np.full((n, top_k), 1 / top_k, np.float32), gate_up, down)
            if rep:
                times[n].append((time.perf_counter() - t0) / top_k)
    t1 = float(np.median(times[ns[0]]))
    return {n: float(np.median(t)) / t1 for n, t in times.items()}


def fit_nc(curve, max_n=16):
    """n_c of the model max(1, n / n_c): median of n / ratio(n) over 4 <= n <= max_n (GEMV path)."""
    return float(np.median([n / r for n, r in curve.items() if 4 <= n <= max_n]))


def calibrate(trace, steps, seed):
    """(zipf_s, rho) of synthetic_trace matching the trace's shuffled (popularity) and
    consecutive-token (locality) shared experts, both averaged over layers."""
    want_mix, want_shared = (np.mean([r[k] for r in trace.meta["locality"]]) for k in ("shuffled", "shared"))
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    def shared(rho, s):
        return shared_consecutive(synthetic_trace(L, E, k, steps, rho=rho, zipf_s=s, seed=seed)).mean()
    zipf = min(np.arange(0.0, 2.01, 0.1), key=lambda s: abs(shared(0.0, s) - want_mix))
    rho = min(np.arange(0.0, 0.51, 0.025), key=lambda r: abs(shared(r, zipf) - want_shared))
    return float(round(zipf, 3)), float(round(rho, 3))


def prefill_windows(trace, T, count, rng):
    """Up to `count` windows ids[T,k] (layer, ids) of consecutive tokens of one layer: inside one
    prefill call for a prefill trace, else consecutive steps of a batch-1 trace."""
    if trace.meta.get("workload") == "prefill calls":
        calls = [(j, ids) for j, ids in trace.layer_steps() if len(ids) >= T]
    else:
        calls = [(j, trace.ids[trace.layer == j].astype(np.int32)) for j in range(trace.num_layers)]
    out = []
    for _ in range(count if calls else 0):
        j, ids = calls[int(rng.integers(len(calls)))]
        s = int(rng.integers(len(ids) - T + 1))
        out.append((j, ids[s:s + T]))
    return out


def window_cost(ids, E, S, R, usage, phi, n_c, rng):
    """(decode independent, decode shared-DRAM, stream) in units of b/B_H for one layer's chunk,
    and its distinct experts; decode is inf when they outnumber the cache's slots."""
    experts, n = np.unique(ids, return_counts=True)
    stream = (E - R) / phi
    if len(experts) > S:
        return math.inf, math.inf, stream, len(experts)
    resident = np.argsort(-(np.log(usage + 1e-9) + rng.gumbel(size=E)))[:R]   # popularity-drawn
    miss = ~np.isin(experts, resident)
    m = int(miss.sum())
    q = fetch_count(m, frac_q16(phi))
    on_cpu = rng.permutation(np.flatnonzero(miss))[: m - q]
    work = float(np.maximum(1.0, n[on_cpu] / n_c).sum())
    return max(q / phi, work), split_model.t_shared(q, q + work, phi, 1.0), stream, len(experts)


def threshold_rows(model, trace, num_layers, n_c, windows, seed):
    """(c): per phi and cache rate, mean costs per T and the threshold T* of both models; the
    cache has the slots of `num_layers` layers (the windows come from the trace's layers)."""
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    usage = [np.bincount(trace.ids[trace.layer == j].ravel(), minlength=E) for j in range(L)]
    rows = []
    for rate in RATES:
        S = slots_for(rate, num_layers, E, k)
        R = int(round(S / num_layers))
        for phi in PHIS:
            rng, costs = np.random.default_rng(seed), {}
            for T in T_GRID:
                ws = prefill_windows(trace, T, windows, rng)
                if ws:
                    c = np.array([window_cost(w, E, S, R, usage[j], phi, n_c, rng) for j, w in ws])
                    costs[T] = c.mean(0).tolist()
            star = {name: next((T for T, c in costs.items() if c[2] < c[i]), None)
                    for i, name in enumerate(("independent", "shared_dram"))}
            rows.append({"model": model, "rate": rate, "slots": S, "resident_per_layer": R,
                         "phi": phi, "threshold": star, "costs": costs})
    return rows


def print_thresholds(rows):
    print("\n(c) prefill threshold T*: the smallest prompt chunk (tokens) from which streaming whole "
          "layers beats the decode path; independent/shared-DRAM model; >N: not up to N")
    cols = list(dict.fromkeys((r["model"], r["rate"]) for r in rows))
    index = {(r["model"], r["rate"], r["phi"]): r for r in rows}
    print(f"{'machine':>12} {'phi':>5} " + " ".join(f"{m[:5] + ' ' + format(rt, '.0%'):>11}" for m, rt in cols))
    names = dict((phi, name) for name, phi in MACHINES)
    for phi in PHIS:
        cells = []
        for model, rate in cols:
            r = index[(model, rate, phi)]
            top = max(r["costs"]) if r["costs"] else 0
            cells.append("/".join(str(v) if v else f">{top}" for v in r["threshold"].values()))
        print(f"{names.get(phi, ''):>12} {phi:>5.3f} " + " ".join(f"{c:>11}" for c in cells))


def run_fill(traces, warmup):
    rows = decide_fill(traces, warmup)
    print_fill(rows)
    summary = {"min_fill_1_vs_0": compare(rows, "fill0/recency", "fill1/recency"),
               "lowest_id_vs_recency": compare(rows, "fill0/recency", "fill0/lowest_id"),
               "lowest_id_vs_recency_fill1": compare(rows, "fill1/recency", "fill1/lowest_id")}
    for key, val in summary.items():
        print(f"  {key}: " + "; ".join(f"{m} geomean {v['geomean']:.4f} [{v['min']:.3f}, {v['max']:.3f}]"
              f" better in {v['alt_better']}/{v['cells']}, worse in {v['alt_worse']}" for m, v in val.items()))
    return rows, summary


def run_thresholds(code, prefill, n_c, windows, seed):
    zipf, rho = calibrate(code, 1200, seed)
    synth = synthetic_trace(4, QWEN3["experts"], QWEN3["top_k"], 1200, rho=rho, zipf_s=zipf, seed=seed)
    print(f"\nsynthetic routing calibrated to demo_code: zipf_s {zipf}, rho {rho} "
          f"(shared {shared_consecutive(synth).mean():.2f} of 8 at E 128, uniform 0.50)")
    rows = (threshold_rows("demo", prefill, prefill.num_layers, n_c, windows, seed)
            + threshold_rows(QWEN3["name"], synth, QWEN3["layers"], n_c, windows, seed))
    for model in dict.fromkeys(r["model"] for r in rows):
        costs = next(r["costs"] for r in rows if r["model"] == model)
        print(f"  {model}: distinct experts per layer in T tokens: "
              + ", ".join(f"{T}: {c[3]:.1f}" for T, c in costs.items()))
    print_thresholds(rows)
    return {"zipf_s": zipf, "rho": rho}, rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=str(HERE / "traces"))
    ap.add_argument("--warmup", type=float, default=0.25)
    ap.add_argument("--windows", type=int, default=200, help="prefill windows per T")
    ap.add_argument("--n-c", type=float, help="skip measuring n_c (tokens per expert from which "
                    "the CPU kernel is compute-bound)")
    ap.add_argument("--b-h", type=float, help="skip measuring B_H (GB/s, demo expert shape)")
    ap.add_argument("--skip-fill", action="store_true", help="only (c), the prefill threshold")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    t0, d = time.perf_counter(), Path(args.traces)
    names = [n for n in ("demo_code", "demo_chat", "demo_agent", "demo_prefill") if (d / f"{n}.npz").exists()]
    traces = {n: load_trace(d / f"{n}.npz") for n in names}
    prefill = traces.pop("demo_prefill")
    measured = measure_here(args)
    fill_rows, summary = ([], {}) if args.skip_fill else run_fill(traces, args.warmup)
    calibration, t_rows = run_thresholds(traces["demo_code"], prefill, measured["n_c"],
                                         args.windows, args.seed)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"measured": measured, "phis": PHIS, "machines": MACHINES, "fill": fill_rows,
             "fill_summary": summary, "calibration": calibration, "thresholds": t_rows}, indent=1))


def measure_here(args):
    """n_c from the CPU experts kernel (qwen3-30b-a3b expert shape) and B_H (demo expert shape)."""
    out = {"cpu": cpu_info()["model"], "cores": os.cpu_count()}
    curve = None if args.n_c else measure_cpu_curve(2048, 768, 8, [1, 2, 4, 8, 12, 16, 32, 64], 384, 12)
    bh = ({"b_h_gbs": args.b_h, "expert_bytes": 6 * 256 * 128} if args.b_h
          else split_model.measure_b_h(256, 128, 4, 384, 48, 0))
    out.update(cpu_curve=curve, n_c=args.n_c or fit_nc(curve), b_h_demo_gbs=bh["b_h_gbs"],
               demo_expert_bytes=bh["expert_bytes"], unit_us=bh["expert_bytes"] / bh["b_h_gbs"] / 1e3)
    print(f"{out['cpu']}, {out['cores']} cores: n_c {out['n_c']:.2f} tokens/expert (curve {curve}); "
          f"B_H {out['b_h_demo_gbs']:.2f} GB/s at the demo expert shape: 1 unit = {out['unit_us']:.1f} us")
    return out


if __name__ == "__main__":
    main()
