"""The agent harnesses' own first requests (tests/server/fixtures/harnesses/, captured from Claude
Code, Codex CLI, opencode and aider) replayed against a real ``python -m freetoken serve``: each must
get a 200 and a well-formed answer, streamed when the request asked, with the event sequence its
API defines (Anthropic Messages, OpenAI chat completions, OpenAI Responses).

The harnesses' prompts (1k-28k tokens of system prompt and tool definitions) do not fit the demo
model's 2048-token context, so the server runs the demo model with --max-model-len beyond its
max_position_embeddings (RoPE has no hard limit; what the model writes does not matter here). Each request is sent as
captured - method, path with its query, headers, body - except that a budget the request gives
(max_tokens: 32000 from Claude Code and opencode) is lowered to a few tokens, and requests that
give none get --default-max-tokens: a CPU decodes slowly and the answer's length tests nothing.

Two servers: the scripted core (tests/server/fake_core.py, the real request handling, template,
tokenizer, scheduler and KV pool with a scripted forward) in every run, and the real demo model in
`--slow` runs (Claude Code's 28k-token prompt alone is minutes of CPU prefill)."""
from __future__ import annotations

import glob
import json
import os

import httpx
import pytest
from fake_core import FakeCore
from server_helpers import MODEL, ServerProcess, ServerThread, wait_idle

FIXTURES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "fixtures", "harnesses", "*-[0-9]*.json")))
CONTEXT = 65536
BUDGET = 8
BUDGET_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
SENT_HEADERS_SKIPPED = {"accept-encoding"}          # httpx sets its own


@pytest.fixture(scope="module", params=["scripted", pytest.param("demo-model", marks=pytest.mark.slow)])
def server(request, demo_tokenizer):
    if request.param == "scripted":
        core = lambda: FakeCore(demo_tokenizer, max_model_len=CONTEXT, kv_tokens=2 * CONTEXT)
        proc = ServerThread(core, default_max_tokens=BUDGET).start()
    else:
        proc = ServerProcess("--max-model-len", str(CONTEXT), "--num-kv-tokens", str(CONTEXT),
                             "--max-running-requests", "1", "--default-max-tokens", str(BUDGET))
    yield proc
    proc.stop()


def _request(fixture: dict) -> tuple[dict, dict]:
    body = dict(fixture["body"], model=MODEL)     # captured against the demo model of the day
    for field in BUDGET_FIELDS:
        if isinstance(body.get(field), int):
            body[field] = min(body[field], BUDGET)
    headers = {k: v for k, v in fixture["headers"].items() if k not in SENT_HEADERS_SKIPPED}
    return headers, body


def _sse(text: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) per SSE frame; comment lines (": ping") are dropped."""
    frames = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
        if data:
            frames.append((event, "\n".join(data)))
    return frames


def _check_anthropic_stream(frames):
    events = []
    for name, data in frames:
        obj = json.loads(data)
        assert name == obj["type"], (name, obj)
        assert name != "error", obj
        if name != "ping":
            events.append(obj)
    names = [e["type"] for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    start = events[0]["message"]
    assert start["type"] == "message" and start["role"] == "assistant" and start["content"] == []
    assert start["model"] == MODEL and start["usage"]["input_tokens"] > 0
    open_index, count = None, 0
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == count, e
            assert e["content_block"]["type"] in ("text", "thinking", "tool_use"), e
            open_index, count = e["index"], count + 1
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index, e
            assert e["delta"]["type"] in ("text_delta", "thinking_delta", "signature_delta", "input_json_delta"), e
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index, e
            open_index = None
        else:
            raise AssertionError(f"unexpected event {e}")
    assert open_index is None
    delta = events[-2]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), delta
    assert delta["usage"]["output_tokens"] > 0


def _check_anthropic_message(m):
    assert m["type"] == "message" and m["role"] == "assistant" and m["model"] == MODEL
    assert m["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert all(b["type"] in ("text", "thinking", "tool_use") for b in m["content"])
    assert m["usage"]["input_tokens"] > 0 and m["usage"]["output_tokens"] > 0


def _check_chat_stream(frames, body):
    assert frames[-1][1] == "[DONE]", frames[-1]
    chunks = [json.loads(data) for _, data in frames[:-1]]
    assert chunks and all("error" not in c for c in chunks), chunks[-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    with_usage = (body.get("stream_options") or {}).get("include_usage")
    choice_chunks = chunks[:-1] if with_usage else chunks
    if with_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0, chunks[-1]
        assert all(c["usage"] is None for c in choice_chunks)
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in choice_chunks)
    assert choice_chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] in ("stop", "length", "tool_calls"), finishes


def _check_chat_completion(c):
    assert c["object"] == "chat.completion" and c["model"] == MODEL and len(c["choices"]) == 1
    assert c["choices"][0]["message"]["role"] == "assistant"
    assert c["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    assert c["usage"]["completion_tokens"] > 0


def _check_responses_stream(frames):
    events = []
    for name, data in frames:
        obj = json.loads(data)
        assert name is None or name == obj["type"], (name, obj)
        events.append(obj)
    names = [e["type"] for e in events]
    assert names[:2] == ["response.created", "response.in_progress"], names
    assert names[-1] in ("response.completed", "response.incomplete"), names
    assert not {"error", "response.failed"} & set(names), events[-1]
    seq = [e["sequence_number"] for e in events]
    assert seq == sorted(seq) and len(set(seq)) == len(seq), seq
    final = events[-1]["response"]
    assert final["object"] == "response" and final["model"] == MODEL
    assert final["status"] == names[-1].removeprefix("response."), final["status"]
    assert final["id"] == events[0]["response"]["id"] and final["usage"]["output_tokens"] > 0
    items, open_item = [], None
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert open_item is None and e["output_index"] == len(items), e
            open_item = e["item"]
            items.append(open_item["type"])
        elif e["type"] == "response.output_item.done":
            assert open_item is not None and e["item"]["id"] == open_item["id"], e
            open_item = None
        else:
            assert open_item is not None and e.get("item_id") == open_item["id"], e
            assert e["type"].startswith(("response.content_part.", "response.output_text.", "response.reasoning",
                                         "response.function_call_arguments.")), e
    assert open_item is None and [o["type"] for o in final["output"]] == items


def _check_response(r):
    assert r["object"] == "response" and r["model"] == MODEL and r["status"] in ("completed", "incomplete")
    assert r["usage"]["output_tokens"] > 0


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: os.path.basename(p).removesuffix(".json"))
def test_replay(server, path):
    fixture = json.load(open(path))
    headers, body = _request(fixture)
    route = fixture["path"].split("?")[0]
    with httpx.stream(fixture["method"], server.url + fixture["path"], headers=headers, json=body,
                      timeout=600) as r:
        text = r.read().decode()
    assert r.status_code == 200, f"{r.status_code} {text[:2000]}"
    if body.get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        frames = _sse(text)
        {"/v1/messages": lambda: _check_anthropic_stream(frames),
         "/v1/chat/completions": lambda: _check_chat_stream(frames, body),
         "/v1/responses": lambda: _check_responses_stream(frames)}[route]()
    else:
        answer = json.loads(text)
        {"/v1/messages": _check_anthropic_message, "/v1/chat/completions": _check_chat_completion,
         "/v1/responses": _check_response}[route](answer)
    status = wait_idle(server.url, timeout=60)
    assert status["idle"] and status["kv"]["leaked"] == 0, status
