"""Agent re-prefill: how many prompt tokens a hybrid (Gated DeltaNet) model recomputes per turn when
an agent harness edits its context the way real ones do, with semantic-anchor checkpoints, with
fixed-interval checkpoints only, and with none; pairs: docs/performance.md "Agent context edits",
freetoken/engine/anchors.py, checkpoints.py, resume.py, docs/hybrid.md.

    python bench/agent_edits.py [--turns 12] [--tool-tokens 200,400] [--model synth:tiny-hybrid]
        [--ttft-model synth:qwen3.6-35b-a3b,layers=4] [--ttft-turns 8] [--ttft-edits placeholder]
        [--interval 256] [--max-tokens 16] [--threads N] [--quick] [--out bench/results/agent_edits.json]

The conversation (deterministic, built here, rendered with `LLM.chat_prompt(messages, tools=...)`,
the packaged demo tokenizer and its Qwen3-style template): a system prompt with three tool schemas,
a user task, then `--turns` turns. Turn i's input is the user task (i = 0), the previous turn's
tool result, or that result plus a user interjection (turns listed in --interject); its reply is
an assistant message with `reasoning_content` (a thinking block), one line of text and one tool
call (read_file / grep / run_tests); its tool result has --tool-tokens tokens (drawn per turn).
Turn i's prompt is everything up to its input, edited by the harness, + the generation prompt.

Edit kinds (each applied to the whole message list before every turn is rendered):
  strip-thinking  reasoning_content dropped from every assistant message but the last one
  placeholder     tool results older than the last --keep-results (2) replaced by one fixed line
  elide           tool results older than the last --keep-observations (1) removed altogether
  none            no edits
  placeholder:K / elide:K  the same with a window of K (the default run adds placeholder:4)
The template itself renders thinking only for assistant messages after the last real user query
(tool results do not count as one): a run of tool turns keeps every thinking block unless the
harness strips it, and a user interjection makes the template drop all earlier thinking (under
every edit kind, `none` included). The JSON records what the rendered prompts contain.

Engine settings (one engine each, same weights, driven through `llm.core.add_request` / `step`):
  anchors       the defaults (semantic anchors + every 4096 tokens) with an unbounded pool
  interval-N    semantic_anchors=False, state_checkpoint_interval=N (--interval, 256), unbounded
  none          state_checkpoint_mb=0 (a hybrid then reuses nothing)
  anchors-N     the defaults with the checkpoint pool cut to N checkpoints, for each N of
                --budgets (default: the 32 that 2048 MiB holds for the real 40-layer
                Qwen3.6-35B-A3B at 62.8 MiB each; token-count phase only). The sweep
                `--budgets 8,12,16,24,32` is how the engine's default of 32 checkpoints per running
                request (engine/build.py CHECKPOINTS_PER_REQUEST) was chosen.
The settings run interleaved, turn by turn (the order rotated each turn), so load on the shared
machine hits all alike; each edit kind starts from fresh engines (empty caches).

Per turn and setting: prompt tokens; recomputed = prompt tokens - the request's `num_cached` (the
engine's own count); added = prompt tokens - the longest common prefix with the previous turn's
prompt + output (what the edit and the new messages changed; the replies are the synth model's
greedy tokens, which never match the scripted assistant message, so the previous reply counts as
added too: in a real run it was decoded, and the engine's decode/finish checkpoints would cover
it); where the request resumed (which anchor); prefill forwards (engine steps until the first
token: one per --chunked-prefill-size tokens; the states at the anchors a chunk passes are
captured inside its forward); time to first token (add_request to the first
sampled token; max_tokens --max-tokens, ignore_eos, greedy). Summary per (edit, setting) over
turns 1.. (turn 0 has no previous turn): median and max of recomputed / added, total recomputed
and added tokens (turn 0 included), median TTFT; the issue's target is recomputed <= 1.5 x added
on every turn with anchors.

Two models: the token counts do not depend on the weights (only on the tokenizer and template),
so --model (synth:tiny-hybrid, ~16k prefill tok/s here) runs every edit kind and setting on the
full conversation; --ttft-model (the real Qwen3.6-35B-A3B GDN/attention/MoE geometry at 4 layers,
~60-170 prefill tok/s on 2 cores) runs --ttft-edits on a short conversation (--ttft-turns turns,
--ttft-tool-tokens results, max_tokens 2) for TTFTs at a realistic shape ('' skips it). The
engines of one model share one copy of its synth weights (this script memoizes synth_model).

--quick: 8 turns, no --ttft-model (~15 s); the default run takes ~3 min here. A plot: an ASCII
chart on stdout (recomputed tokens per turn) and bench/results/agent_edits.png when matplotlib is
already installed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# One OpenBLAS thread unless the caller says otherwise: on the 2-core VM, after a BLAS call (a
# prefill chunk of >= 32 tokens) OpenBLAS's idle threads spin and stall the numba kernels that
# follow for ~50-100 ms (bench/decode_sampling.py), once per prefill chunk; anchors cut a prompt
# into many chunks, so with the default the tiny model's TTFTs were mostly that stall.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]   # the checkout's freetoken; bench/ also when imported

from _machine import cpu_info  # noqa: E402

EDITS = ("strip-thinking", "placeholder", "elide", "none")
DEFAULT_EDITS = EDITS + ("placeholder:4",)   # + a wider window: see docs/performance.md
PLACEHOLDER = "[Old tool output removed to save context.]"
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "grep", "description": "Search the repository for a pattern.",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                       "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run pytest on a path and return its output.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]
WORDS = ("cache", "state", "token", "slot", "prefix", "anchor", "chunk", "batch", "layer", "expert",
         "router", "weight", "norm", "score", "window", "budget", "queue", "request", "stream", "index")
INTERJECTIONS = ("Also make sure the fix keeps the public API unchanged.",
                 "Please add a regression test for this before you finish.")


# --- the conversation -------------------------------------------------------------------------

def _tool_text(kind: str, rng, target: int, encode) -> str:
    """Deterministic tool output of about `target` tokens (line by line)."""
    lines, n = [], 0
    while n < target:
        a, b, c = rng.choice(WORDS, 3)
        k = int(rng.integers(1, 400))
        if kind == "read_file":
            line = rng.choice([f"def {a}_{b}(self, {c}):", f"    {a} = self.{b}[{c}] + {k}",
                               f"    if {a} is None:", f"        return self.{c}_{b}({a}, {k})",
                               f"class {a.title()}{b.title()}:", f"    # keep the {a} of each {b} ({k})"])
        elif kind == "grep":
            line = f"freetoken/engine/{a}.py:{k}:    self.{b}_{c} = {a}({c}, {k})"
        else:
            line = rng.choice([f"tests/engine/test_{a}.py::test_{b}_{c} PASSED",
                               f"tests/engine/test_{a}.py::test_{b}_{c} FAILED",
                               f"E       assert {a}.{b} == {k}", f"{a}/{b}.py:{k}: in {c}_{a}"])
        lines.append(line)
        n += len(encode(line + "\n"))
    return "\n".join(lines)


def conversation(turns: int, tool_tokens: tuple[int, int], interject: set[int], encode, seed: int = 0) -> dict:
    """{'system', 'task', 'turns': [{'input': [msgs], 'reply': msg, 'result': msg}]}"""
    rng = np.random.default_rng(seed)
    out = []
    kinds = ("read_file", "grep", "run_tests")
    for i in range(turns):
        kind = kinds[i % 3]
        a, b = rng.choice(WORDS, 2)
        args = {"read_file": {"path": f"freetoken/engine/{a}.py"},
                "grep": {"pattern": f"{a}_{b}", "path": "freetoken/"},
                "run_tests": {"path": f"tests/engine/test_{a}.py"}}[kind]
        thinking = (f"The {a} handling looks wrong after the last change: the {b} is updated before the "
                    f"{a} is checked. I should {kind.replace('_', ' ')} {json.dumps(args)} to confirm this, "
                    f"then look at how the {b} is reused on the next call (step {i}).")
        reply = {"role": "assistant", "content": f"Step {i}: checking the {a} {b}.", "reasoning_content": thinking,
                 "tool_calls": [{"type": "function", "function": {"name": kind, "arguments": args}}]}
        target = int(rng.integers(tool_tokens[0], tool_tokens[1] + 1))
        result = {"role": "tool", "content": _tool_text(kind, rng, target, encode)}
        inputs = []
        if i == 0:
            inputs = [{"role": "user", "content": "The prefix cache returns stale slots after an abort. "
                                                  "Find the bug in freetoken/engine and fix it."}]
        elif i in interject:
            inputs = [{"role": "user", "content": INTERJECTIONS[i % len(INTERJECTIONS)]}]
        out.append({"input": inputs, "reply": reply, "result": result})
    return {"system": "You are a coding agent working in the FreeToken repository.", "turns": out}


def messages_at(conv: dict, t: int) -> list[dict]:
    """Everything turn t's prompt is rendered from (before edits): up to turn t's input."""
    msgs = [{"role": "system", "content": conv["system"]}]
    for i, turn in enumerate(conv["turns"][:t + 1]):
        msgs += turn["input"]
        if i < t:
            msgs += [turn["reply"], turn["result"]]
    return msgs


def edit(msgs: list[dict], kind: str, keep_results: int, keep_observations: int) -> list[dict]:
    """The harness's edit of one turn's messages; 'placeholder:K' / 'elide:K' set the window."""
    kind, _, keep = kind.partition(":")
    if keep:
        keep_results = keep_observations = int(keep)
    msgs = [dict(m) for m in msgs]
    if kind == "strip-thinking":
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
        for i, m in enumerate(msgs):
            if m["role"] == "assistant" and i != last:
                m.pop("reasoning_content", None)
    elif kind == "placeholder":
        tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
        for i in tools[:max(len(tools) - keep_results, 0)]:
            msgs[i]["content"] = PLACEHOLDER
    elif kind == "elide":
        tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
        drop = set(tools[:max(len(tools) - keep_observations, 0)])
        msgs = [m for i, m in enumerate(msgs) if i not in drop]
    elif kind != "none":
        raise ValueError(kind)
    return msgs


# --- engines ----------------------------------------------------------------------------------

def share_synth_weights() -> None:
    """Engines of one synth spec share one copy of its weights (bench-side memo; weights are
    read-only during inference)."""
    import freetoken.models.synth as synth
    orig, memo = synth.synth_model, {}

    def cached(spec, log):
        if spec not in memo:
            memo[spec] = orig(spec, log)
        return memo[spec]
    synth.synth_model = cached


def real_budget_checkpoints(name: str = "qwen3.6-35b-a3b", mib: int = 2048) -> tuple[int, int]:
    """(checkpoints `mib` MiB holds for the full real model, bytes of one)."""
    from freetoken.models.synth_gdn import PRESETS
    from freetoken.engine.state_pool import StatePool
    from freetoken.models.hf_config import model_config_from_dict
    row = StatePool.bytes_per_row(model_config_from_dict(PRESETS[name].hf_config()))
    return (mib << 20) // row, row


def settings(interval: int, budgets: list[int]) -> dict:
    """anchors (the defaults but an unbounded pool), interval-N, none, and anchors-N for each
    checkpoint count in `budgets` (the defaults with the pool cut to N)."""
    s = {"anchors": {"state_checkpoint_mb": 1 << 20}, f"interval-{interval}": {
        "semantic_anchors": False, "state_checkpoint_interval": interval, "state_checkpoint_mb": 1 << 20},
         "none": {"state_checkpoint_mb": 0}}
    for n in budgets:
        s[f"anchors-{n}"] = {"_checkpoints": n}
    return s


def make_engine(model: str, options: dict, args, threads: int):
    from freetoken import LLM
    opts = {k: v for k, v in options.items() if not k.startswith("_")}
    llm = LLM(model=model, backend="cpu", moe_backend=args.moe_backend, moe_cpu_threads=threads,
              max_model_len=args.max_model_len, num_kv_tokens=args.kv_tokens, max_running_requests=1,
              seed=0, **opts)
    if "_checkpoints" in options:
        row = llm.core.states.conv[:, 0].nbytes + llm.core.states.rule[:, 0].nbytes
        llm.core.checkpoints.tiers["host"].budget = options["_checkpoints"] * row
    return llm


def pool_counters(llm) -> dict:
    pool = llm.core.checkpoints
    return dict(pool.status()) if pool is not None else {}


# --- one turn ---------------------------------------------------------------------------------

def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def where(llm, ids: list[int], p: int, prev: dict | None) -> str:
    """What sits at resume position p: the anchor kind, the previous prompt's end, or the interval."""
    if p == 0:
        return "start"
    resumer = llm.core.scheduler.recurrent
    names = {}
    if hasattr(resumer, "anchors"):
        tok = llm.tokenizer
        for m in ("<|im_end|>", "</think>", "</tool_response>"):
            names[("after", tuple(tok.encode(m)))] = f"after {m}"
        names[("before", tuple(tok.encode("<tool_call>")))] = "before <tool_call>"
        for (side, seq), name in names.items():
            if seq in resumer.anchors.after and side == "after" and tuple(ids[p - len(seq):p]) == seq:
                return name
            if seq in resumer.anchors.before and side == "before" and tuple(ids[p:p + len(seq)]) == seq:
                return name
        if resumer.anchors.interval and p % resumer.anchors.interval == 0:
            return f"every {resumer.anchors.interval}"
    if prev is not None and p == prev["prompt_tokens"]:
        return "previous prompt end"
    if prev is not None and p == len(prev["seq"]) - 1:
        return "previous finish"
    if prev is not None and p in prev["ends"]:
        return f"turn {prev['ends'][p]} prompt end"
    return "other"


def run_turn(llm, ids: list[int], max_tokens: int, prev: dict | None, turn: int = -1) -> dict:
    from freetoken import SamplingParams
    core = llm.core
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, seed=0)
    t0 = time.perf_counter()
    req = core.add_request(ids, params)
    forwards = 0
    while not req.output_ids:
        core.step()
        forwards += 1
    ttft = time.perf_counter() - t0
    while req.finish_reason is None:
        core.step()
    total = time.perf_counter() - t0
    lcp = common_prefix(ids, prev["seq"]) if prev is not None else 0
    added = len(ids) - lcp
    recomputed = len(ids) - req.num_cached
    return {"prompt_tokens": len(ids), "num_cached": req.num_cached, "recomputed": recomputed,
            "added": added, "common_prefix": lcp, "ratio": round(recomputed / max(added, 1), 3),
            "overhead": recomputed - added, "resumed_at": where(llm, ids, req.num_cached, prev),
            "prefill_forwards": forwards, "ttft_ms": round(1e3 * ttft, 2), "request_ms": round(1e3 * total, 2),
            "seq": list(ids) + list(req.output_ids),
            "ends": {**(prev["ends"] if prev is not None else {}), len(ids): turn}}


def replay(model: str, conv: dict, edit_kind: str, setting_opts: dict, args, threads: int,
           max_tokens: int, tok_holder: dict) -> tuple[list[dict], dict, dict]:
    """All turns of one edit kind on fresh engines (one per setting), settings interleaved."""
    engines = {name: make_engine(model, opts, args, threads) for name, opts in setting_opts.items()}
    first = next(iter(engines.values()))
    warm = np.random.default_rng(1).integers(10, 4000, args.warm_tokens).tolist()
    for llm in engines.values():                      # compile prefill paths outside the timings
        run_turn(llm, warm, 2, None)
    base = {name: pool_counters(llm) for name, llm in engines.items()}
    names = list(engines)
    rows, prev, prompts = [], {name: None for name in names}, []
    for t in range(len(conv["turns"])):
        msgs = edit(messages_at(conv, t), edit_kind, args.keep_results, args.keep_observations)
        ids = first.chat_prompt(msgs, tools=TOOLS)
        text = first.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tools=TOOLS)
        prompts.append({"turn": t, "tokens": len(ids), "think_blocks": text.count("<think>"),
                        "assistant_turns": sum(m["role"] == "assistant" for m in msgs),
                        "tool_results": text.count("<tool_response>") - text.count(PLACEHOLDER),
                        "placeholders": text.count(PLACEHOLDER)})
        order = names[t % len(names):] + names[:t % len(names)]
        for name in order:
            r = run_turn(engines[name], ids, max_tokens, prev[name], t)
            prev[name] = r
            rows.append({"edit": edit_kind, "setting": name, "turn": t,
                         "input": "user" if conv["turns"][t]["input"] else "tool",
                         **{k: v for k, v in r.items() if k not in ("seq", "ends")}})
    pools = {}
    for name, llm in engines.items():
        c = pool_counters(llm)
        pools[name] = {k: (v - base[name].get(k, 0) if k in ("taken", "hits", "evicted", "dropped",
                                                               "reused_tokens") else v) for k, v in c.items()}
        llm.core.close()
    tok_holder.setdefault("tokenizer", first.tokenizer)
    return rows, pools, {"prompts": prompts}


# --- summary, table, plot ---------------------------------------------------------------------

def summarize(rows: list[dict], target: float) -> list[dict]:
    out = []
    keys = []
    for r in rows:
        if (r["edit"], r["setting"]) not in keys:
            keys.append((r["edit"], r["setting"]))
    for edit_kind, setting in keys:
        rs = [r for r in rows if r["edit"] == edit_kind and r["setting"] == setting]
        later = [r for r in rs if r["turn"] > 0]
        ratios = [r["ratio"] for r in later]
        worst = max(later, key=lambda r: r["ratio"])
        out.append({"edit": edit_kind, "setting": setting, "turns": len(rs),
                    "ratio_median": round(statistics.median(ratios), 3), "ratio_max": round(max(ratios), 3),
                    "worst_turn": worst["turn"], "worst_resumed_at": worst["resumed_at"],
                    "recomputed_total": sum(r["recomputed"] for r in rs),
                    "added_total": sum(r["added"] for r in rs),
                    "prompt_total": sum(r["prompt_tokens"] for r in rs),
                    "recomputed_median": statistics.median(r["recomputed"] for r in later),
                    "added_median": statistics.median(r["added"] for r in later),
                    "forwards_median": statistics.median(r["prefill_forwards"] for r in later),
                    "ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in later), 2),
                    "ttft_s_total": round(sum(r["ttft_ms"] for r in rs) / 1e3, 2),
                    "ttft_ms_range": [min(r["ttft_ms"] for r in later), max(r["ttft_ms"] for r in later)],
                    "within_target": all(x <= target for x in ratios),
                    "turns_over_target": [r["turn"] for r in later if r["ratio"] > target]})
    return out


def md(text: str) -> str:
    """A markdown table cell (marker names such as <|im_end|> hold pipes)."""
    return text.replace("|", "\\|")


def print_summary(title: str, summary: list[dict], target: float) -> None:
    print(f"\n{title}")
    print(f"| edit | setting | recomputed/added median | max (turn, resumed at) | recomputed total | "
          f"added total | prompt total | prefill forwards / turn | median TTFT ms [range] | TTFT total s | "
          f"<= {target}x every turn |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['edit']} | {s['setting']} | {s['ratio_median']:.2f} | {s['ratio_max']:.2f} "
              f"({s['worst_turn']}, {md(s['worst_resumed_at'])}) | {s['recomputed_total']} | {s['added_total']} | "
              f"{s['prompt_total']} | {s['forwards_median']:g} | {s['ttft_ms_median']:.1f} [{s['ttft_ms_range'][0]:.1f}-"
              f"{s['ttft_ms_range'][1]:.1f}] | {s['ttft_s_total']:.2f} | {'yes' if s['within_target'] else 'no: turns ' + ','.join(map(str, s['turns_over_target']))} |")


def print_turns(rows: list[dict], edit_kind: str, names: list[str]) -> None:
    rs = [r for r in rows if r["edit"] == edit_kind]
    print(f"\nper turn, {edit_kind}: prompt / added / recomputed per setting (resumed at; prefill forwards)")
    print("| turn | input | prompt | added | " + " | ".join(f"{n} recomputed" for n in names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for t in sorted({r["turn"] for r in rs}):
        by = {r["setting"]: r for r in rs if r["turn"] == t}
        a = by[names[0]]
        print(f"| {t} | {a['input']} | {a['prompt_tokens']} | {a['added']} | " +
              " | ".join(f"{by[n]['recomputed']} ({md(by[n]['resumed_at'])}; {by[n]['prefill_forwards']})" for n in names) + " |")


def ascii_plot(rows: list[dict], edit_kind: str, names: list[str], width: int = 56) -> str:
    rs = [r for r in rows if r["edit"] == edit_kind]
    top = max(r["recomputed"] for r in rs) or 1
    marks = "#=.*+"
    out = [f"recomputed tokens per turn, {edit_kind} ('|' = tokens added; one char = {top / width:.0f} tokens)"]
    for t in sorted({r["turn"] for r in rs}):
        by = {r["setting"]: r for r in rs if r["turn"] == t}
        for j, n in enumerate(names):
            r = by[n]
            bar = list(marks[j % len(marks)] * max(1, round(width * r["recomputed"] / top)))
            a = min(round(width * r["added"] / top), width)
            bar += [" "] * (a + 1 - len(bar)) if a >= len(bar) else []
            bar[min(a, len(bar) - 1)] = "|"
            out.append(f"{(str(t) if j == 0 else ''):>3} {n:>13} {''.join(bar):<{width + 1}} {r['recomputed']}")
    return "\n".join(out)


def png_plot(rows: list[dict], names: list[str], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    edits = list(dict.fromkeys(r["edit"] for r in rows))
    fig, axes = plt.subplots(1, len(edits), figsize=(4 * len(edits), 3.2), sharey=True)
    for ax, e in zip(np.atleast_1d(axes), edits):
        rs = [r for r in rows if r["edit"] == e]
        turns = sorted({r["turn"] for r in rs})
        for n in names:
            ax.plot(turns, [next(r["recomputed"] for r in rs if r["turn"] == t and r["setting"] == n)
                            for t in turns], marker="o", ms=3, label=n)
        ax.plot(turns, [next(r["added"] for r in rs if r["turn"] == t and r["setting"] == names[0])
                        for t in turns], "k--", lw=1, label="added")
        ax.set_title(e)
        ax.set_xlabel("turn")
    np.atleast_1d(axes)[0].set_ylabel("tokens recomputed")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


# --- main -------------------------------------------------------------------------------------

def machine() -> dict:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no",
                                     "freetoken"], capture_output=True, text=True).stdout.strip())
    except OSError:
        commit, dirty = "?", False
    return {"cpu": cpu_info()["model"], "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit, "engine_dirty": dirty}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synth:tiny-hybrid", help="model of the token-count phase")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--tool-tokens", default="200,400", help="tool result tokens, lo,hi")
    ap.add_argument("--interject", default="6", help="turns whose input adds a user message (comma list)")
    ap.add_argument("--edits", default=",".join(DEFAULT_EDITS),
                    help="comma list of edit kinds; placeholder:K / elide:K keep K tool results")
    ap.add_argument("--keep-results", type=int, default=2, help="placeholder: tool results kept")
    ap.add_argument("--keep-observations", type=int, default=1, help="elide: tool results kept")
    ap.add_argument("--interval", type=int, default=256, help="the interval-only setting's interval")
    ap.add_argument("--budgets", default="", help="checkpoint counts of extra anchors-N settings (comma list; "
                    "default: the 32 that 2048 MiB holds for the real model), token-count phase only")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ttft-model", default="synth:qwen3.6-35b-a3b,layers=4", help="'' skips the TTFT phase")
    ap.add_argument("--ttft-turns", type=int, default=8)
    ap.add_argument("--ttft-tool-tokens", default="60,140")
    ap.add_argument("--ttft-edits", default="placeholder")
    ap.add_argument("--ttft-max-tokens", type=int, default=2)
    ap.add_argument("--target", type=float, default=1.5)
    ap.add_argument("--moe-backend", default="fused")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--kv-tokens", type=int, default=65536, help="KV pool (large: nothing is evicted)")
    ap.add_argument("--warm-tokens", type=int, default=600)
    ap.add_argument("--threads", type=int, default=0, help="numba threads (0: numba's default)")
    ap.add_argument("--quick", action="store_true", help="8 turns, no --ttft-model")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "agent_edits.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.turns, args.ttft_model = 8, ""
    import logging
    logging.getLogger("freetoken").setLevel(logging.ERROR)     # the max-model-len warning, per engine
    import numba
    threads = args.threads or numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(threads)
    share_synth_weights()
    info = machine()
    t_start, load0 = time.perf_counter(), os.getloadavg()[0]
    print(f"# {info['cpu']}, {info['cores']} cores, {threads} threads, {info['date']} UTC, "
          f"engine at {info['commit']}{' (dirty)' if info['engine_dirty'] else ''}", flush=True)
    n_real, real_row = real_budget_checkpoints()

    phases = [("counts", args.model, args.turns, args.tool_tokens, args.edits.split(","), args.max_tokens, True)]
    if args.ttft_model:
        phases.append(("ttft", args.ttft_model, args.ttft_turns, args.ttft_tool_tokens,
                       args.ttft_edits.split(","), args.ttft_max_tokens, False))
    result = {"machine": info, "threads": threads, "args": vars(args),
              "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
              "real_model_checkpoint": {"bytes": real_row, "in_2048_mib": n_real}, "phases": {}}
    interject = {int(x) for x in args.interject.split(",") if x}
    budgets = [int(x) for x in args.budgets.split(",") if x] or [n_real]
    for phase, model, turns, tool_tokens, edits, max_tokens, real_budget in phases:
        t0 = time.perf_counter()
        opts = settings(args.interval, budgets if real_budget else [])
        names = list(opts)
        lo, hi = (int(x) for x in tool_tokens.split(","))
        holder, rows, pools, prompts = {}, [], {}, {}
        conv = None
        for e in edits:
            if conv is None:
                probe = make_engine(model, {"state_checkpoint_mb": 0}, args, threads)
                conv = conversation(turns, (lo, hi), interject, probe.tokenizer.encode)
                probe.core.close()
                del probe
            r, p, meta = replay(model, conv, e, opts, args, threads, max_tokens, holder)
            rows += r
            pools[e] = p
            prompts[e] = meta["prompts"]
            print(f"# {phase}: {model}, {e}: {time.perf_counter() - t0:.0f} s", flush=True)
        summary = summarize(rows, args.target)
        title = (f"{phase}: {model}, {turns} turns, tool results {lo}-{hi} tokens, max_tokens {max_tokens}")
        print_summary(title, summary, args.target)
        for e in edits:
            print_turns(rows, e, names)
        for e in edits:
            print()
            print(ascii_plot(rows, e, names))
        if phase == "counts":
            png = Path(args.out).with_suffix(".png")
            if png_plot(rows, names, png):
                print(f"\nplot: {png}")
        result["phases"][phase] = {"model": model, "turns": turns, "tool_tokens": [lo, hi],
                                   "max_tokens": max_tokens, "settings": opts, "prompts": prompts,
                                   "summary": summary, "pools": pools, "rows": rows,
                                   "wall_s": round(time.perf_counter() - t0, 1)}
    result["load_avg_start_end"] = [load0, os.getloadavg()[0]]
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n# wall {result['wall_s']} s, load {load0:.1f} -> {os.getloadavg()[0]:.1f}; written {out}")


if __name__ == "__main__":
    main()
