"""Structured output enforced by constrained decoding (llguidance, the `grammar` extra), end to end:
the official openai and anthropic SDKs against `python -m freetoken serve` on the packaged demo model. The tiny
model writes code-like garbage unconstrained, so valid JSON here is the grammar's doing (the
unconstrained control request shows it)."""
import json
import re
import time

import httpx
import openai
import pytest
from server_helpers import MODEL

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "kind": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "kind"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Describe a pet as JSON."}]
NO_THOUGHT = {"type": "disabled"}       # the demo model thinks first otherwise (allowed: see the reasoning test)


def valid(text: str) -> bool:
    """json.loads(text) matches SCHEMA (checked by hand: no jsonschema dependency)."""
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == {"name", "age", "kind"} and isinstance(v["name"], str)
            and len(v["name"]) <= 12 and type(v["age"]) is int and 0 <= v["age"] <= 120
            and v["kind"] in ("cat", "dog"))


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


def test_start_up_says_constrained_decoding_is_on_and_the_first_request_is_constrained(server, oa):
    """The first request of this module's fresh server: the llguidance tokenizer was built during
    start-up (one log line before the ready line), not by this request on the engine thread."""
    deadline = time.monotonic() + 10                  # stderr is read by a thread: it may lag stdout
    while not (lines := [line for line in server.stderr_lines if "constrained decoding" in line]):
        assert time.monotonic() < deadline, server.stderr_lines
        time.sleep(0.05)
    assert len(lines) == 1 and "constrained decoding: on (llguidance " in lines[0], lines
    assert re.search(r"tokenizer of 4096 ids built in \d+\.\d\d s\)$", lines[0].strip()), lines
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format=FORMAT)
    assert valid(r.choices[0].message.content), r.choices[0].message.content


def test_json_schema_is_enforced_and_the_control_is_not_json(oa):
    control = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0)
    assert not valid(control.choices[0].message.content)            # unconstrained: not the schema
    for temperature, seed in ((0, None), (1.0, 1), (1.0, 2), (1.5, 3)):     # no thought: JSON at once
        r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=temperature,
                                       seed=seed, response_format=FORMAT, reasoning_effort="none")
        text = r.choices[0].message.content
        assert valid(text), (temperature, text)
        assert r.choices[0].finish_reason == "stop"                  # the grammar ended it


def test_the_model_may_think_first_and_the_thought_comes_back_as_reasoning(oa):
    """A model that opens a thought itself (here made to by logit_bias on <think>, which the plain
    JSON grammar would mask): the grammar lets it (free text up to </think>, the blank line) and
    binds from the answer on; the thought's markup never reaches the content. What the thought may
    hold: test_tool_grammar.py's grammar test."""
    from freetoken.models.demo import packaged_demo_dir
    from freetoken.tokenizer import Tokenizer
    think = Tokenizer.from_dir(packaged_demo_dir()).token_to_id("<think>")
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0, response_format=FORMAT,
                                   logit_bias={str(think): 100}, logprobs=True)
    message = r.choices[0].message
    written = "".join(t.token for t in r.choices[0].logprobs.content)
    assert written.startswith("<think>") and "</think>" in written, written          # it did think
    assert valid(message.content) and r.choices[0].finish_reason == "stop", message
    assert "think>" not in message.content and isinstance(message.model_extra.get("reasoning_content", ""), str)


def test_json_object_and_streaming(oa):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                   response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:                                                           # cut by max_tokens: a JSON prefix
        assert r.choices[0].message.content.startswith("{")
    stream = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=1.0, seed=5,
                                        response_format=FORMAT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert valid(text), text


def test_responses_text_format_is_enforced(server, oa):
    raw = oa.responses.with_raw_response.create(
        model=MODEL, input="Describe a pet.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA}})
    assert "x-freetoken-warning" not in raw.headers
    r = raw.parse()
    assert valid(r.output_text), r.output_text and r.status == "completed"


def test_a_schema_that_does_not_compile_is_a_400(server):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 5}}}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "schema" in r.json()["error"]["message"], r.text


def test_grammar_after_a_thought_the_prompt_opened():
    """A prompt that leaves <think> open (Qwen3 thinking templates): the thought is free text up to
    </think>, then the blank line, then the JSON; without the close the JSON grammar alone."""
    from freetoken.models.demo import packaged_demo_dir
    from freetoken.grammar import Grammars, after_open_thought, json_grammar
    from freetoken.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(packaged_demo_dir())
    grammars = Grammars(tok.to_json(), 4096, tok.stop_token_ids)
    answer = '{"name": "Rex", "age": 3, "kind": "dog"}'
    m = grammars.matcher(after_open_thought(json_grammar(SCHEMA)))
    ids = tok.encode("A dog { maybe } named Rex.") + [tok.token_to_id("</think>")] + tok.encode("\n\n" + answer)
    assert all(m.consume(t) for t in ids) and m.stopped and m.error is None
    plain = grammars.matcher(json_grammar(SCHEMA))
    assert all(plain.consume(t) for t in tok.encode(answer)) and plain.stopped
    assert not grammars.matcher(json_grammar(SCHEMA)).consume(tok.token_to_id("</think>"))


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a text file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 30}},
                                                          "required": ["path"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                           "parameters": {"type": "object", "properties": {   # bounded: hot digits run on
                                               "a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                                          "required": ["a", "b"], "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_tool_choice_required_and_named_are_enforced(oa, choice):
    control = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=60,
                                         temperature=0)
    assert not control.choices[0].message.tool_calls                 # "none" holds (the demo model calls tools)
    for seed in (1, 2):
        r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=400,
                                       temperature=1.0, seed=seed, parallel_tool_calls=False,
                                       reasoning_effort="none")       # sampled hot, a thought may run on
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0]
        args = json.loads(calls[0].function.arguments)
        if choice != "required":
            assert calls[0].function.name == "add"
        if calls[0].function.name == "add":
            assert set(args) == {"a", "b"} and all(type(v) is int for v in args.values())
        else:
            assert calls[0].function.name == "read_file" and set(args) == {"path"}


def test_without_the_extra_the_error_names_it(monkeypatch):
    """No llguidance: a constrained request is a 400 (server) / InvalidRequest (engine) that says
    how to install it."""
    from freetoken import grammar
    from freetoken.engine.request import SamplingParams
    from freetoken.server.errors import APIError
    from freetoken.server.protocol import constrained

    def missing():
        raise grammar.GrammarUnavailable(f"constrained decoding is not installed: {grammar.INSTALL_HINT}")
    monkeypatch.setattr(grammar, "_llg", missing)
    assert not grammar.available()
    with pytest.raises(APIError) as e:
        constrained(SamplingParams(), grammar.json_grammar(), "response_format json_object", "response_format")
    assert e.value.status == 400 and "pip install 'freetoken[grammar]'" in str(e.value)
    assert constrained(SamplingParams(), None, "response_format", "response_format").grammar is None
    g = grammar.Grammars("{}", 4096, [0])
    with pytest.raises(grammar.GrammarUnavailable, match=r"freetoken\[grammar\]"):
        g.matcher(grammar.json_grammar())


def test_responses_tool_choice_required_is_enforced(oa):
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    for choice in ("required", {"type": "function", "name": "read_file"}):
        r = oa.responses.create(model=MODEL, input="Write Python code.", tools=tools, tool_choice=choice,
                                max_output_tokens=120, temperature=1.0, parallel_tool_calls=False)
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1, r.output
        args = json.loads(calls[0].arguments)
        assert calls[0].name in ("read_file", "add") and isinstance(args, dict)
        if choice != "required":
            assert calls[0].name == "read_file" and set(args) == {"path"}


def test_anthropic_tool_choice_any_and_tool_are_enforced(server):
    import anthropic
    an = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    small = {"type": "integer", "minimum": 0, "maximum": 99}    # greedy digits could run to max_tokens
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    tools[1]["input_schema"] = {**tools[1]["input_schema"], "properties": {"a": small, "b": small}}
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "add", "disable_parallel_tool_use": True}):
        r = an.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=tools, tool_choice=choice,
                               thinking=NO_THOUGHT)
        uses = [b for b in r.content if b.type == "tool_use"]
        assert r.stop_reason == "tool_use" and len(uses) == 1, r.content
        assert uses[0].name in ("read_file", "add") and isinstance(uses[0].input, dict)
        if choice["type"] == "tool":
            assert uses[0].name == "add" and set(uses[0].input) == {"a", "b"}


@pytest.fixture(scope="module")
def an(demo_server):
    import anthropic
    return anthropic.Anthropic(base_url=demo_server.url, api_key="unused", max_retries=0, timeout=300)


def test_anthropic_output_config_format_is_enforced(an):
    control = an.messages.create(model=MODEL, max_tokens=60, messages=ASK)
    assert not valid(control.content[0].text)                       # unconstrained: not the schema
    for seed in (None, 1, 2):
        extra = {} if seed is None else {"temperature": 1.0, "seed": seed}
        r = an.messages.create(model=MODEL, max_tokens=60, messages=ASK, extra_body=extra, thinking=NO_THOUGHT,
                               output_config={"effort": "low", "format": {"type": "json_schema", "schema": SCHEMA}})
        assert [b.type for b in r.content] == ["text"] and valid(r.content[0].text), (seed, r.content)
        assert r.stop_reason == "end_turn"                          # the grammar ended it
    with an.messages.stream(model=MODEL, max_tokens=60, messages=ASK, extra_body={"temperature": 1.0, "seed": 4},
                            thinking=NO_THOUGHT,
                            output_config={"format": {"type": "json_schema", "schema": SCHEMA}}) as stream:
        text = "".join(stream.text_stream)
    assert valid(text), text


def test_anthropic_messages_parse_and_the_beta_output_format(an):
    """The SDK's messages.parse turns a pydantic model into output_config.format (moving the
    constraints it does not send into descriptions, so the fields here are closed sets); the older
    beta sends the schema as the top-level output_format."""
    from typing import Literal

    import pydantic

    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        indoor: bool
        legs: Literal[2, 3, 4]
    parsed = an.messages.parse(model=MODEL, max_tokens=60, messages=ASK, output_format=Pet, thinking=NO_THOUGHT)
    assert isinstance(parsed.parsed_output, Pet) and parsed.stop_reason == "end_turn", parsed.content
    r = an.beta.messages.create(model=MODEL, max_tokens=60, messages=ASK, betas=["structured-outputs-2025-11-13"],
                                thinking=NO_THOUGHT,
                                extra_body={"output_format": {"type": "json_schema", "schema": SCHEMA}})
    assert valid(r.content[0].text), r.content


def test_anthropic_bad_formats_are_400_in_anthropic_shape(server, an):
    import anthropic
    bad = {"type": "json_schema", "schema": {"type": 5}}
    cases = [({"output_config": {"format": bad}}, "schema"),
             ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
               "output_format": {"type": "json_schema", "schema": SCHEMA}}, "not both"),
             ({"output_format": {"type": "json_object"}}, "output_format.type"),
             ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema is required")]
    for extra, needle in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            an.messages.create(model=MODEL, max_tokens=20, messages=ASK, extra_body=extra)
        body = e.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert needle in body["error"]["message"], (needle, body)
    # streamed, a grammar the engine refuses is known only once the request reaches it: an error event
    with httpx.stream("POST", server.url + "/v1/messages", timeout=60, json={
            "model": MODEL, "max_tokens": 20, "messages": ASK, "stream": True, "output_config": {"format": bad}}) as r:
        text = r.read().decode()
    assert "event: error" in text and '"invalid_request_error"' in text and "schema" in text, text


def test_anthropic_forced_tool_choice_wins_over_the_format(an):
    tool = {"name": "add", "description": "Add.", "input_schema": TOOLS[1]["function"]["parameters"]}
    tool["input_schema"] = {**tool["input_schema"], "properties": {k: {"type": "integer", "minimum": 0, "maximum": 99}
                                                                   for k in ("a", "b")}}
    r = an.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=[tool],
                           tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True},
                           output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"], r.content
