"""Replay the harnesses' second turns of "Read the file notes.txt and tell me the first word" with
other first words against a running server, and count the answers that name the word (dev time):

    python tools/copy_replay.py http://127.0.0.1:8000 [--words a,b,c] [--modes greedy,default,qwen]

Claude Code's turn is its captured first request (tests/server/fixtures/harnesses/claude-1.json)
plus the Read call and the result as 2.1.197 sends it; Codex's and aider's are their captured
second requests (codex-2.json, aider-2.json) with the file's first word replaced. Modes: greedy
(temperature 0), default (no sampling fields, as Claude Code and Codex send: the model's
generation_config.json), t1 (temperature 1, the APIs' default), qwen (Qwen3's recommended
non-thinking sampling: temperature 0.7, top_p 0.8, top_k 20); the sampled ones unseeded. What the live launch
tests measure through the real programs, in seconds instead of minutes, for choosing a checkpoint.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
from pathlib import Path

from agent_corpus import HELD_OUT_WORDS           # the live launch tests' words

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "server" / "fixtures" / "harnesses"
ASK = "Read the file notes.txt and tell me the first word"
MODES = {"greedy": {"temperature": 0}, "default": {}, "t1": {"temperature": 1.0}, "qwen": {"temperature": 0.7, "top_p": 0.8, "top_k": 20}}


def _captured(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())["body"]


def claude(word: str) -> tuple[str, dict]:
    body = copy.deepcopy(_captured("claude-1"))
    body["max_tokens"] = 300
    body["messages"][0]["content"][1]["text"] = ASK
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                           "input": {"file_path": "notes.txt"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": f"1\t{word} split recipe\n2\tthen coffee\n3\t"}]}]
    return "/v1/messages", body


def codex(word: str) -> tuple[str, dict]:
    body = copy.deepcopy(_captured("codex-2"))
    body["input"][-1]["output"] = body["input"][-1]["output"].replace("river", word)
    return "/v1/responses", body


def aider(word: str) -> tuple[str, dict]:
    body = copy.deepcopy(_captured("aider-2"))
    for message in body["messages"]:
        message["content"] = message["content"].replace("river split", f"{word} split")
    return "/v1/chat/completions", body


def answer_text(path: str, reply: dict) -> str:
    if path == "/v1/responses":
        return " ".join(c.get("text", "") for item in reply.get("output", []) if item.get("type") == "message"
                        for c in item["content"])
    if path == "/v1/messages":
        return " ".join(c.get("text", "") for c in reply["content"] if c["type"] == "text")
    return reply["choices"][0]["message"].get("content") or ""


def replay(client, model: str, harness, word: str, sampling: dict) -> str:
    path, body = harness(word)
    body = {k: v for k, v in body.items() if k not in ("temperature", "top_p", "top_k")}
    body.update(stream=False, model=model, **sampling)
    r = client.post(path, json=body)
    return answer_text(path, r.json()) if r.status_code == 200 else f"HTTP {r.status_code} {r.text[:200]}"


def main(argv=None) -> None:
    import httpx
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("server")
    ap.add_argument("--words", default=",".join(HELD_OUT_WORDS))
    ap.add_argument("--modes", default="greedy,default,qwen")
    args = ap.parse_args(argv)
    client = httpx.Client(base_url=args.server, timeout=600, headers={"x-api-key": "x", "authorization": "Bearer x"})
    model = client.get("/v1/models").json()["data"][0]["id"]
    words = args.words.split(",")
    print(f"| sampling | harness | right of {len(words)} | wrong answers |\n|---|---|---|---|")
    for mode in args.modes.split(","):
        for harness in (claude, codex, aider):
            answers = {w: replay(client, model, harness, w, MODES[mode]) for w in words}
            wrong = {w: a[:60] for w, a in answers.items() if not re.search(rf"\bis\W*{w}\b", a)}
            print(f"| {mode} | {harness.__name__} | {len(words) - len(wrong)} | {wrong} |", flush=True)


if __name__ == "__main__":
    main()
