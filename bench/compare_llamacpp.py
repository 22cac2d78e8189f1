"""FreeToken's CPU path against llama.cpp on one checkpoint, side by side (decode, prefill, RSS, start-up).
Pairs: docs/performance.md, bench/_engines.py (the runs), bench/_llamacpp.py (build, convert, command
lines), bench/_child.py (timing), bench/_compare_report.py (table), freetoken/models/synth_export.py.

    python bench/compare_llamacpp.py [--model DIR | --synth medium] [--quant Q4_K_M] [--llama-cpp BUILD_DIR]
        [--convert-python PY] [--threads 2] [--rounds 3] [--contexts 64,2048,4096] [--decode 64]
        [--prefill 512,4096] [--first-prefill 512] [--hog-contexts 64] [--out bench/results/compare_llamacpp.json]

Model: a HF Qwen3-MoE directory, or synth:SPEC written once as one (``demo-model --synth``) under
FREETOKEN_HOME/compare_llamacpp/. llama.cpp: --llama-cpp, else the source vendored in the
llama-cpp-python sdist, built once under FREETOKEN_HOME/llama.cpp/ (Release, GGML_NATIVE). The
checkpoint is converted once to a bf16 GGUF by llama.cpp's own convert_hf_to_gguf.py, run by
--convert-python (it imports torch); a tokenizer hash it does not know gets --pre-tokenizer
(gpt-2: our byte-level BPE splits with the GPT-2 regex). FreeToken reads the HF directory; with
--quant TYPE both engines read one file, the bf16 GGUF quantized once by llama.cpp's llama-quantize.

Every run is its own process: --threads threads, batch 1, greedy. Within a round the engines
alternate run by run (who goes first swaps each round), after one warm-up run of each (numba
compile, page cache). FreeToken runs ``python -m freetoken generate`` on the directory with a fresh
random prompt per run, made of words that are one token each, so it is exactly N tokens and never
a prefix-cache hit; llama.cpp runs llama-bench (-r 1, its own random tokens) and llama-completion.

  decode tok/s at C tokens of context: a C-token prompt, then --decode tokens; the tokens after
      the first over the time after the first (FreeToken's summary line; llama-bench -d C -n N).
  prefill tok/s, P tokens: prompt tokens over the time to the first token, after a warm-up prompt
      of P tokens in the same process, as llama-bench times it (llama-bench -p P -n 0; FreeToken's
      LLM API in a child: a warm-up prompt of the same words reversed, then the timed one).
  first prefill tok/s, P tokens (--first-prefill): the same, the first prompt of a fresh process
      (FreeToken's `generate` summary line with --max-tokens 1; llama-bench --no-warmup): a
      process's first large arrays take fresh pages, its first calls their first-call costs.
  start to first output byte: process start to the first byte of generated text on stdout, a
      32-token prompt, warm page cache (the engine's model files are read just before); a first
      token that decodes to no text (random models emit padding ids) moves it by a decode step.
  peak RSS: ru_maxrss (wait4) of that start-up process: loading plus a short decode.
  decode tok/s on a shared box (--hog-contexts): the decode run again while another process keeps
      one core busy (`while True: pass`), started just before the run and killed after it.

Ratios are FreeToken / llama.cpp: >= 1 is FreeToken better for tok/s, <= 1 for RSS and start-up.
The last column takes the ratio within each round (the two engines back to back) and gives their
median and range: on a box whose speed drifts between rounds it is the steadier figure.
Before the rounds both engines continue one prompt greedily for --check-tokens tokens; the report
says whether the prompt ids and how many leading generated ids agree (llama.cpp's ids come from
its session file, --prompt-cache).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import _compare_report as report                       # noqa: E402
import _llamacpp as llamacpp                           # noqa: E402
from _child import busy_core, run_env                  # noqa: E402
from _engines import STARTUP_DECODE, FreeTokenRuns, LlamaCppRuns   # noqa: E402
from _machine import machine                           # noqa: E402
from freetoken.env import home                         # noqa: E402

STARTUP_TOKENS = 32       # prompt of the start-up / RSS runs and of the greedy check
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face Qwen3-MoE directory")
    src.add_argument("--synth", help="a synthetic model spec, e.g. medium or qwen3-30b-a3b,layers=12 (default: medium)")
    ap.add_argument("--llama-cpp", help="a llama.cpp build dir (llama-bench, llama-completion; convert_hf_to_gguf.py "
                                        "in it or above); default: build the llama-cpp-python sdist's once")
    ap.add_argument("--quant", help="quantize the GGUF with llama-quantize (Q8_0, Q4_K_M, ...) and run both engines on it")
    ap.add_argument("--convert-python", default=sys.executable, help="python that runs llama.cpp's converter (needs torch)")
    ap.add_argument("--pre-tokenizer", default="gpt-2", help="GGUF pre-tokenizer for a tokenizer hash llama.cpp does not know")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contexts", type=_ints, default=[64, 2048, 4096], help="decode context depths, comma list")
    ap.add_argument("--decode", type=int, default=64, help="tokens generated per decode run")
    ap.add_argument("--prefill", type=_ints, default=[512, 4096], help="prefill prompt lengths, comma list")
    ap.add_argument("--first-prefill", type=_ints, default=[512],
                    help="prompt lengths timed again as a fresh process's first prompt, comma list")
    ap.add_argument("--hog-contexts", type=_ints, default=[64],
                    help="decode depths measured again with another process spinning on one core (a shared box)")
    ap.add_argument("--check-tokens", type=int, default=64, help="greedy ids compared between the engines (0: skip)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel jobs of the llama.cpp build")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "compare_llamacpp.json"))
    args = ap.parse_args(argv)
    if args.model is None and args.synth is None:
        args.synth = "medium"
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# --- the model, in both formats --------------------------------------------------------------

def prepare_model(args, cache: Path) -> tuple[Path, Path]:
    """(HF directory, its cache dir): --model as given, or synth:SPEC exported once."""
    if args.model:
        hf = Path(args.model).expanduser().resolve()
        stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(hf.glob("*.safetensors"))]
        key = hashlib.sha1(repr((str(hf), stamp)).encode()).hexdigest()[:10]
        return hf, cache / f"{hf.name}-{key}"
    spec = args.synth.removeprefix("synth:")
    where = cache / ("synth-" + re.sub(r"[^A-Za-z0-9.=-]+", "_", spec))
    hf = where / "hf"
    if not (hf / "config.json").is_file():
        print(f"# writing synth:{spec} to {hf}", flush=True)
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=where) as tmp:
            # in a process of its own: a child inherits its parent's peak RSS at fork (Linux keeps
            # the old mm's high-water mark across exec), so a bench that held the weights would
            # report their size as every later run's peak RSS
            subprocess.run([sys.executable, "-m", "freetoken", "demo-model", str(Path(tmp) / "hf"), "--synth", spec],
                           check=True)
            (Path(tmp) / "hf").rename(hf)                       # in place whole, or not at all
    return hf, where


def prompt_words(hf: Path) -> list[str]:
    """' word' strings the model's tokenizer encodes as one token each (and so any run of them as
    one token per word: the byte-level pre-tokenizer splits before each space)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    vocab = tok.get_vocab()
    words = [" " + w[1:] for w in vocab if re.fullmatch(r"Ġ[a-z]{2,6}", w)]
    words = sorted(w for w in words if tok.encode(w).ids == [vocab["Ġ" + w[1:]]])
    if len(words) < 50:
        raise SystemExit(f"{hf}: too few single-token words ({len(words)}) to build random prompts")
    return words


def make_prompt(words: list[str], n: int, rng: random.Random) -> str:
    return "".join(rng.choice(words) for _ in range(n))


# --- rounds -----------------------------------------------------------------------------------

def plan(args) -> list[tuple[str, int, object]]:
    """(measure key, prompt tokens, run(engine, text)) in the order each round runs them."""
    steps = [("startup", STARTUP_TOKENS, lambda e, t: e.startup(t, STARTUP_TOKENS))]
    steps += [(f"decode@{c}", c, lambda e, t, c=c: e.decode(t, c, args.decode)) for c in args.contexts]
    steps += [(f"prefill@{p}", p, lambda e, t, p=p: e.prefill(t, p)) for p in args.prefill]
    steps += [(f"first-prefill@{p}", p, lambda e, t, p=p: e.first_prefill(t, p)) for p in args.first_prefill]
    steps += [(f"decode@{c}+hog", c, lambda e, t, c=c: _hogged(e.decode, t, c, args.decode))
              for c in args.hog_contexts]
    return steps


def _hogged(run, *a):
    with busy_core():
        return run(*a)


def run_rounds(engines, steps, rounds: int, words, rng, after_round=lambda samples, done: None) -> dict:
    samples = {key: {e.name: [] for e in engines} for key, _, _ in steps}
    for r in range(rounds):
        order = engines if r % 2 == 0 else engines[::-1]     # neither engine always runs first
        for key, tokens, run in steps:
            text = make_prompt(words, tokens, rng)              # the same fresh prompt for both
            for e in order:
                load = os.getloadavg()[0]      # how busy the shared box was: read numbers with it
                m = {**run(e, text), "load_1m_before": load}
                samples[key][e.name].append(m)
                print(f"  round {r + 1}/{rounds} {key:14s} {e.name:9s} {report.brief(m)}", flush=True)
        after_round(samples, r + 1)
    return samples


def greedy_check(engines, words, n: int, rng) -> dict:
    text = make_prompt(words, STARTUP_TOKENS, rng)
    (p_ft, ft), (p_lc, lc) = (e.greedy_ids(text, n) for e in engines)
    same = next((i for i, (a, b) in enumerate(zip(ft, lc)) if a != b), min(len(ft), len(lc)))
    return {"tokens": n, "prompt_ids_equal": p_ft == p_lc, "identical_prefix": same,
            "freetoken": ft, "llama_cpp": lc, "prompt_ids": p_ft}


def warm_up(engines, words, rng) -> dict:
    """One start-up run each, not counted: numba compiles on a first start, the page cache fills."""
    text = make_prompt(words, STARTUP_TOKENS, rng)
    return {e.name: e.startup(text, STARTUP_TOKENS) for e in engines}


def setup(args):
    """(engines, hf dir, gguf, max_len): llama.cpp found or built, the model in both formats."""
    lc = llamacpp.locate(args.llama_cpp, home() / "llama.cpp", args.jobs)
    hf, where = prepare_model(args, home() / "compare_llamacpp")
    gguf = llamacpp.convert(lc, hf, where / "model-bf16.gguf", args.convert_python, args.pre_tokenizer)
    if args.quant:
        gguf = llamacpp.quantize(lc, gguf, args.quant, args.threads)
    # one context length for every run of both engines, so their KV reservations match
    max_len = max(max(args.contexts, default=0) + args.decode, max(args.prefill + args.first_prefill, default=0) + 1,
                  STARTUP_TOKENS + max(args.check_tokens, STARTUP_DECODE)) + 16
    engines = [FreeTokenRuns(gguf if args.quant else hf, args.threads, max_len, args.timeout),
               LlamaCppRuns(lc, gguf, args.threads, max_len, args.timeout)]
    return engines, hf, gguf, max_len


def main(argv=None) -> int:
    args = parse_args(argv)
    engines, hf, gguf, max_len = setup(args)
    words, rng = prompt_words(hf), random.Random(args.seed)
    info = machine()
    ckpt = gguf.stat().st_size if args.quant else sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    lc = engines[1].lc
    print(f"# {info['cpu']['model']}, {info['cores']} cores, {args.threads} threads, {info['date_utc']} UTC; "
          f"{args.model or 'synth:' + args.synth}{' ' + args.quant if args.quant else ''} ({ckpt / 1e9:.2f} GB checkpoint); llama.cpp "
          f"{lc.info.get('commit', lc.info.get('source'))}", flush=True)
    warm = warm_up(engines, words, rng)
    check = greedy_check(engines, words, args.check_tokens, rng) if args.check_tokens else None
    print(report.check_line(check), flush=True)
    result = {"machine": info, "llama_cpp": {**lc.info, "bench": str(lc.bench), "completion": str(lc.completion)},
              "model": {"hf_dir": str(hf), "gguf": str(gguf), "checkpoint_bytes": ckpt,
                        "gguf_bytes": gguf.stat().st_size},
              "flags": vars(args), "max_model_len": max_len, "env": run_env(engines[0].env),
              "commands": commands(engines, args), "warm_up": warm, "greedy_check": check}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(samples, done):      # after every round: a run cut short still leaves its numbers
        result["llama_cpp"]["llama_bench_reports"] = engines[1].record
        result["llama_cpp"]["repack"] = engines[1].repack      # False: its repacked kernels crashed here
        rows = report.summarize(samples)
        out.write_text(json.dumps({**result, "rounds_done": done, "rows": rows, "samples": samples},
                                  indent=1, default=str))
        return rows

    samples = run_rounds(engines, plan(args), args.rounds, words, rng, save)
    print(report.table(save(samples, args.rounds), args.threads, args.rounds, args.quant or "bf16"))
    print(report.check_line(check))
    print(f"wrote {out}")
    return 0


def commands(engines, args) -> dict:
    """One command line of each kind, for the record (the prompt text elided)."""
    ft, lc = engines
    depth = max(args.contexts, default=64)
    cmds = {"freetoken": ft.command("<N-token prompt>", args.decode),
            "freetoken prefill (warm)": [sys.executable, "-c", "<bench/_engines.py _FT_WARM_PREFILL>",
                                         "<model, threads, max_len, warm-up text, text>"],
            "llama-bench decode": llamacpp.bench_cmd(lc.lc, lc.gguf, lc.threads, 0, args.decode, depth),
            "llama-completion": llamacpp.completion_cmd(lc.lc, lc.gguf, lc.threads, "<prompt>", STARTUP_DECODE,
                                                        lc.max_len)}
    return {k: [str(c) for c in cmd] for k, cmd in cmds.items()}


if __name__ == "__main__":
    sys.exit(main())
