"""Measure a built-in model on held-out data through FreeToken itself (the CPU path):

    python tools/eval_demo.py MODEL_DIR [--conversations 200] [--seed 1000] [--out MODEL_DIR/eval.json]

- held-out loss: mean negative log-likelihood of the assistant's tokens of held-out conversations
  (tools/agent_corpus.py with a seed the training never used), and of held-out code (the 15
  standard-library files no model trained on) as "Write Python code." chats;
- tool calls: given the tools and a request that needs one, whether the model's first output is a
  well-formed call (<tool_call> JSON that parses) of a listed tool with schema-valid arguments
  (required present, types right), and whether it is the expected call; greedy, unconstrained and
  with the tool-call grammar (what tool_choice "required" enforces); per harness style;
- answers: after the expected call and its result, whether the reply contains the fact asked for;
- a few transcripts.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import agent_corpus as corpus  # noqa: E402
import oss_demo  # noqa: E402
from train_demo import _between_backticks, masked  # noqa: E402

TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def schema_valid(args, schema: dict) -> bool:
    if not isinstance(args, dict):
        return False
    props = schema.get("properties") or {}
    if any(k not in args for k in schema.get("required") or []):
        return False
    for k, v in args.items():
        want = TYPES.get((props.get(k) or {}).get("type"))
        if k not in props and schema.get("additionalProperties") is False:
            return False
        if want is not None and not isinstance(v, want):
            return False
    return True


def first_call(text: str, harmony: bool = False):
    """(name, arguments) of the first <tool_call> (harmony: message to functions.NAME) in text,
    None when there is none that parses."""
    from freetoken.server.toolcalls import parse_calls
    if harmony:
        call = next((c for kind, c in harmony_parts(text) if kind == "call"), None)
        return None if call is None else (call.name, json.loads(call.arguments))
    if "<tool_call>" not in text:
        return None
    body = text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    calls = parse_calls(body)
    if not calls:
        return None
    try:
        return calls[0].name, json.loads(calls[0].arguments)
    except ValueError:
        return None


def harmony_parts(text: str) -> list:
    from freetoken.server.harmony import HarmonyParser
    parser = HarmonyParser()
    return parser.feed(text) + parser.finish()


def reply_text(text: str, harmony: bool) -> str:
    """The answer's text: harmony's final (and plain commentary) messages, or the whole output."""
    return "".join(t for kind, t in harmony_parts(text) if kind == "content") if harmony else text


def cases(n: int, seed: int, harmony: bool = False) -> list[dict]:
    """Held-out conversations cut at their first tool-needing request (harmony: the calls'
    arguments as compact JSON text, as tools/oss_demo.py trains them)."""
    rng = random.Random(seed)
    files, hs, out = corpus.Files(rng, corpus.stdlib_files()), corpus.harnesses(), []
    while len(out) < n:
        c = corpus.conversation(rng, files, hs)
        msgs = oss_demo.harmony_messages(c["messages"]) if harmony else c["messages"]
        i = next((k for k, m in enumerate(msgs) if m.get("tool_calls")), None)
        if i is None:
            continue
        j = i + 1 + len(msgs[i]["tool_calls"])
        out.append({"harness": "claude" if c["tools"][0]["function"]["name"] == "Agent" else
                    "codex" if c["tools"][0]["function"]["name"] == "exec_command" else "generic",
                    "prompt": msgs[:i], "call": msgs[i]["tool_calls"], "after": msgs[:j], "answer": msgs[j]["content"],
                    "tools": c["tools"], "full": {**c, "messages": msgs}})
    return out


def tool_calls(llm, items, constrained: bool) -> dict:
    from freetoken import SamplingParams
    from freetoken.grammar import harmony_tool_call_grammar, tool_call_grammar
    harmony, rows = llm.tokenizer.speaks_harmony, []
    grammar = harmony_tool_call_grammar if harmony else tool_call_grammar
    for it in items:
        ids = llm.chat_prompt(it["prompt"], tools=it["tools"])
        params = SamplingParams(max_tokens=128, grammar=grammar(it["tools"]) if constrained else None,
                                skip_special_tokens=not harmony)
        text = llm.generate(ids, params)[0].text
        got, want = first_call(text, harmony), it["call"][0]["function"]
        want = {**want, "arguments": json.loads(want["arguments"]) if isinstance(want["arguments"], str)
                else want["arguments"]}
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in it["tools"]}
        listed = got is not None and got[0] in schemas
        rows.append({"harness": it["harness"], "well_formed": got is not None, "listed": listed,
                     "schema_valid": listed and schema_valid(got[1], schemas[got[0]]),
                     "exact": got is not None and got == (want["name"], want["arguments"]), "text": text})
    return summarize(rows)


def summarize(rows: list[dict]) -> dict:
    share = lambda rs, k: round(sum(r[k] for r in rs) / max(len(rs), 1), 3)
    keys = ("well_formed", "listed", "schema_valid", "exact")
    out = {k: share(rows, k) for k in keys}
    out["n"] = len(rows)
    out["by_harness"] = {h: {**{k: share([r for r in rows if r["harness"] == h], k) for k in keys},
                             "n": sum(r["harness"] == h for r in rows)} for h in sorted({r["harness"] for r in rows})}
    out["misses"] = [r["text"][:200] for r in rows if not r["exact"]][:5]
    return out


def answers(llm, items) -> dict:
    from freetoken import SamplingParams
    hits, samples, harmony = [], [], llm.tokenizer.speaks_harmony
    for it in items:
        ids = llm.chat_prompt(it["after"], tools=it["tools"])
        text = reply_text(llm.generate(ids, SamplingParams(max_tokens=96, skip_special_tokens=not harmony))[0].text,
                          harmony)
        hits.append(text.strip() == it["answer"].strip())
        if len(samples) < 3:
            samples.append({"harness": it["harness"], "request": it["prompt"][-1]["content"], "reply": text})
    return {"exact": round(sum(hits) / len(hits), 3), "n": len(hits), "samples": samples}


def heldout_loss(llm, texts: list[str]) -> float:
    from freetoken import SamplingParams
    total, count = 0.0, 0
    for text in texts:
        ids, mask = (oss_demo.masked(llm.tokenizer, text, 1.0, _between_backticks) if llm.tokenizer.speaks_harmony
                     else masked(llm.tokenizer, text))
        ids, mask = ids[:2048 - 1], mask[:2048 - 1]
        out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        for lp, m in zip(out.prompt_logprobs[1:], mask[1:]):
            if m and lp is not None:
                total, count = total - lp.logprob, count + 1
    return round(total / max(count, 1), 4)


def code_texts(tok, count: int) -> list[str]:
    rng = random.Random(0)
    out = []
    for path in corpus.held_out_stdlib(corpus.stdlib_dir()):
        lines = path.read_text(errors="replace").splitlines()
        for _ in range(max(1, count // 15)):
            start = rng.randrange(max(1, len(lines) - 40))
            code = "\n".join(lines[start:start + 40])
            out.append(tok.apply_chat_template([{"role": "user", "content": "Write Python code."},
                                                {"role": "assistant", "content": code}], add_generation_prompt=False))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--readme", action="store_true", help="write MODEL_DIR/README.md (tools/model_card.py)")
    args = ap.parse_args(argv)
    from freetoken import LLM
    llm = LLM(args.model, backend="cpu", max_model_len=2048)
    items = cases(args.conversations, args.seed, llm.tokenizer.speaks_harmony)
    agent_texts = [llm.tokenizer.apply_chat_template(it["full"]["messages"], tools=it["tools"],
                                                     add_generation_prompt=False) for it in items[:60]]
    result = {"heldout_loss_agent": heldout_loss(llm, agent_texts),
              "heldout_loss_code": heldout_loss(llm, code_texts(llm.tokenizer, 30)),
              "tool_calls": tool_calls(llm, items, constrained=False),
              "tool_calls_constrained": tool_calls(llm, items, constrained=True),
              "answers": answers(llm, items[:100])}
    out = Path(args.out or Path(args.model) / "eval.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    if args.readme:
        from model_card import write_card
        (oss_demo.write_card if llm.tokenizer.speaks_harmony else write_card)(Path(args.model), result)
    print(json.dumps({k: v for k, v in result.items() if k != "answers"}, indent=1))
    print(json.dumps(result["answers"], indent=1))


if __name__ == "__main__":
    main()
