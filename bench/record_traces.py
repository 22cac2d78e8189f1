"""Record routing traces of the demo model on held-out code, chats and agent sessions.

Writes four traces (format: freetoken/moe/trace.py) and prints the locality of each:
  demo_code.npz     decode routing of held-out code, teacher-forced: each snippet is fed one real
                    token per decode step (chunked prefill of 1 token: every step takes the decode
                    path), so routing follows real code, not the model's own continuations
  demo_chat.npz     decode routing of multi-turn chats (3 turns, sampled replies, prefix cache on)
  demo_agent.npz    decode routing of agent sessions: held-out synthetic Claude Code / Codex /
                    generic-tool conversations (tools/agent_corpus.py, a seed neither training nor
                    tools/eval_demo.py uses); at each assistant turn the model samples its reply
                    (the decode steps recorded), then the conversation goes on with the corpus's
                    own turn and tool results, as a harness would send them (prefix cache on)
  demo_prefill.npz  routing of prefill calls: one layer-step per (prefill call, layer) holding all
                    its tokens; code snippets prefilled whole, and each chat and agent turn's
                    uncached suffix
meta["seq_starts"] lists the steps where a new sequence (snippet or reply) starts.

The traces in the repository are tiny-agent-moe's (the default built-in model; --model picks
another). Held-out code: the demo model's README says 2% of the CPython 3.11 standard-library files
(15 files, 32,338 tokens), chosen by hash of the relative path, were never trained on. Among the
734 eligible files (no test/tests/idle_test/site-packages directories), the 15 with the lowest
SHA-256 of their relative path hold 32,323 tokens: 32,338 with one separator per document, so
this is that split (on Python 3.11; another version's stdlib gives a near but different set).

  .venv/bin/python bench/record_traces.py                   # about a minute on 2 cores
"""
from __future__ import annotations

import argparse
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from freetoken.engine.llm import LLM                             # noqa: E402
from freetoken.engine.request import SamplingParams              # noqa: E402
from freetoken.moe.trace import RoutingRecorder                  # noqa: E402
import agent_corpus as corpus                                   # noqa: E402
from agent_corpus import held_out_stdlib                        # noqa: E402

FOLLOW_UPS = ("Write Python code.", "Write more Python code.", "Now write a class.",
              "Write another function.", "Write a test for it.")
SYSTEM = "You are a helpful assistant."
AGENT_SEED = 5000       # agent_corpus seeds: training 0-2, tools/eval_demo.py 1000


class TraceTap:
    """Wraps an engine's MoE runtime: decode calls go to `decode`, prefill calls to `prefill`."""

    def __init__(self, moe, cfg, model: str):
        L, E, k = len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok
        self.moe = moe
        self.decode, self.prefill = RoutingRecorder(L, E, k, model), RoutingRecorder(L, E, k, model)
        self.decode_steps = self.prefill_steps = 0
        self.prefill_tokens: list[int] = []

    def forward(self, j, x, ids, weights, prefill=False):
        (self.prefill if prefill else self.decode).record(j, ids)
        if j == 0 and prefill:
            self.prefill_steps += 1
            self.prefill_tokens.append(int(ids.shape[0]))
        elif j == 0:
            self.decode_steps += 1
        return self.moe.forward(j, x, ids, weights, prefill)

    def __getattr__(self, name):
        return getattr(self.moe, name)


def engine(**options) -> tuple[LLM, TraceTap]:
    llm = LLM(options.pop("model", None), moe_backend="cpu", **options)
    tap = TraceTap(llm.core.moe, llm.core.model_config, llm.core.model_name)
    llm.core.model.moe = tap
    return llm, tap


def snippets(tokenizer, files, count: int, length: int, rng) -> list[list[int]]:
    """`count` windows of `length` tokens at random offsets, round-robin over the files; windows
    of one file do not overlap (a file too short for another window is skipped)."""
    docs = [tokenizer.encode(p.read_text(encoding="utf-8")) for p in files]
    used = [[] for _ in docs]
    out, i = [], 0
    while len(out) < count and i < 50 * count:
        d = i % len(docs)
        i += 1
        free = [s for s in range(0, len(docs[d]) - length + 1, length // 4)
                if all(abs(s - u) >= length for u in used[d])]
        if free:
            s = int(rng.choice(free))
            used[d].append(s)
            out.append(docs[d][s:s + length])
    return out


def record_code(snips, cores, model) -> tuple:
    """Teacher-forced decode trace of the snippets, and a prefill trace of the same snippets."""
    forced, tap = engine(model=model, chunked_prefill_size=1, enable_prefix_cache=False)
    starts = []
    for ids in snips:
        starts.append(tap.decode_steps)
        forced.generate(ids, SamplingParams(max_tokens=1))
    forced.core.close()
    trace = tap.decode.trace()
    trace.meta.update(workload="held-out code, teacher-forced decode", seq_starts=starts)
    whole, ptap = engine(model=model, enable_prefix_cache=False)
    for ids in snips[:cores]:
        whole.generate(ids, SamplingParams(max_tokens=1))
    whole.core.close()
    return trace, ptap


def record_chats(chats: int, turns: int, reply_tokens: int, seed: int, model) -> tuple:
    """Multi-turn chats with sampled replies; returns (decode trace, the tap with prefill calls)."""
    llm, tap = engine(model=model)
    rng, starts, lengths = np.random.default_rng(seed), [], []
    for c in range(chats):
        messages = [{"role": "system", "content": SYSTEM}] if c % 3 == 2 else []
        for t in range(turns):
            text = FOLLOW_UPS[0] if t == 0 else FOLLOW_UPS[int(rng.integers(len(FOLLOW_UPS)))]
            messages.append({"role": "user", "content": text})
            params = SamplingParams(max_tokens=reply_tokens, temperature=0.7, top_p=0.95,
                                    seed=seed * 1000 + c * 10 + t)
            starts.append(tap.decode_steps)
            out = llm.generate(llm.chat_prompt(messages), params)[0]
            messages.append({"role": "assistant", "content": out.text})
            lengths.append(len(out.token_ids))
    llm.core.close()
    trace = tap.decode.trace()
    trace.meta.update(workload=f"{chats} chats x {turns} turns, temperature 0.7, top-p 0.95",
                      seq_starts=starts, reply_tokens=lengths)
    return trace, tap


def record_agents(sessions: int, reply_tokens: int, seed: int, model) -> tuple:
    """Agent sessions: the model's sampled reply at every assistant turn, the corpus's turn kept."""
    llm, tap = engine(model=model)
    rng = random.Random(AGENT_SEED + seed)
    files, hs = corpus.Files(rng, corpus.stdlib_files()), corpus.harnesses()
    starts, lengths = [], []
    for s in range(sessions):
        c = corpus.conversation(rng, files, hs)
        msgs = c["messages"]
        for i in [i for i, m in enumerate(msgs) if m["role"] == "assistant"]:
            params = SamplingParams(max_tokens=reply_tokens, temperature=0.7, top_p=0.95, seed=seed * 1000 + s * 10 + i)
            starts.append(tap.decode_steps)
            out = llm.generate(llm.chat_prompt(msgs[:i], tools=c["tools"]), params)[0]
            lengths.append(len(out.token_ids))
    llm.core.close()
    trace = tap.decode.trace()
    trace.meta.update(workload=f"{sessions} agent sessions (tools/agent_corpus.py seed {AGENT_SEED + seed}), "
                               f"every assistant turn sampled, temperature 0.7, top-p 0.95",
                      seq_starts=starts, reply_tokens=lengths)
    return trace, tap


def locality(trace, shuffles: int = 8, seed: int = 0) -> list[dict]:
    """Per layer of a batch-1 trace: experts shared by consecutive tokens of one sequence, the
    same over shuffled tokens, uniform routing's k*k/E, and the usage entropy (bits)."""
    E, k = trace.num_experts, trace.top_k
    starts = set(trace.meta.get("seq_starts", [0]))
    rng, out = np.random.default_rng(seed), []
    for j in range(trace.num_layers):
        rows = trace.ids[trace.layer == j].astype(np.int64)          # one row per step (batch 1)
        hot = np.zeros((len(rows), E), bool)
        np.put_along_axis(hot, rows, True, axis=1)
        same = np.array([s not in starts for s in range(1, len(rows))], bool)
        shared = (hot[1:] & hot[:-1]).sum(1)[same].mean()
        mixed = [(h[1:] & h[:-1]).sum(1).mean() for h in (hot[rng.permutation(len(hot))]
                                                        for _ in range(shuffles))]
        usage = hot.sum(0) / hot.sum()
        nz = usage[usage > 0]
        out.append({"layer": j, "shared": float(shared), "shuffled": float(np.mean(mixed)),
                    "uniform": k * k / E, "entropy_bits": float(-(nz * np.log2(nz)).sum()),
                    "least_share": float(usage.min()), "most_share": float(usage.max())})
    return out


def print_locality(name, trace, rows) -> None:
    steps = trace.num_layer_steps() // trace.num_layers
    print(f"\n{name}: {steps} decode steps, {len(trace.meta.get('seq_starts', []))} sequences "
          f"({trace.meta['workload']})")
    print(f"{'layer':>5} {'shared':>7} {'shuffled':>8} {'uniform':>7} {'entropy':>7} {'least/most':>12}")
    for r in rows:
        print(f"{r['layer']:>5} {r['shared']:>7.3f} {r['shuffled']:>8.3f} {r['uniform']:>7.3f} "
              f"{r['entropy_bits']:>7.3f} {r['least_share']:>5.3f}/{r['most_share']:.3f}")
    mean = {k: np.mean([r[k] for r in rows]) for k in ("shared", "shuffled")}
    print(f"{'mean':>5} {mean['shared']:>7.3f} {mean['shuffled']:>8.3f}")


def prefill_trace(taps: dict, meta: dict):
    """One trace of every prefill call, source by source (code snippets, chat turns, agent turns)."""
    traces, offset, steps = [t.prefill.trace() for t in taps.values()], 0, []
    for trace, tap in zip(traces, taps.values()):
        steps.append(trace.step + offset)
        offset += tap.prefill_steps
    first = traces[0]
    trace = type(first)(np.concatenate([t.ids for t in traces]), np.concatenate([t.layer for t in traces]),
                        np.concatenate(steps), dict(first.meta))
    trace.meta.update(meta, calls_tokens=[n for tap in taps.values() for n in tap.prefill_tokens],
                      calls_source=[name for name, tap in taps.items() for _ in range(tap.prefill_steps)])
    return trace


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "traces"))
    ap.add_argument("--model", help="a model directory or built-in name (default: the default built-in model)")
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="a Python 3.11 Lib dir")
    ap.add_argument("--snippets", type=int, default=20)
    ap.add_argument("--snippet-tokens", type=int, default=256)
    ap.add_argument("--prefills", type=int, default=20, help="code snippets also prefilled whole")
    ap.add_argument("--chats", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--agents", type=int, default=16, help="agent sessions")
    ap.add_argument("--reply-tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0, out = time.perf_counter(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = held_out_stdlib(Path(args.stdlib))
    llm = LLM(args.model, moe_backend="cpu")
    snips = snippets(llm.tokenizer, files, args.snippets, args.snippet_tokens,
                     np.random.default_rng(args.seed))
    model_name = llm.core.model_name
    llm.core.close()
    source = {"stdlib": args.stdlib, "python": sys.version.split()[0],
              "files": [str(p.relative_to(args.stdlib)) for p in files]}
    code, code_tap = record_code(snips, args.prefills, args.model)
    code.meta.update(source, snippet_tokens=args.snippet_tokens)
    chat, chat_tap = record_chats(args.chats, args.turns, args.reply_tokens, args.seed, args.model)
    agent, agent_tap = record_agents(args.agents, args.reply_tokens, args.seed, args.model)
    taps = {"code": code_tap, "chat": chat_tap, "agent": agent_tap}
    prefill = prefill_trace(taps, {"workload": "prefill calls", **source})
    names = ("demo_code", "demo_chat", "demo_agent", "demo_prefill")
    for name, trace in zip(names, (code, chat, agent)):
        trace.meta["locality"] = rows = locality(trace)
        print_locality(name, trace, rows)
        trace.save(out / f"{name}.npz")
    prefill.save(out / "demo_prefill.npz")
    tokens, first = prefill.meta["calls_tokens"], code_tap.prefill_steps
    print(f"\ndemo_prefill: {len(tokens)} prefill calls, tokens min {min(tokens)} median "
          f"{int(np.median(tokens))} max {max(tokens)} (chat and agent turns: median "
          f"{int(np.median(tokens[first:]))}, max {max(tokens[first:])})")
    print(f"\nwrote {', '.join(n + '.npz' for n in names)} of {model_name} to {out} in "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
