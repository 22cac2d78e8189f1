"""Anthropic routes against the scripted core, driven by the official anthropic SDK."""
import json

import anthropic
import httpx
import pytest
from server_helpers import MODEL

TOOLS = [{"name": "get_weather", "description": "Weather for a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def client(fake_server):
    return anthropic.Anthropic(base_url=fake_server.url, api_key="unused", max_retries=0)


def say(client, text, **kw):
    kw.setdefault("max_tokens", 200)
    return client.messages.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def sse_events(url: str, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        text = r.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events


def test_message(client, demo_tokenizer):
    m = say(client, "SAY:hello there", system="be brief")
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "hello there"
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt = demo_tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "SAY:hello there"}])
    assert m.usage.input_tokens == len(demo_tokenizer.encode(prompt))
    assert m.usage.output_tokens == len(demo_tokenizer.encode("hello there")) + 1
    assert m.usage.cache_read_input_tokens == 0


def test_stop_sequences_and_max_tokens(client):
    m = say(client, "SAY:one two END three", stop_sequences=["END"])
    assert m.content[0].text == "one two " and m.stop_reason == "stop_sequence" and m.stop_sequence == "END"
    m = say(client, "REPEAT:40", max_tokens=4)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4


def test_stream_event_order(fake_server):
    body = {"model": MODEL, "max_tokens": 300, "tools": TOOLS,
            "messages": [{"role": "user", "content": "SAY:<think>hmm</think>Let me look." + CALL}]}
    events = sse_events(fake_server.url, body)
    names = [e for e, _ in events if e != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks, open_index = [], None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append(data["content_block"]["type"])
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None and blocks == ["thinking", "text", "tool_use"]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] > 0
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0


def test_stream_with_sdk(client):
    with client.messages.stream(model=MODEL, max_tokens=300, tools=TOOLS, messages=[
            {"role": "user", "content": "SAY:<think>\nhmm\n</think>\nLet me look." + CALL}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Let me look."
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "hmm"
    assert final.content[2].name == "get_weather" and final.content[2].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


def test_tool_use_round_trip(client):
    first = say(client, "SAY:" + CALL, tools=TOOLS)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.input == {"city": "Paris"}
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "ECHO"}]}]
    m = client.messages.create(model=MODEL, max_tokens=1000, tools=TOOLS, messages=messages)
    prompt = m.content[0].text
    assert '[tool_call]\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n[/tool_call]' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and prompt.rstrip().endswith("ECHO\nassistant")


def test_thinking_round_trip_and_disabled(client):
    m = say(client, "ECHO", thinking={"type": "disabled"})
    assert m.content[0].text.endswith("<think>\n\n</think>\n\n")
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "deep", "signature": ""},
                                                  {"type": "text", "text": "a"}]},
                {"role": "user", "content": "ECHO"}]
    assert "assistant\na" in client.messages.create(model=MODEL, max_tokens=500, messages=messages).content[0].text


def test_count_tokens(client):
    messages = [{"role": "user", "content": "SAY:count me"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, system="sys", tools=TOOLS)
    m = client.messages.create(model=MODEL, max_tokens=50, messages=messages, system="sys", tools=TOOLS)
    assert counted.input_tokens == m.usage.input_tokens > 0


def test_bearer_and_system_blocks(fake_server):
    body = {"model": MODEL, "max_tokens": 20, "system": [{"type": "text", "text": "x", "cache_control":
                                                           {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "SAY:ok"}]}],
            "metadata": {"user_id": "u"}}
    r = httpx.post(fake_server.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "ok"


def test_structured_output_without_the_grammar_extra_names_it(client, fake_server, monkeypatch):
    """No llguidance: output_config.format (and the beta's output_format) get the OpenAI route's
    400, in Anthropic's shape."""
    from freetoken import grammar

    def missing():
        raise grammar.GrammarUnavailable(f"constrained decoding is not installed: {grammar.INSTALL_HINT}")
    monkeypatch.setattr(grammar, "_llg", missing)
    fmt = {"type": "json_schema", "schema": {"type": "object"}}
    for extra, field in (({"output_config": {"format": fmt}}, "output_config.format"), ({"output_format": fmt}, "output_format")):
        with pytest.raises(anthropic.BadRequestError) as e:
            say(client, "SAY:x", extra_body=extra)
        body = e.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"] == (f"{field} json_schema needs constrained decoding, which is not "
                                            f"installed: pip install 'freetoken[grammar]'"), body
    r = httpx.post(fake_server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
    assert r.status_code == 400 and "needs constrained decoding, which is not installed: pip install 'freetoken[grammar]'" \
        in r.json()["error"]["message"], r.text
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = httpx.post(fake_server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(      # not silently unenforced
        "tool_choice 'required' needs constrained decoding, which is not installed"), r.text
    with pytest.raises(anthropic.BadRequestError, match="tool_choice 'f' needs constrained decoding"):
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}],
                               tools=[{"name": "f", "input_schema": {"type": "object"}}],
                               tool_choice={"type": "tool", "name": "f"})
    assert say(client, "SAY:fine", output_config={"effort": "high"}).content[0].text == "fine"
