"""Replay routing traces through expert-cache policies and report the miss rate vs cache capacity.

Policies, all at the same total number of slots S (a percentage of all L*E experts):
  global-lru     one LRU over all layers: freetoken.moe.residency.SlotCache, fetch every miss
  per-layer-lru  S split evenly over the layers, one SlotCache per layer (n/a when a layer's
                 share cannot hold one step's experts)
  static         the S most-used (layer, expert) pairs of the warm-up part, never changed
  belady         global optimum with the trace's look-ahead (evict the farthest next use),
                 started from the best preloaded cache: the floor of the LRUs (every miss is
                 loaded, as offload must)
  belady-bypass  the same, but a miss may stay out of the cache (run on the CPU) when every
                 resident is needed sooner: the floor of every policy here, static and q* too
  q*-phi=X       (with --phi X) the global cache under the hybrid q* rule: misses not fetched
                 run on the CPU, so they count as misses and do not disturb the cache
                 (+fill: with --min-fill, the same with at least one fill per layer-step)
Miss rate = misses / routed, both in distinct experts per layer-step, over the part of the trace
after --warmup (every policy sees the warm-up part first; static learns from it).

With --trace (repeatable), the recorded traces are replayed next to synthetic traces of the first
one's shape (L, E, k), at each --rho, unless --no-synthetic.

  .venv/bin/python bench/lru_replay.py                      # synthetic traces, < 60 s
  .venv/bin/python bench/lru_replay.py --trace bench/traces/demo_code.npz \
      --trace bench/traces/demo_chat.npz --out r.json --plot r.png
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from freetoken.moe.residency import SlotCache                    # noqa: E402
from freetoken.moe.split import FetchPolicy                      # noqa: E402
from freetoken.moe.trace import load_trace, shared_consecutive, synthetic_trace  # noqa: E402

CAPACITIES = (5, 10, 15, 20, 30, 40, 50, 60, 80, 100)
NEVER = 1 << 62


def global_lru(steps, L, E, S, start, policy=FetchPolicy.fetch_all()):
    """Misses/routed of one SlotCache over all layers; steps: [(layer, ids int32[T,k])]."""
    cache, base = SlotCache(L, E, S), None
    for i, (j, ids) in enumerate(steps):
        if i == start:
            base = _tally(cache.counters)
        cache.step(j, ids.copy(), policy)
    return _rate(_tally(cache.counters), base)


def per_layer_lru(steps, L, E, S, start):
    """Misses/routed of L SlotCaches of S/L slots each; None if a share is below one step's need."""
    shares = [S // L + (j < S % L) for j in range(L)]
    if min(shares) < max(len(set(ids.ravel().tolist())) for _, ids in steps):
        return None
    caches, base = [SlotCache(1, E, n) for n in shares], None
    fetch = FetchPolicy.fetch_all()
    for i, (j, ids) in enumerate(steps):
        if i == start:
            base = _sum_tallies(caches)
        caches[j].step(0, ids.copy(), fetch)
    return _rate(_sum_tallies(caches), base)


def static(steps, L, E, S, start):
    """Misses/routed of a fixed placement: the S most-used (layer, expert) pairs before `start`."""
    counts = Counter(j * E + e for j, ids in steps[:start] for e in set(ids.ravel().tolist()))
    placed = set(sorted(range(L * E), key=lambda f: (-counts[f], f))[:S])   # ties: lower id
    misses = routed = 0
    for j, ids in steps[start:]:
        distinct = {j * E + e for e in ids.ravel().tolist()}
        routed += len(distinct)
        misses += len(distinct - placed)
    return misses / max(routed, 1)


def belady(steps, L, E, S, start, bypass=False):
    """Misses/routed of Belady's MIN on the scored part, from the best possible start: the cache
    preloaded with the first S distinct (layer, expert) pairs it routes. On a miss, evict the
    resident not routed in this step whose next use is farthest away. With bypass, a miss whose
    next use is farther than every evictable resident's is not loaded (it runs on the CPU)."""
    flat = [sorted({j * E + e for e in ids.ravel().tolist()}) for j, ids in steps[start:]]
    next_use, last = [None] * len(flat), {}
    for t in range(len(flat) - 1, -1, -1):
        next_use[t] = [last.get(f, NEVER) for f in flat[t]]
        last.update((f, t) for f in flat[t])
    preload = list(dict.fromkeys(f for ids in flat for f in ids))[:S]
    resident = {f: last[f] for f in preload}           # flat id -> next use (here: first use)
    heap = [(-nu, f) for f, nu in resident.items()]     # max-heap on next use, lazy deletion
    heapq.heapify(heap)
    misses = routed = 0
    for t, ids in enumerate(flat):
        uses, routed_now = dict(zip(ids, next_use[t])), set(ids)
        new = sorted((f for f in ids if f not in resident), key=lambda f: (uses[f], f))
        misses, routed = misses + len(new), routed + len(ids)
        for f in ids:                                  # hits: refresh their next use first
            if f in resident:
                resident[f] = uses[f]
                heapq.heappush(heap, (-uses[f], f))
        for f in new:                                  # soonest needed first
            if len(resident) >= S:
                nu, victim = _pop_farthest(resident, heap, routed_now)
                if bypass and nu <= uses[f]:
                    heapq.heappush(heap, (-nu, victim))
                    continue
                del resident[victim]
            resident[f] = uses[f]
            heapq.heappush(heap, (-uses[f], f))
    return misses / max(routed, 1)


def belady_bypass(steps, L, E, S, start):
    return belady(steps, L, E, S, start, bypass=True)


def _pop_farthest(resident, heap, routed):
    """(next use, id) of the resident with the farthest next use not routed in this step."""
    aside = []
    while True:
        neg, f = heapq.heappop(heap)
        if resident.get(f) != -neg:
            continue                                   # stale entry (refreshed or evicted)
        if f in routed:
            aside.append((neg, f))
            continue
        break
    for item in aside:
        heapq.heappush(heap, item)
    return -neg, f


def _tally(counters):
    return int(counters["misses"].sum()), int(counters["hits"].sum() + counters["misses"].sum())


def _sum_tallies(caches):
    pairs = [_tally(c.counters) for c in caches]
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def _rate(end, base):
    base = base or (0, 0)
    return (end[0] - base[0]) / max(end[1] - base[1], 1)


def replay(trace, capacities, warmup, phis, min_fill=False):
    """Rows of {capacity_pct, slots, policy: miss rate} for one trace."""
    L, E = trace.num_layers, trace.num_experts
    steps = list(trace.layer_steps())
    start = int(len(steps) * warmup)
    need = max(len(set(ids.ravel().tolist())) for _, ids in steps)
    rows = []
    for pct in capacities:
        S = min(L * E, max(math.ceil(round(pct / 100 * L * E, 9)), need))
        row = {"capacity_pct": pct, "slots": S}
        for name, fn in POLICIES.items():
            row[name] = fn(steps, L, E, S, start)
        for phi in phis:
            row[f"q*-phi={phi:g}"] = global_lru(steps, L, E, S, start, FetchPolicy.fraction(phi))
            if min_fill:
                row[f"q*-phi={phi:g}+fill"] = global_lru(steps, L, E, S, start,
                                                         FetchPolicy.fraction(phi, min_fill=1))
        rows.append(row)
    return rows


POLICIES = {"global-lru": global_lru, "per-layer-lru": per_layer_lru, "static": static,
            "belady": belady, "belady-bypass": belady_bypass}


def synthetic_traces(args, like=None):
    """Synthetic traces at each --rho, of the shape of trace `like` if given, else of the flags."""
    L, E, k = ((like.num_layers, like.num_experts, like.top_k) if like is not None
               else (args.layers, args.experts, args.top_k))
    return [synthetic_trace(L, E, k, args.steps, rho=rho, zipf_s=args.zipf, seed=args.seed)
            for rho in args.rho]


def all_traces(args):
    recorded = [load_trace(p) for p in args.trace]
    if args.no_synthetic and recorded:
        return recorded
    return recorded + synthetic_traces(args, recorded[0] if recorded else None)


def per_layer_shared(trace) -> list[float]:
    """Experts shared with the previous token per layer: the recorder's per-sequence numbers
    (meta "locality", bench/record_traces.py) when present, else over the whole trace."""
    if "locality" in trace.meta:
        return [float(r["shared"]) for r in trace.meta["locality"]]
    return shared_consecutive(trace).tolist()


def describe(trace) -> tuple[str, str]:
    """A short name and a one-line description of the trace (shape, length, locality)."""
    m = trace.meta
    name = (f"synthetic rho={m['rho']:g} zipf={m['zipf_s']:g}" if m.get("source") == "synthetic"
            else f"{m.get('model') or 'recorded'}: {m.get('workload', 'recorded')}")
    shared = per_layer_shared(trace)
    k, E = trace.top_k, trace.num_experts
    return name, (f"L={trace.num_layers} E={E} k={k}, {trace.num_layer_steps()} layer-steps; "
                  f"shared with the previous token per layer "
                  f"{' '.join(f'{v:.2f}' for v in shared)} (uniform {k * k / E:.2f})")


def print_table(title, rows):
    names = [k for k in rows[0] if k not in ("capacity_pct", "slots")]
    print(f"\n{title}")
    print(f"{'cap%':>5} {'slots':>6} " + " ".join(f"{n:>14}" for n in names))
    for r in rows:
        cells = " ".join(f"{'n/a':>14}" if r[n] is None else f"{r[n]:>14.3f}" for n in names)
        print(f"{r['capacity_pct']:>5} {r['slots']:>6} {cells}")


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = min(3, len(results))
    rows_ = -(-len(results) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5.5 * cols, 4.2 * rows_), squeeze=False)
    for ax in axes.flat[len(results):]:
        ax.axis("off")
    for ax, res in zip(axes.flat, results):
        rows = res["rows"]
        for name in [k for k in rows[0] if k not in ("capacity_pct", "slots")]:
            pts = [(r["capacity_pct"], r[name]) for r in rows if r[name] is not None]
            ax.plot(*zip(*pts), marker="o", ms=3, label=name)
        ax.set(title=f"{res['name']}\n{res['detail']}", ylabel="miss rate",
               xlabel="cache capacity (% of L*E experts)",
               ylim=(0, 1.02))
        ax.title.set_fontsize(6)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", action="append", default=[], help="routing trace .npz (repeatable)")
    ap.add_argument("--no-synthetic", action="store_true", help="with --trace: replay only those")
    ap.add_argument("--rho", type=float, nargs="+", default=[0.0, 0.3, 0.7],
                    help="synthetic traces: probability of keeping an expert from the previous step")
    ap.add_argument("--zipf", type=float, default=0.8, help="synthetic traces: Zipf exponent")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=400, help="synthetic traces: decode steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacities", type=int, nargs="+", default=list(CAPACITIES))
    ap.add_argument("--warmup", type=float, default=0.25, help="fraction of layer-steps not scored")
    ap.add_argument("--phi", type=float, nargs="*", default=[],
                    help="also replay the hybrid q* rule at these phi (misses left to the CPU)")
    ap.add_argument("--min-fill", action="store_true", help="with --phi: also with min-fill 1")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--plot", help="write a PNG of miss rate vs capacity here")
    args = ap.parse_args(argv)
    traces = all_traces(args)
    results, t0 = [], time.perf_counter()
    for trace in traces:
        rows = replay(trace, args.capacities, args.warmup, args.phi, args.min_fill)
        name, detail = describe(trace)
        results.append({"name": name, "detail": detail, "meta": trace.meta,
                        "shared_per_layer": per_layer_shared(trace), "rows": rows})
        print_table(f"{name} ({detail})", rows)
    print(f"\n{time.perf_counter() - t0:.1f} s; miss rate over the last {1 - args.warmup:.0%} "
          f"of each trace; per-layer-lru n/a: a layer's share of slots < one step's experts")
    if args.out:
        Path(args.out).write_text(json.dumps({"warmup": args.warmup, "traces": results}, indent=1))
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
