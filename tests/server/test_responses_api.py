"""POST /v1/responses against the scripted core (and once against the demo model), driven by the
official openai SDK: items, the typed event stream, tool round trips, previous_response_id, errors."""
import json

import httpx
import openai
import pytest
from bad_requests import check_error_shape
from server_helpers import MODEL, ServerProcess, wait_idle

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SHOWN_CALL = CALL.replace("<tool_call>", "[tool_call]").replace("</tool_call>", "[/tool_call]")   # as ECHO shows it


@pytest.fixture(scope="module")
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key="unused", max_retries=0)


def create(client, text, **kw):
    return client.responses.create(model=MODEL, input=text, **kw)


def echoed(client, **kw) -> str:
    """The prompt the server rendered (the scripted core's ECHO reply)."""
    return client.responses.create(model=MODEL, **kw).output_text


def test_text_response_and_usage(client, demo_tokenizer):
    r = create(client, "SAY:hello world", instructions="be brief")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed" and r.model == MODEL
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert [p.type for p in msg.content] == ["output_text"] and r.output_text == "hello world"
    prompt = demo_tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "SAY:hello world"}])
    u = r.usage
    assert u.input_tokens == len(demo_tokenizer.encode(prompt)) and u.input_tokens_details.cached_tokens == 0
    assert u.output_tokens == len(demo_tokenizer.encode("hello world")) + 1          # + end of turn
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "be brief" and r.store is True and r.error is None


def test_cached_tokens_reported(client):
    """A scripted core has no prefix cache: the field is there and counts nothing."""
    r = create(client, "SAY:x")
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.input_tokens > 0


def test_reasoning_item(client):
    r = create(client, "SAY:<think>\nplan it\n</think>\n\nthe answer")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning = r.output[0]
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text == "plan it"
    assert reasoning.summary == [] and r.output_text == "the answer"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


def _check_item_events(events):
    """Each item: added, its content events, done, with one output_index; returns the item types."""
    types, i = [], 0
    while i < len(events):
        added = events[i]
        assert added.type == "response.output_item.added" and added.output_index == len(types)
        item_type, index = added.item.type, added.output_index
        assert added.item.status == "in_progress"
        i += 1
        while events[i].type != "response.output_item.done":
            assert events[i].output_index == index and events[i].item_id == added.item.id, events[i]
            i += 1
        assert events[i].output_index == index and events[i].item.id == added.item.id
        types.append(item_type)
        i += 1
    return types


def test_stream_event_sequence(client):
    text = "SAY:<think>hmm</think>Let me look." + CALL
    whole = create(client, text, tools=TOOLS)
    events = list(create(client, text, tools=TOOLS, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type == "response.completed"
    assert _check_item_events(events[2:-1]) == ["reasoning", "message", "function_call"]
    kinds = [e.type for e in events]
    for part in ("response.content_part.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                 "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                 "response.function_call_arguments.delta", "response.function_call_arguments.done"):
        assert part in kinds, part
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text == "Let me look."
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    assert [o.type for o in final.output] == [o.type for o in whole.output]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"} == json.loads(final.output[2].arguments)


def test_stream_helper_accumulates(client):
    with client.responses.stream(model=MODEL, input="SAY:<think>a</think>b c" + CALL, tools=TOOLS) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "b c" and final.output[2].name == "get_weather"


def test_stream_wire_format(fake_server):
    body = {"model": MODEL, "input": "SAY:hi", "stream": True}
    with httpx.stream("POST", fake_server.url + "/v1/responses", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        blocks = r.read().decode().strip().split("\n\n")
    for block in blocks:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        assert json.loads(lines["data"])["type"] == lines["event"]          # no [DONE] sentinel either


def test_function_call_round_trip(client):
    first = create(client, "SAY:Checking." + CALL, tools=TOOLS)
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    items = [{"role": "user", "content": "weather?"}, *[o.model_dump(exclude_none=True) for o in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
             {"role": "user", "content": [{"type": "input_text", "text": "ECHO"}]}]
    prompt = echoed(client, input=items, tools=TOOLS, store=False)
    assert "Checking.\n" + SHOWN_CALL in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert '"name": "get_weather"' in prompt.split("<tools>\n")[1].split("\n</tools>")[0]   # the tool list


def test_previous_response_id_continues(client):
    first = create(client, "SAY:first answer", instructions="SECRET-A")
    prompt = echoed(client, previous_response_id=first.id, input="ECHO", instructions="rules B")
    assert "SAY:first answer" in prompt and "assistant\nfirst answer" in prompt
    assert "rules B" in prompt and "SECRET-A" not in prompt         # instructions are not carried over


def test_previous_response_id_tool_round_trip(client):
    first = create(client, "SAY:" + CALL, tools=TOOLS)
    call = first.output[-1]
    second = create(client, [{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}],
                    previous_response_id=first.id, tools=TOOLS)
    prompt = echoed(client, previous_response_id=second.id, input="ECHO")
    assert SHOWN_CALL in prompt and "<tool_response>\nrain\n</tool_response>" in prompt


def test_unstored_or_unknown_previous_response_is_400(client):
    unstored = create(client, "SAY:x", store=False)
    for rid in (unstored.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as e:
            create(client, "hi", previous_response_id=rid)
        error = e.value.response.json()["error"]
        assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"


def test_length_is_incomplete(client):
    r = create(client, "REPEAT:50", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = list(create(client, "REPEAT:50", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3


def test_hosted_tools_are_not_shown(client):
    tools = TOOLS + [{"type": "web_search"}, {"type": "custom", "name": "apply_patch", "description": "patch"}]
    r = client.responses.create(model=MODEL, input="ECHO", tools=tools)
    assert [t.name for t in r.tools] == ["get_weather"]
    assert '"get_weather"' in r.output_text and "apply_patch" not in r.output_text


def test_tool_choice(client):
    assert "<tools>" not in echoed(client, input="ECHO", tools=TOOLS, tool_choice="none")
    r = create(client, "SAY:" + CALL, tools=TOOLS, tool_choice="none")
    assert r.output_text == CALL and [o.type for o in r.output] == ["message"]
    r = create(client, "SAY:" + CALL, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    assert r.output[-1].type == "function_call" and r.tool_choice.name == "get_weather"


def test_json_schema_in_the_instructions(client, monkeypatch):
    """The schema goes into the instructions; enforced (no warning) with the grammar extra, else
    accepted with an x-freetoken-warning header (the engine side is test_structured_output.py)."""
    from freetoken import grammar
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    for installed in (True, False):
        monkeypatch.setattr(grammar, "available", lambda: installed)
        raw = client.responses.with_raw_response.create(
            model=MODEL, input="ECHO", text={"format": {"type": "json_schema", "name": "count", "schema": schema}})
        warning = raw.headers.get("x-freetoken-warning")
        assert warning is None if installed else "not enforced" in warning and "freetoken[grammar]" in warning
    r = raw.parse()
    assert r.text.format.type == "json_schema" and r.text.format.name == "count"
    assert json.dumps(schema) in r.output_text                      # the schema went into the instructions


def test_reasoning_effort_none_and_developer_message(client):
    prompt = echoed(client, input=[{"role": "developer", "content": "dev rules"}, {"role": "user", "content": "ECHO"}],
                    instructions="base", reasoning={"effort": "none"})
    assert prompt.startswith("system\nbase\n\ndev rules") and prompt.endswith("assistant\n<think>\n\n</think>\n\n")


def test_engine_failure(client):
    with pytest.raises(openai.InternalServerError):
        create(client, "FAIL")
    events = list(create(client, "FAIL", stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"


BAD = {
    "unknown item type": {"input": [{"type": "computer_call", "call_id": "c"}]},
    "item_reference": {"input": [{"type": "item_reference", "id": "msg_1"}]},
    "image part": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
    "input not a list": {"input": 5},
    "message without content": {"input": [{"type": "message", "role": "user"}]},
    "unknown role": {"input": [{"role": "wizard", "content": "hi"}]},
    "function_call without call_id": {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
    "function_call_output without output": {"input": [{"type": "function_call_output", "call_id": "c"}]},
    "unknown field": {"input": "hi", "frobnicate": 1},
    "tool without name": {"input": "hi", "tools": [{"type": "function", "parameters": {}}]},
    "tool_choice names a missing tool": {"input": "hi", "tool_choice": {"type": "function", "name": "nope"}},
    "hosted tool_choice": {"input": "hi", "tool_choice": {"type": "web_search"}},
    "background": {"input": "hi", "background": True},
    "truncation auto": {"input": "hi", "truncation": "auto"},
    "conversation": {"input": "hi", "conversation": "conv_1"},
    "top_logprobs above 20": {"input": "hi", "top_logprobs": 21},
    "zero max_output_tokens": {"input": "hi", "max_output_tokens": 0},
    "temperature too high": {"input": "hi", "temperature": 3},
    "bad text.format": {"input": "hi", "text": {"format": {"type": "yaml"}}},
    "json_schema without schema": {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
    "bad reasoning effort": {"input": "hi", "reasoning": {"effort": "extreme"}},
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_request_is_400_in_openai_shape(fake_server, name):
    r = httpx.post(fake_server.url + "/v1/responses", json={"model": MODEL, **BAD[name]}, timeout=30)
    assert r.status_code == 400, (name, r.text[:300])
    check_error_shape(r, "/v1/responses")
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_bad_item_names_its_param(client):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, [{"role": "user", "content": "hi"}, {"type": "hologram"}])
    assert e.value.response.json()["error"]["param"] == "input[1].type"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-9", input="hi")


def test_stream_disconnect_frees(fake_server):
    body = {"model": MODEL, "input": "REPEAT:3000 SLEEP:5", "stream": True}
    with httpx.stream("POST", fake_server.url + "/v1/responses", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(12):
            next(lines)
    status = wait_idle(fake_server.url, timeout=5)
    assert status["idle"] and status["kv"]["leaked"] == 0


@pytest.fixture(scope="module")
def demo_server():
    proc = ServerProcess()
    yield proc
    log = "".join(proc.stderr_lines)
    assert proc.stop() == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_demo_model_stream_matches_create(demo_server):
    oa = openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    kw = {"model": MODEL, "input": "Write Python code.", "max_output_tokens": 16, "temperature": 0}
    whole = oa.responses.create(**kw)
    assert whole.status in ("completed", "incomplete") and 0 < whole.usage.output_tokens <= 16
    events = list(oa.responses.create(stream=True, **kw))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    again = oa.responses.create(previous_response_id=whole.id, **kw)
    assert again.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens - 1
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens    # the first prompt
