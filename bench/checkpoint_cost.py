"""What a recurrent-state checkpoint costs against what it saves, on this machine's backend: the
copy of one checkpoint in and out of each tier the backend has, against re-prefilling the tokens
it stands for; and what capturing states inside a prefill forward (state cuts) adds to it.
Pairs: freetoken/engine/checkpoints.py, models/state_cuts.py, docs/performance.md "Checkpoint
copies vs re-prefill".

    python bench/checkpoint_cost.py [--model synth:qwen3.6-35b-a3b,layers=4] [--tokens 512,2048]
        [--cuts 16] [--repeats 5] [--backend cpu] [--out bench/results/checkpoint_cost.json]

Copies: one checkpoint of the full 40-layer Qwen3.6-35B-A3B (30 GDN layers, 62.8 MiB fp32) and
one of --model, taken from a state row and restored into one (``CheckpointPool.take`` /
``restore``), host tier; on cuda also the device tier and a demotion (device -> host). Median
and range of --repeats.
Prefill: --model, one prompt of T random tokens per rep (a fresh one each time, so nothing is
reused), TTFT with no checkpoints (prefix cache off) and with --cuts checkpoints captured in the
same forward (interval anchors every T / cuts tokens), interleaved rep by rep. Per-token prefill
time scales to the full model by its layer count (40 / --model's), which the break-even column
uses: tokens whose re-prefill costs as much as one restore of the full model's checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # see bench/agent_edits.py: spinning BLAS threads

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]   # the checkout's freetoken; bench/ also when imported

from _machine import cpu_info  # noqa: E402


def median_range(xs) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def copy_costs(cfg, ops, repeats: int) -> dict:
    """ms to take / restore one checkpoint of `cfg` per tier of the backend. A take into fresh
    memory ("cold": the first of a pool, or one past what it keeps) and into a buffer the pool
    reuses ("reused": every later host take) are timed apart."""
    from freetoken.engine.checkpoints import CheckpointPool
    from freetoken.engine.state_pool import StatePool
    states = StatePool.for_model(cfg, 2, ops.xp)
    states.rule[...] = 1.0
    row = StatePool.bytes_per_row(cfg)
    tiers = {"host": lambda: CheckpointPool(4 * row, 0, ops)}
    if ops.name == "cuda":
        tiers["device"] = lambda: CheckpointPool(4 * row, 4 * row, ops)
    sync = (lambda: ops.xp.cuda.Stream.null.synchronize()) if ops.name == "cuda" else (lambda: None)
    out = {"bytes": row}
    for name, make in tiers.items():
        times = {"take_cold_ms": [], "take_reused_ms": [], "restore_ms": []}
        for _ in range(repeats):
            pool = make()
            for kind in ("take_cold_ms", "take_reused_ms"):
                t0 = time.perf_counter()
                ckpt = pool.take(states, 0, 1)
                sync()
                times[kind].append(1e3 * (time.perf_counter() - t0))
                if kind == "take_reused_ms":
                    continue
                node = type("Node", (), {"checkpoint": None})()
                pool.link(ckpt, node)
                t0 = time.perf_counter()
                pool.restore(ckpt, states, 1)
                sync()
                times["restore_ms"].append(1e3 * (time.perf_counter() - t0))
                pool.drop(ckpt)                               # its buffer goes to the pool's spares
        out[name] = {k: median_range(v) for k, v in times.items()}
    return out


def prefill_costs(base, model: str, backend: str, tokens: list[int], cuts: int, repeats: int) -> dict:
    """base: an engine of `model` without checkpoints; one with cuts is made per prompt length
    (they share the synth weights: agent_edits.share_synth_weights)."""
    from freetoken import LLM, SamplingParams
    engines = {"no checkpoints": base, f"{cuts} cuts": None}
    rng, rows = np.random.default_rng(0), {}
    for T in tokens:
        engines[f"{cuts} cuts"] = LLM(model=model, backend=backend, semantic_anchors=False,
                                      state_checkpoint_interval=max(T // cuts, 1), max_running_requests=1)
        times = {name: [] for name in engines}
        for rep in range(repeats + 1):                 # rep 0 compiles
            for name, llm in engines.items():
                ids = rng.integers(10, 4000, T).tolist()
                t0 = time.perf_counter()
                req = llm.core.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
                while req.finish_reason is None:
                    llm.core.step()
                if rep:
                    times[name].append(1e3 * (time.perf_counter() - t0))
        taken = engines[f"{cuts} cuts"].core.checkpoints.counters.taken
        engines[f"{cuts} cuts"].core.close()
        rows[T] = {name: median_range(t) for name, t in times.items()}
        rows[T]["checkpoints_taken_per_prompt"] = taken / (repeats + 1)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synth:qwen3.6-35b-a3b,layers=4")
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--cuts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint_cost.json"))
    args = ap.parse_args(argv)
    import logging
    logging.getLogger("freetoken").setLevel(logging.ERROR)
    from agent_edits import share_synth_weights
    from freetoken import LLM
    from freetoken.models.hf_config import model_config_from_dict
    from freetoken.models.synth_gdn import PRESETS
    share_synth_weights()            # the engines of one synth spec share one copy of its weights
    base = LLM(model=args.model, backend=args.backend, state_checkpoint_mb=0, max_running_requests=1)
    ops, small = base.core.ops, base.core.model_config
    real = model_config_from_dict(PRESETS["qwen3.6-35b-a3b"].hf_config())
    cpu = cpu_info()["model"]
    print(f"# {cpu}, {os.cpu_count()} cores, backend {args.backend}, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    copies = {"qwen3.6-35b-a3b (40 layers)": copy_costs(real, ops, args.repeats),
              args.model: copy_costs(small, ops, args.repeats)}
    fmt = lambda t: f"{t['median']:.2f} [{t['min']:.2f}-{t['max']:.2f}]"
    print("\n| checkpoint of | MiB | tier | take, fresh memory: ms (median [range]) | take, reused buffer |"
          " restore |\n|---|---|---|---|---|---|")
    for name, c in copies.items():
        for tier in ("host", "device"):
            if tier in c:
                t = c[tier]
                print(f"| {name} | {c['bytes'] / 2**20:.1f} | {tier} | {fmt(t['take_cold_ms'])} | "
                      f"{fmt(t['take_reused_ms'])} | {fmt(t['restore_ms'])} |")
    tokens = [int(x) for x in args.tokens.split(",") if x]
    prefill = prefill_costs(base, args.model, args.backend, tokens, args.cuts, args.repeats) if tokens else {}
    base.core.close()
    scale = real.num_layers / small.num_layers
    restore_real = copies["qwen3.6-35b-a3b (40 layers)"]["host"]["restore_ms"]["median"]
    print(f"\n| prompt tokens | TTFT ms, no checkpoints | TTFT ms, {args.cuts} cuts in the forward | ratio |"
          f" ms/token, full model (x{scale:g}) | tokens one full-model restore costs |\n|---|---|---|---|---|---|")
    for T, row in prefill.items():
        base, cut = row["no checkpoints"]["median"], row[f"{args.cuts} cuts"]["median"]
        per_token = scale * base / T
        row["full_model_ms_per_token"] = round(per_token, 3)
        row["break_even_tokens"] = round(restore_real / per_token, 2)
        print(f"| {T} | {base:.0f} [{row['no checkpoints']['min']:.0f}-{row['no checkpoints']['max']:.0f}] | "
              f"{cut:.0f} [{row[f'{args.cuts} cuts']['min']:.0f}-{row[f'{args.cuts} cuts']['max']:.0f}] | "
              f"{cut / base:.3f} | {per_token:.1f} | {row['break_even_tokens']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "args": vars(args), "copies": copies, "prefill": prefill,
                               "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}, indent=1) + "\n")
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
