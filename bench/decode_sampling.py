"""What per-request sampling features cost on the CPU path: decode tok/s with logprobs, penalties
and logit_bias against plain greedy, and prefill tok/s with prompt_logprobs; pairs:
docs/performance.md "Sampling features (logprobs, penalties)", freetoken/engine/sampler.py,
freetoken/kernels/logprobs.py, freetoken/kernels/penalties.py.

    python bench/decode_sampling.py [--tokens 64] [--batch 1,4] [--repeats 5] [--prompt 500]
        [--large synth:qwen3-30b-a3b,layers=1] [--moe-backend fused] [--threads N] [--quick]
        [--out bench/results/decode_sampling.json]

Two models: the packaged demo (vocab 4096) and --large, a synth model with Qwen3's vocab of
151936 (one layer by default, so the step is mostly the lm_head and the per-token ops matter
most; --large '' skips it). Both run with the prefix cache off, so a plain prompt is computed
whole, as a prompt_logprobs one always is.

Decode: each row is `batch` identical requests of a 6-token prompt and `tokens` greedy output
tokens, ignore_eos, one of the variants plain; logprobs=5; logprobs=20; penalties (frequency 0.5,
presence 0.5, repetition 1.1 and a 50-entry logit_bias); logprobs=20 + penalties. Decode time =
the whole run - a 1-token run (prefill and the first sample cancel out); decode tok/s =
batch * (tokens - 1) / that. One repeat runs every variant once, the order reversed every other
repeat (interleaved, so load on a shared machine hits all alike); "vs plain" is each repeat's
plain time / the variant's time, so it compares runs seconds apart. The table shows medians and
[min-max] over the repeats.
The prompt is that short on purpose: a prefill of >= 32 tokens (linear.BLAS_MIN_T) calls
OpenBLAS, whose idle threads then spin on the 2 cores and stall the numba kernels that follow
for ~100 ms on the demo model (measured 2026-12-01: a 1-token run of a 64-token prompt took
70-160 ms, 6.5 ms with OPENBLAS_NUM_THREADS=1), far more than a whole demo decode run.

Prefill (run last: its BLAS calls would stall what follows): a --prompt-token prompt (this repository's sampler.py, tokenized), max_tokens 1,
prompt_logprobs=1 against none, in pairs alternating the order; prefill tok/s = prompt / time.

Sampler alone: `sampler.sample` on random logits [batch, V] for requests of the decode prompt
with 64 distinct tokens in their output (the per-step work each variant adds outside the
forward), median of 50 calls, next to the plain step time from the decode rows.

--threads N sets numba's threads (as bench/decode_cpu.py): 1 is steadier when another process
keeps one of the 2 cores busy. --quick: 16 tokens, 2 repeats, a 200-token prompt (~35 s).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))   # bench/ also when imported, not run

from _machine import cpu_info  # noqa: E402

LARGE = "synth:qwen3-30b-a3b,layers=1"
DECODE_PROMPT = 6   # batch 4 x 6 < linear.BLAS_MIN_T: the decode rows never call BLAS (see above)
VARIANTS = ("plain", "logprobs=5", "logprobs=20", "penalties", "logprobs=20+penalties")


def penalty_options(vocab: int) -> dict:
    ids = np.linspace(1, vocab - 1, 50).astype(int)
    bias = np.random.default_rng(0).uniform(-2.0, 2.0, 50)
    return {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1,
            "logit_bias": tuple(zip(ids.tolist(), bias.round(3).tolist()))}


def variant_options(name: str, vocab: int) -> dict:
    opts = {}
    if "logprobs" in name:
        opts["logprobs"] = int(name.split("=")[1].split("+")[0])
    if "penalties" in name:
        opts.update(penalty_options(vocab))
    return opts


def med_range(xs, nd=1) -> dict:
    return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd), "max": round(max(xs), nd)}


def bench_model(label, llm, args, prompt_ids):
    from freetoken import SamplingParams
    from freetoken.engine.request import Request
    from freetoken.engine.sampler import sample
    vocab = llm.core.model_config.vocab_size
    decode_prompt = prompt_ids[:DECODE_PROMPT]

    def run(batch, tokens, name, prompt=decode_prompt, **extra):
        opts = {**variant_options(name, vocab), **extra}
        params = [SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, **opts) for i in range(batch)]
        t0 = time.perf_counter()
        outs = [llm.core.add_request(list(prompt), p) for p in params]
        while any(r.finish_reason is None for r in outs):
            llm.core.step()
        dt = time.perf_counter() - t0
        assert all(len(r.output_ids) == tokens for r in outs), [len(r.output_ids) for r in outs]
        if "logprobs" in opts:
            assert all(len(r.output_logprobs) == tokens for r in outs)
        if extra.get("prompt_logprobs") is not None:
            assert all(len(r.prompt_logprobs) == len(prompt) for r in outs)
        return dt

    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for name in VARIANTS:
            run(batch, 4, name)                                # warm (numba JIT, buffers)
        times = {name: [] for name in VARIANTS}
        for rep in range(args.repeats):                        # interleaved, order alternated
            for name in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                full, first = run(batch, args.tokens, name), run(batch, 1, name)
                times[name].append(full - first)
        for name in VARIANTS:
            ts = times[name]
            rows.append({"model": label, "vocab": vocab, "batch": batch, "sampling": name,
                         "tokens": args.tokens, "repeats": args.repeats,
                         "decode_tok_s": med_range([batch * (args.tokens - 1) / t for t in ts]),
                         "ms_per_step": med_range([1000 * t / (args.tokens - 1) for t in ts], 3),
                         "vs_plain": med_range([p / t for p, t in zip(times["plain"], ts)], 3),
                         "seconds": [round(t, 4) for t in ts]})

    ops, rng = llm.core.ops, np.random.default_rng(1)
    step_ms = {r["batch"]: r["ms_per_step"]["median"] for r in rows if r["sampling"] == "plain"}
    sampler = []
    for batch in step_ms:
        logits = rng.standard_normal((batch, vocab), dtype=np.float32)
        for name in VARIANTS:
            reqs = []
            for b in range(batch):
                r = Request(list(decode_prompt), SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                                                               **variant_options(name, vocab)),
                            rng=np.random.default_rng(b))
                r.output_counts = {int(t): 1 for t in rng.choice(vocab, 64, replace=False)}
                reqs.append(r)
            sample(ops, logits, reqs)
            ts = []
            for _ in range(50):
                t0 = time.perf_counter()
                sample(ops, logits, reqs)
                ts.append(time.perf_counter() - t0)
            us = 1e6 * statistics.median(ts)
            sampler.append({"model": label, "vocab": vocab, "batch": batch, "sampling": name,
                            "sample_us": round(us, 1),
                            "pct_of_plain_step": round(100 * us / (1000 * step_ms[batch]), 2)})

    prompt = prompt_ids[:args.prompt]
    kinds = (None, 1)
    for pl in kinds:
        run(1, 1, "plain", prompt=prompt, prompt_logprobs=pl)   # warm
    ptimes = {pl: [] for pl in kinds}
    for rep in range(args.repeats):
        for pl in (kinds if rep % 2 == 0 else kinds[::-1]):
            ptimes[pl].append(run(1, 1, "plain", prompt=prompt, prompt_logprobs=pl))
    prefill = [{"model": label, "vocab": vocab, "prompt_tokens": len(prompt),
                "sampling": "none" if pl is None else f"prompt_logprobs={pl}",
                "prefill_tok_s": med_range([len(prompt) / t for t in ptimes[pl]]),
                "ms": med_range([1000 * t for t in ptimes[pl]], 1),
                "vs_plain": med_range([p / t for p, t in zip(ptimes[None], ptimes[pl])], 3)}
               for pl in kinds]

    return rows, prefill, sampler


def fmt(m) -> str:
    return f"{m['median']} [{m['min']}-{m['max']}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=500, help="prompt tokens of the prefill rows")
    ap.add_argument("--large", default=LARGE, help="large-vocab model ('' skips it)")
    ap.add_argument("--moe-backend", default="fused")
    ap.add_argument("--threads", type=int, default=0, help="numba threads (0: numba's default)")
    ap.add_argument("--quick", action="store_true", help="--tokens 16 --repeats 2 --prompt 200")
    ap.add_argument("--out", default="bench/results/decode_sampling.json")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeats, args.prompt = 16, 2, 200
    import numba
    from freetoken import LLM
    threads = args.threads or numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(threads)
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    models = [("demo", None)] + ([(args.large, args.large)] if args.large else [])
    rows, prefill, sampler, loads = [], [], [], {}
    for label, model in models:
        t0 = time.perf_counter()
        llm = LLM(model=model, backend="cpu", moe_backend=args.moe_backend, enable_prefix_cache=False,
                  moe_cpu_threads=threads)
        loads[label] = round(time.perf_counter() - t0, 1)
        text = (ROOT / "freetoken/engine/sampler.py").read_text()
        prompt_ids = llm.encode_prompt(text)
        while len(prompt_ids) < args.prompt:
            prompt_ids = prompt_ids + prompt_ids
        r, p, s = bench_model(label, llm, args, prompt_ids)
        rows += r
        prefill += p
        sampler += s
        del llm
    print("| model | batch | sampling | decode tok/s | ms / step | vs plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {r['sampling']} | {fmt(r['decode_tok_s'])} | "
              f"{r['ms_per_step']['median']} | {fmt(r['vs_plain'])} |")
    print()
    print("| model | prompt tokens | sampling | prefill tok/s | ms | vs none |")
    print("|---|---|---|---|---|---|")
    for r in prefill:
        print(f"| {r['model']} | {r['prompt_tokens']} | {r['sampling']} | {fmt(r['prefill_tok_s'])} | "
              f"{r['ms']['median']} | {fmt(r['vs_plain'])} |")
    print()
    print("| model | batch | sampling | sampler.sample us | % of plain step |")
    print("|---|---|---|---|---|")
    for r in sampler:
        print(f"| {r['model']} | {r['batch']} | {r['sampling']} | {r['sample_us']} | "
              f"{r['pct_of_plain_step']} |")
    result = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu_info()["model"],
              "cores": os.cpu_count(), "threads": threads, "load_avg_start_end": [load0, os.getloadavg()[0]],
              "models": [m for m, _ in models], "load_s": loads,
              "moe_backend": args.moe_backend, "decode_prompt_tokens": DECODE_PROMPT,
              "tokens": args.tokens, "repeats": args.repeats,
              "penalties": {k: v for k, v in penalty_options(151936).items() if k != "logit_bias"}
              | {"logit_bias_entries": 50},
              "rows": rows, "prefill_rows": prefill, "sampler_rows": sampler,
              "wall_s": round(time.perf_counter() - t_start, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("rows")}))


if __name__ == "__main__":
    main()
