"""Decode tok/s on the demo model with and without a JSON-schema constraint, and under tool_choice
auto's triggered grammar while the text stays free (constrained decoding, freetoken/grammar.py);
pairs: docs/performance.md "Constrained decoding".

    python bench/decode_constrained.py [--tokens 128] [--batch 1,4] [--repeats 3]
        [--out bench/results/decode_constrained.json]

Needs the grammar extra (pip install 'freetoken[grammar]'). Each row is `batch` identical-shape
requests of `tokens` output tokens at temperature 1 (seeded): unconstrained with ignore_eos, and
constrained to a schema whose one string field is long enough (minLength) that the grammar never
ends before max_tokens, and to the auto tool-call grammar of two tools with the call opener and
the end tokens banned (logit_bias -100), so the text stays free: every row decodes the same
number of tokens. Decode tok/s =
batch * (tokens - 1) / (time of the whole run - time of a 1-token run), best of --repeats
(the two kinds interleaved, so load on a shared machine hits both alike).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/ also when imported, not run

from _machine import cpu_info  # noqa: E402

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "body": {"type": "string", "minLength": 2000},
                                           "n": {"type": "integer"}},
          "required": ["title", "body", "n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
             "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
         {"type": "function", "function": {"name": "run", "parameters": {
             "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/decode_constrained.json")
    args = ap.parse_args()
    from freetoken import LLM, SamplingParams
    from freetoken.models import demo
    from freetoken.grammar import json_grammar, tool_call_grammar
    llm = LLM(backend="cpu")
    # the opener and the end banned: free text may end anywhere, and the grammar ends the request
    # at an end token even with ignore_eos
    banned = tuple((t, -100.0) for t in sorted({llm.tokenizer.token_to_id("<tool_call>"), *llm.tokenizer.stop_token_ids}))
    kinds = {"none": (None, ()), "json_schema": (json_grammar(SCHEMA), ()),
             "tools_auto": (tool_call_grammar(TOOLS, free_text=True), banned)}
    prompt = "Write a JSON document:"

    def run(batch, tokens, kind):
        grammar, bias = kinds[kind]
        params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True, grammar=grammar,
                                 logit_bias=bias) for i in range(batch)]
        t0 = time.perf_counter()
        outs = [llm.core.add_request(llm.encode_prompt(prompt), p) for p in params]
        while any(r.finish_reason is None for r in outs):
            llm.core.step()
        dt = time.perf_counter() - t0
        assert all(len(r.output_ids) == tokens for r in outs), [len(r.output_ids) for r in outs]
        return dt

    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        best = {}
        for kind in kinds:
            run(batch, 4, kind)                                # warm (grammar tokenizer, JIT)
        for _ in range(args.repeats):                          # interleaved: load hits all alike
            for kind in kinds:
                full, first = run(batch, args.tokens, kind), run(batch, 1, kind)
                best[kind] = min(best.get(kind, float("inf")), full - first)
        for kind in kinds:
            rate = batch * (args.tokens - 1) / best[kind]
            rows.append({"batch": batch, "constraint": kind, "tokens": args.tokens, "decode_tok_s": round(rate, 1),
                         "ms_per_step": round(1000 * best[kind] / (args.tokens - 1), 3)})
    base = {r["batch"]: r["decode_tok_s"] for r in rows if r["constraint"] == "none"}
    print("| batch | constraint | decode tok/s | ms / step | vs none |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['constraint']} | {r['decode_tok_s']} | {r['ms_per_step']} | "
              f"{r['decode_tok_s'] / base[r['batch']]:.3f} |")
    result = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu_info()["model"],
              "cores": os.cpu_count(), "model": f"{demo.DEMO_NAME} (demo)", "schema": SCHEMA, "tools": TOOLS, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
