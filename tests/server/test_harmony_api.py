"""gpt-oss's harmony format through the official SDKs: a scripted core (fake_core.py) whose model
"says" harmony text, on a tokenizer that has harmony's markers as special tokens and a template in
the format (tests/fixtures/harmony/). analysis becomes reasoning, a message to functions.NAME a tool
call, final the content: on the OpenAI chat route (whole and streamed), Responses and Anthropic.
The request's reasoning effort reaches the template. Then the real engine on the gpt-oss fixture's
weights with that vocabulary: forced tool choices and JSON formats held to harmony's form by grammars."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import openai
import pytest
from fake_core import FakeCore
from server_helpers import ServerThread

from freetoken.models.demo import synth_tokenizer_dir
from freetoken.tokenizer import Tokenizer

MODEL = "tiny-agent-moe"          # the name the scripted server answers to
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "harmony" / "chat_template.jinja"
THINK_THEN_ANSWER = "SAY:<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>4"
CALL = ("SAY:<|channel|>analysis<|message|>Look first.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.read_file <|constrain|>json<|message|>{\"path\": \"a.txt\"}")
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory) -> Path:
    """The demo vocabulary plus harmony's markers (special tokens), the harmony template, and
    <|return|> / <|call|> as the stop tokens, as gpt-oss's generation_config says."""
    from tokenizers import Tokenizer as HF
    d = tmp_path_factory.mktemp("harmony")
    tok = HF.from_file(str(synth_tokenizer_dir() / "tokenizer.json"))
    tok.add_special_tokens(MARKERS)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    shutil.copy(TEMPLATE, d / "chat_template.jinja")
    ids = [tok.token_to_id(m) for m in ("<|return|>", "<|call|>")]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return d


@pytest.fixture(scope="module")
def harmony_tokenizer(harmony_dir):
    tokenizer = Tokenizer.from_dir(harmony_dir)
    assert tokenizer.speaks_harmony
    return tokenizer


@pytest.fixture(scope="module")
def server(harmony_tokenizer):
    server = ServerThread(lambda: FakeCore(harmony_tokenizer)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x")


def test_chat_splits_analysis_from_the_final_answer(oa):
    msg = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": THINK_THEN_ANSWER}]).choices[0].message
    assert msg.content == "4" and msg.reasoning_content == "Two and two."
    chunks = list(oa.chat.completions.create(model=MODEL, stream=True,
                                             messages=[{"role": "user", "content": THINK_THEN_ANSWER}]))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "4"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Two and two."


def test_chat_tool_call(oa):
    choice = oa.chat.completions.create(model=MODEL, tools=TOOLS, messages=[{"role": "user", "content": CALL}]).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "a.txt"}
    assert choice.message.reasoning_content == "Look first."


def test_a_round_trip_renders_the_call_and_its_result_in_harmony(oa):
    """The second turn: the assistant's reasoning (as `thinking`, what gpt-oss's template reads), its
    call and the tool's result rendered by the template (ECHO replies the rendered prompt, special
    tokens skipped, so only the text between them shows)."""
    messages = [{"role": "user", "content": "read a.txt"},
                {"role": "assistant", "content": None, "reasoning_content": "Look first.",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "read_file", "arguments": "{\"path\": \"a.txt\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "name": "read_file", "content": "hello"},
                {"role": "user", "content": "ECHO"}]
    echoed = oa.chat.completions.create(model=MODEL, tools=TOOLS, messages=messages).choices[0].message.content
    assert "assistantanalysisLook first.assistantcommentary to=functions.read_file json{\"path\": \"a.txt\"}" in echoed
    assert "functions.read_file to=assistantcommentaryhello" in echoed


@pytest.mark.parametrize("effort,rendered", [(None, "medium"), ("high", "high"), ("minimal", "low"), ("xhigh", "high")])
def test_reasoning_effort_reaches_the_template(oa, effort, rendered):
    extra = {} if effort is None else {"reasoning_effort": effort}
    echoed = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ECHO"}], **extra)
    assert f"Reasoning: {rendered}\n" in echoed.choices[0].message.content


def test_responses_reasoning_item_and_function_call(oa):
    r = oa.responses.create(model=MODEL, input=CALL, tools=[{"type": "function", "name": "read_file",
                                                          "parameters": TOOLS[0]["function"]["parameters"]}],
                            reasoning={"effort": "low"})
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "function_call"], kinds
    assert r.output[1].name == "read_file" and json.loads(r.output[1].arguments) == {"path": "a.txt"}
    assert r.output[0].content[0].text == "Look first."


def test_anthropic_thinking_and_tool_use(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x")
    msg = client.messages.create(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": CALL}],
                                 tools=[{"name": "read_file", "input_schema": TOOLS[0]["function"]["parameters"]}])
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[0].thinking == "Look first." and msg.content[1].input == {"path": "a.txt"}


@pytest.fixture(scope="module")
def gpt_oss_dir(harmony_dir, tmp_path_factory) -> Path:
    """The gpt-oss fixture's weights with the harmony vocabulary and template, as a hub directory has them."""
    d = tmp_path_factory.mktemp("gpt_oss_harmony")
    src = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "gpt_oss" / "fp32"
    for f in ("config.json", "model.safetensors"):
        shutil.copy(src / f, d / f)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(harmony_dir / f, d / f)
    return d


@pytest.fixture(scope="module")
def engine_oa(gpt_oss_dir):
    """The real engine serving that directory (random weights: the grammars decide the form)."""
    from freetoken.config import EngineConfig
    from freetoken.engine.core import EngineCore
    server = ServerThread(lambda: EngineCore(EngineConfig(model=str(gpt_oss_dir), backend="cpu"))).start(wait_ready=False)
    assert server.engine.wait_ready(300), server.engine.error      # a cold numba cache compiles the gpt-oss paths
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x"), server
    server.stop()


# bounded arguments (a random model under a grammar must still reach the end) and no analysis
# message first: "analysis"'s first token is banned, so the grammar's other branch is taken
PICK = {"type": "object", "properties": {"path": {"enum": ["a.txt", "b.txt"]}}, "required": ["path"],
        "additionalProperties": False}
PICK_TOOLS = [{"type": "function", "function": {"name": name, "parameters": PICK}} for name in ("read_file", "delete_file")]


def no_analysis(harmony_dir) -> dict:
    tok = Tokenizer.from_dir(harmony_dir)
    return {str(tok.encode("analysis")[0]): -100}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "delete_file"}}],
                         ids=["required", "named"])
def test_a_forced_tool_choice_makes_the_model_call_in_harmony(engine_oa, harmony_dir, choice):
    """tool_choice required or named: harmony's call form is forced (commentary to=functions.NAME,
    <|constrain|>json, the arguments' JSON), so even random weights answer with a well-formed
    call, parsed back into tool_calls; a named choice calls that tool."""
    client, _ = engine_oa
    reply = client.chat.completions.create(model=MODEL, max_tokens=64, tools=PICK_TOOLS, tool_choice=choice,
                                           logit_bias=no_analysis(harmony_dir), temperature=0,
                                           messages=[{"role": "user", "content": "hi"}])
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments)["path"] in ("a.txt", "b.txt")
    assert call.function.name in ("read_file", "delete_file")
    if isinstance(choice, dict):
        assert call.function.name == "delete_file"


def test_the_forced_call_may_follow_an_analysis_message(gpt_oss_dir, harmony_dir):
    """The grammar's other branch, read off what the model wrote: "commentary"'s first token banned
    where "analysis" may start instead, and <|end|> favoured, the model writes an (empty) analysis
    message, then the call the grammar forces (where "commentary" is the only token it allows,
    banned or not); the call's arguments are compact JSON."""
    from freetoken import LLM, SamplingParams
    from freetoken.grammar import harmony_tool_call_grammar
    llm = LLM(str(gpt_oss_dir), backend="cpu")
    tok = llm.core.tokenizer
    bias = ((tok.encode("commentary")[0], -100.0), (tok.token_to_id("<|end|>"), 100.0))
    params = SamplingParams(max_tokens=64, temperature=0, logit_bias=bias, skip_special_tokens=False,
                            grammar=harmony_tool_call_grammar(PICK_TOOLS))
    text = llm.generate([tok.encode("hi")], params)[0].text
    head = "<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>commentary to=functions."
    assert text.startswith(head), text
    name, _, rest = text[len(head):].partition(" <|constrain|>json<|message|>")
    assert name in ("read_file", "delete_file") and rest in ('{"path":"a.txt"}', '{"path":"b.txt"}'), text


def walk(grammars, tok, grammar: str, text: str, stop: str) -> str:
    """'ok' when the matcher takes text's tokens and the stop token, else where it refused."""
    m = grammars.matcher(grammar)
    ids = tok.encode(text) + [tok.token_to_id(stop)]
    bad = next((i for i, t in enumerate(ids) if not m.consume(t)), None)
    return "ok" if bad is None else tok.decode(ids[:bad + 1], skip_special_tokens=False)


AUTO_CASES = [   # (reply as harmony writes it, its stop token, taken)
    ("<|channel|>analysis<|message|>to=functions.x?<|end|><|start|>assistant<|channel|>final<|message|>hi",
     "<|return|>", True),
    ("<|channel|>commentary<|message|>Looking.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.read_file <|constrain|>json<|message|>{"path":"a.txt"}', "<|call|>", True),
    ('<|channel|>commentary to=functions.delete_file <|constrain|>json<|message|>{"path":"b.txt"}', "<|call|>", True),
    ('<|channel|>commentary to=functions.write_file <|constrain|>json<|message|>{"path":"b.txt"}', "<|call|>", False),
    ('<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>{"path":"c.txt"}', "<|call|>", False),
    ("<|channel|>analysis<|message|>and nothing after", "<|return|>", False),
]


def test_the_auto_grammar_holds_a_call_to_the_tools_and_leaves_every_other_message_free(harmony_dir):
    """tool_choice auto in harmony: analysis and commentary messages and the final answer are free
    text (even text that spells a call opener: the header is where a call opens); a call names a
    listed tool and its arguments hold to the schema; the reply ends with a final message or a call."""
    from freetoken.grammar import Grammars, harmony_tool_call_grammar
    tok = Tokenizer.from_dir(harmony_dir)
    grammars = Grammars((harmony_dir / "tokenizer.json").read_text(), tok.vocab_size,
                        [tok.token_to_id(m) for m in ("<|return|>", "<|call|>")])
    grammar = harmony_tool_call_grammar(PICK_TOOLS, auto=True)
    assert grammars.problem(grammar) is None
    for text, stop, taken in AUTO_CASES:
        assert (walk(grammars, tok, grammar, text, stop) == "ok") == taken, text


def test_auto_holds_the_call_a_model_opens_to_a_listed_tool(engine_oa, harmony_dir):
    """Through the SDK with tool_choice auto: the random model is pushed toward a call (the
    channels' other first tokens and <|message|> after "commentary" banned); what it writes from
    "to=functions." on is a listed tool and arguments of its schema, parsed into tool_calls.
    Without the grammar the random weights write no well-formed call."""
    client, _ = engine_oa
    tok = Tokenizer.from_dir(harmony_dir)
    bias = {str(tok.encode(word)[0]): -100 for word in ("analysis", "final")}
    bias[str(tok.token_to_id("<|message|>"))] = -100
    reply = client.chat.completions.create(model=MODEL, max_tokens=64, tools=PICK_TOOLS, tool_choice="auto",
                                           logit_bias=bias, temperature=0, messages=[{"role": "user", "content": "hi"}])
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name in ("read_file", "delete_file") and reply.choices[0].finish_reason == "tool_calls"
    assert call.function.arguments in ('{"path":"a.txt"}', '{"path":"b.txt"}')     # as the model wrote them


def test_anthropic_tool_choice_any_is_a_tool_use_block(engine_oa):
    _, server = engine_oa
    client = anthropic.Anthropic(base_url=server.url, api_key="x")
    msg = client.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "hi"}],
                                 tools=[{"name": t["function"]["name"], "input_schema": PICK} for t in PICK_TOOLS],
                                 tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert msg.stop_reason == "tool_use" and msg.content[-1].type == "tool_use", msg.content
    assert msg.content[-1].input["path"] in ("a.txt", "b.txt")


def test_a_json_format_is_the_final_message(engine_oa, harmony_dir):
    """response_format json_schema (chat) and text.format (Responses): the JSON is harmony's final
    message, so it is the content, whole, and no marker reaches the client."""
    client, _ = engine_oa
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=30, logit_bias=no_analysis(harmony_dir), messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(reply.choices[0].message.content) in ({"ok": True}, {"ok": False})
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert json.loads(r.output_text) in ({"ok": True}, {"ok": False})


def test_the_engine_serves_a_gpt_oss_directory_that_speaks_harmony(engine_oa, harmony_dir, gpt_oss_dir):
    """The real engine on the gpt-oss fixture's weights with a harmony vocabulary and template (as
    a hub directory has them): a chat request with tools and an effort is answered. A logit bias
    makes the model write nothing but <|channel|> markers: they reach the parser (the detokenizer
    keeps them for this model) and none reaches the client."""
    client, _ = engine_oa
    channel = Tokenizer.from_dir(harmony_dir).token_to_id("<|channel|>")
    reply = client.chat.completions.create(model=MODEL, max_tokens=8, tools=TOOLS, reasoning_effort="high",
                                           logit_bias={str(channel): 100},
                                           messages=[{"role": "user", "content": "hi"}])
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 8
    text = (choice.message.content or "") + (getattr(choice.message, "reasoning_content", None) or "")
    assert not any(m in text for m in MARKERS) and not choice.message.tool_calls
    from freetoken import LLM, SamplingParams          # what the parser got: the markers, kept in the text
    llm = LLM(str(gpt_oss_dir), backend="cpu")
    params = SamplingParams(max_tokens=4, logit_bias=((channel, 100.0),), skip_special_tokens=False)
    assert llm.generate([[5, 6]], params)[0].text == "<|channel|>" * 4
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=4, logit_bias=((channel, 100.0),)))[0].text == ""



def test_the_next_turn_resumes_at_a_window_checkpoint(engine_oa, harmony_dir):
    """gpt-oss's sliding layers keep per-request state, so a cached prefix is reused only from a
    state checkpoint: one is taken after each harmony message's end (<|end|>, <|call|>) and at
    the prompt's end, and the next turn of a conversation, sent through the SDK, resumes at one."""
    import httpx
    from freetoken.engine.anchors import Anchors
    tok = Tokenizer.from_dir(harmony_dir)
    anchors = Anchors.for_tokenizer(tok)
    assert {tok.token_to_id(m) for m in ("<|end|>", "<|call|>")} == {m[0] for m in anchors.after if len(m) == 1}
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "read_file", "arguments": '{"path":"a.txt"}'}}]}
    result = {"role": "tool", "tool_call_id": "c1", "name": "read_file", "content": "hello"}
    ends_query = lambda messages: anchors.ends_a_query(tok.encode(tok.apply_chat_template(messages, TOOLS)))
    ask = [{"role": "user", "content": "read a.txt"}]
    assert ends_query(ask) and not ends_query(ask + [call, result])    # a query's end is kept longest
    assert ends_query(ask + [call, result, {"role": "user", "content": "and b.txt?"}])
    client, server = engine_oa
    status = lambda: httpx.get(server.url + "/v1/cache/status").json()["state_checkpoints"]
    first = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hi there"}]
    reply = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=first)
    before = status()
    again = first + [{"role": "assistant", "content": reply.choices[0].message.content or "ok"},
                     {"role": "user", "content": "and again"}]
    client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=again)
    after = status()
    assert after["hits"] == before["hits"] + 1 and after["reused_tokens"] - before["reused_tokens"] > 10, after
