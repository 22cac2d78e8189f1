"""GPU MoE backends end to end: decode and prefill speed of offload, hybrid and cpu at several
expert-cache sizes, with the machine's bandwidths; pairs: freetoken/moe/runtime.py (on CudaDevice),
freetoken/moe/prefill.py, freetoken/commands/bench.py (`bench bw`), docs/moe.md. Needs a GPU;
run by bench/gpu_check.sh.

    .venv/bin/python bench/gpu_moe.py [--model synth:qwen3-30b-a3b,layers=12] [--rates 0.1,0.25,0.5]
        [--tokens 32] [--prompt 4096] [--out bench/results/gpu_moe.json]

1. Bandwidths on the model's expert shape, as `bench bw` measures them: B_H (CPU executor, batch
   1, cold), B_P (fill kernel, pinned -> slots, cold rows), the contended pair; phi from them.
2. The model is loaded once; for each cache rate (the share of all L*E experts the slot pool
   holds: --moe-cache-rate, the same thing --gpu-memory-gb sizes) and backend (offload; hybrid at
   the measured phi; cpu, which has no cache) the MoE runtime is rebuilt in place, warmed up, and
   decode tok/s measured at batch 1 and 4 (32-token prompts; decode time = time of max_tokens=1+N
   minus time of max_tokens=1), with hit rate and fills per decode step (over all MoE layers).
3. Prefill tok/s of one --prompt-token prompt on offload, with and without overlap, per rate.
Routing: synth default knobs (embed_scale 8, qk_scale 2; see freetoken/models/synth.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from freetoken import LLM, SamplingParams                     # noqa: E402
from freetoken.commands import bench as bw                     # noqa: E402
from freetoken.moe import profile as prof                      # noqa: E402


def bandwidths(model: str, seconds: float) -> tuple[dict, float]:
    """B_H, B_P, contended pair (GB/s) on the model's expert shape, and phi (profile rule)."""
    from freetoken.moe.host_pool import pin_host_pool
    shape = bw.expert_shape(model)
    bank = bw.synthetic_bank(shape, 1 << 30)
    b_h = bw.measure_b_h(bank, shape, 0, 64)
    with pin_host_pool([bank]) as host:
        fill = bw.FillBench(host, shape)
        times = [fill.once() for _ in range(72)][8:]
        b_p = fill.bytes / float(np.median(times)) / 1e9
        contended = bw.measure_contended(fill, host.host(0), shape, 0, seconds)
    p = prof.Profile(gpu_uuid="bench", gpu_name="", format=shape["format"], expert_bytes=0,
                     b_h_gbs=b_h, b_p_gbs=b_p, contended=contended)
    return {"b_h_gbs": b_h, "b_p_gbs": b_p, "contended": contended}, prof.phi(p)


def swap_moe(llm: LLM, **changes) -> None:
    """Rebuild the engine's MoE runtime as the plan for these flag changes says (model and host
    pool kept; the engine's own flags are not rewritten: the bench plans with a copy)."""
    from freetoken.engine.plan import make_plan
    core = llm.core
    core.moe.close()
    core.plan = make_plan(core.model_config, core.config.replace(**changes), core.facts)
    core.moe = core.model.moe = core._make_moe()


def timed(llm: LLM, prompts, max_tokens: int) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - t0


def decode_row(llm: LLM, batch: int, tokens: int, rng) -> dict:
    prompts = [rng.integers(100, 4000, 32).tolist() for _ in range(batch)]
    timed(llm, prompts, 4)                                   # warm the cache and the kernels
    t_prefill = timed(llm, prompts, 1)
    before = llm.stats()["moe"]["total"]
    t_all = timed(llm, prompts, 1 + tokens)
    after = llm.stats()["moe"]["total"]
    d = {k: after[k] - before[k] for k in ("hits", "misses", "fills", "cpu_execs")}
    steps = tokens                                           # decode steps of the timed run
    routed = d["hits"] + d["misses"]
    return {"batch": batch, "tok_s": batch * tokens / max(t_all - t_prefill, 1e-9),
            "hit_rate": d["hits"] / routed if routed else 0.0,
            "fills_per_step": d["fills"] / steps, "cpu_execs_per_step": d["cpu_execs"] / steps}


def prefill_row(llm: LLM, prompt_len: int, overlap: bool, rng) -> dict:
    rt = llm.core.moe
    if rt.streamer is not None:
        rt.streamer.overlap = overlap and rt.streamer.S >= 2 * rt.streamer.E
    prompt = rng.integers(100, 4000, prompt_len).tolist()
    timed(llm, [prompt[:256]], 1)                            # warm-up
    t = min(timed(llm, [prompt], 1) for _ in range(2))
    return {"overlap": bool(rt.streamer and rt.streamer.overlap), "tok_s": prompt_len / t}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synth:qwen3-30b-a3b,layers=12")
    ap.add_argument("--rates", default="0.1,0.25,0.5")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=2.0, help="contended pair duration")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_moe.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    bws, phi = bandwidths(args.model, args.seconds)
    rates = [float(r) for r in args.rates.split(",")]
    llm = LLM(args.model, backend="cuda", moe_backend="offload", moe_cache_rate=rates[0],
              enable_prefix_cache=False, max_running_requests=4,
              chunked_prefill_size=max(8192, args.prompt))
    rows = []
    configs = [(r, "offload", {}) for r in rates] + [(r, "hybrid", {"moe_fetch_fraction": phi}) for r in rates]
    configs.append((None, "cpu", {}))
    for rate, backend, extra in configs:
        swap_moe(llm, moe_backend=backend, moe_cache_rate=rate, **extra)   # None: the cpu row
        for batch in (1, 4):
            rows.append({"rate": rate, "backend": backend, **decode_row(llm, batch, args.tokens, rng)})
            print(_fmt(rows[-1]), flush=True)
    prefill = []
    for rate in rates:
        swap_moe(llm, moe_backend="offload", moe_cache_rate=rate)
        for overlap in (True, False):
            prefill.append({"rate": rate, **prefill_row(llm, args.prompt, overlap, rng)})
            print(f"prefill rate {rate:.2f} overlap {prefill[-1]['overlap']!s:<5} "
                  f"{prefill[-1]['tok_s']:8.1f} tok/s", flush=True)
    llm.core.close()
    result = {"model": args.model, "host": platform.node(), "phi": phi, **bws,
              "decode": rows, "prefill": prefill, "date": time.strftime("%Y-%m-%d %H:%M")}
    _table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=_json))
    print(f"wrote {args.out}")
    return 0


def _fmt(r: dict) -> str:
    rate = f"{r['rate']:.2f}" if r["rate"] is not None else "  - "
    return (f"rate {rate} {r['backend']:<8} batch {r['batch']}  {r['tok_s']:7.1f} tok/s  "
            f"hit {r['hit_rate']:.3f}  fills/step {r['fills_per_step']:6.1f}  "
            f"cpu/step {r['cpu_execs_per_step']:6.1f}")


def _table(res: dict) -> None:
    c = res["contended"]
    print(f"\nB_H {res['b_h_gbs']:.1f} GB/s  B_P {res['b_p_gbs']:.1f} GB/s  contended: fill "
          f"{c['pcie_gbs']:.1f}, CPU {c['cpu_gbs']:.1f} GB/s  phi {res['phi']:.3f}")
    print(f"{'rate':>5} {'backend':<8} {'b1 tok/s':>9} {'b4 tok/s':>9} {'hit b1':>7} {'fills/step b1':>13}")
    by = {}
    for r in res["decode"]:
        by.setdefault((r["rate"], r["backend"]), {})[r["batch"]] = r
    for (rate, backend), b in by.items():
        print(f"{'-' if rate is None else f'{rate:.2f}':>5} {backend:<8} {b[1]['tok_s']:9.1f} "
              f"{b[4]['tok_s']:9.1f} {b[1]['hit_rate']:7.3f} {b[1]['fills_per_step']:13.1f}")
    for p in res["prefill"]:
        print(f"prefill {p['rate']:.2f} overlap={p['overlap']!s:<5} {p['tok_s']:9.1f} tok/s")


def _json(o):
    return dataclasses.asdict(o) if dataclasses.is_dataclass(o) else float(o)


if __name__ == "__main__":
    sys.exit(main())
