"""OpenAI routes against the scripted core, driven by the official openai SDK."""
import json
import time

import httpx
import openai
import pytest
from server_helpers import MODEL, cache_status, wait_idle

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, text, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def test_chat(client, demo_tokenizer):
    r = chat(client, "SAY:hello world", temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == "hello world"
    assert choice.finish_reason == "stop" and r.object == "chat.completion" and r.model == MODEL
    prompt = demo_tokenizer.apply_chat_template([{"role": "user", "content": "SAY:hello world"}])
    assert r.usage.prompt_tokens == len(demo_tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(demo_tokenizer.encode("hello world")) + 1    # + end of turn
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_stream_matches_whole_and_usage_chunk(client):
    whole = chat(client, "SAY:one two three four")
    chunks = list(chat(client, "SAY:one two three four", stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(fake_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "SAY:hi"}], "stream": True}
    with httpx.stream("POST", fake_server.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_stop_sequence_and_length(client):
    r = chat(client, "SAY:alpha beta STOP gamma", stop=["STOP", "zzz"])
    assert r.choices[0].message.content == "alpha beta " and r.choices[0].finish_reason == "stop"
    r = chat(client, "REPEAT:50", max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = chat(client, "REPEAT:50", max_completion_tokens=3)
    assert r.usage.completion_tokens == 3


def test_reasoning_content(client):
    r = chat(client, "SAY:<think>\nplan it\n</think>\n\nthe answer")
    msg = r.choices[0].message
    assert msg.content == "the answer" and msg.reasoning_content == "plan it"
    chunks = list(chat(client, "SAY:<think>\nplan it\n</think>\n\nthe answer", stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert reasoning == "plan it"


def test_tool_call(client):
    r = chat(client, "SAY:Checking." + CALL, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_call_streamed_as_indexed_deltas(client):
    text = "SAY:" + CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    calls = {}
    finish = None
    for c in chat(client, text, tools=TOOLS, stream=True):
        if not c.choices:
            continue
        finish = c.choices[0].finish_reason or finish
        for d in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [json.loads(calls[i]["arguments"])["city"] for i in sorted(calls)] == ["Paris", "Rome"]
    assert all(c["id"] and c["name"] == "get_weather" for c in calls.values())


def test_tools_not_parsed_without_tools_or_with_none(client):
    assert chat(client, "SAY:" + CALL).choices[0].message.content == CALL
    r = chat(client, "SAY:" + CALL, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls


def test_tool_round_trip_renders_call_and_result(client):
    first = chat(client, "SAY:" + CALL, tools=TOOLS).choices[0].message
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "weather?"},
                first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21 C"},
                {"role": "user", "content": "ECHO"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    prompt = r.choices[0].message.content
    assert CALL.replace("<tool_call>", "[tool_call]").replace("</tool_call>", "[/tool_call]") in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '"name": "get_weather"' in prompt.split("</tools>")[1]      # the tool list in the system turn


def test_content_parts_and_developer_role(client):
    messages = [{"role": "developer", "content": [{"type": "text", "text": "be nice"}]},
                {"role": "user", "content": [{"type": "text", "text": "EC"}, {"type": "text", "text": "HO"}]}]
    prompt = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content
    assert "system\nbe nice" in prompt and "user\nECHO" in prompt


def test_chat_template_kwargs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ECHO"}],
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content.endswith("assistant\n<think>\n\n</think>\n\n")


def test_completions(client, demo_tokenizer):
    r = client.completions.create(model=MODEL, prompt="SAY:abc def", max_tokens=20)
    assert r.choices[0].text == "abc def" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(demo_tokenizer.encode("SAY:abc def"))
    ids = demo_tokenizer.encode("SAY:xyz")
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=20).choices[0].text == "xyz"
    chunks = list(client.completions.create(model=MODEL, prompt="SAY:abc def", max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "abc def"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completions_default_max_tokens_is_16(client):
    r = client.completions.create(model=MODEL, prompt="REPEAT:100")
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_models(client, fake_server):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.owned_by == "freetoken"
    assert card.model_extra["context_length"] == fake_server.core.max_model_len


def test_stream_disconnect_aborts_and_frees(fake_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "REPEAT:3000 SLEEP:5"}], "stream": True}
    with httpx.stream("POST", fake_server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert cache_status(fake_server.url)["requests"]["in_flight"] == 1
    status = wait_idle(fake_server.url, timeout=5)
    assert status["idle"] and status["kv"]["leaked"] == 0 and status["kv"]["free"] + status["kv"]["prefix_cached"] == status["kv"]["slots"]
    assert 'finish_reason="disconnected"' in httpx.get(fake_server.url + "/metrics").text


def test_non_stream_disconnect_aborts(fake_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "REPEAT:3000 SLEEP:5"}]}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.url + "/v1/chat/completions", json=body, timeout=0.5)
    status = wait_idle(fake_server.url, timeout=5)
    assert status["idle"] and status["kv"]["leaked"] == 0
    assert time.monotonic() - t0 < 10        # the whole answer would take 15 s


def test_system_messages_anywhere(client):
    """Leading system/developer messages become one; a later one stays in place (the demo template
    renders it as a system turn)."""
    r = client.chat.completions.create(model=MODEL, max_tokens=500, messages=[
        {"role": "system", "content": "rule one"}, {"role": "developer", "content": "rule two"},
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        {"role": "system", "content": "late rule"}, {"role": "user", "content": "ECHO"}])
    prompt = r.choices[0].message.content
    assert prompt.startswith("system\nrule one\n\nrule two\nuser\nq\nassistant\na\nsystem\nlate rule\nuser\nECHO")
