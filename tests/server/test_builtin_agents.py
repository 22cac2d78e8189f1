"""Each built-in model as a user runs it, `python -m freetoken serve --model NAME`, driven by the
official openai SDK through a tool round trip: given a tool list and a request that needs a tool,
the reply is a call of a listed tool with arguments that fit its schema; given the tool's result,
the model answers in text. The statistics over held-out requests are in each model's README
(tools/eval_demo.py); this is the path they are measured on, end to end."""
import inspect
import json
from pathlib import Path

import openai
import pytest
from server_helpers import ServerProcess

from freetoken.models.demo import BUILTIN

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a text file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}},
         {"type": "function", "function": {"name": "run_command", "description": "Run a shell command.",
                                           "parameters": {"type": "object",
                                                          "properties": {"command": {"type": "string"}},
                                                          "required": ["command"]}}}]
CAPTURES = Path(__file__).resolve().parent / "fixtures" / "harnesses"
ASK = [{"role": "user", "content": "Read the file notes.txt and tell me the first word."}]


@pytest.fixture(scope="module", params=sorted(BUILTIN))
def served(request):
    proc = ServerProcess("--model", request.param, "--max-running-requests", "2")
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield request.param, client
    log = "".join(proc.stderr_lines)
    assert proc.stop() == 0, log[-3000:]
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_the_model_card_names_the_packaged_model(served):
    name, client = served
    (card,) = client.models.list().data
    assert card.id == BUILTIN[name]


def test_a_tool_round_trip(served):
    name, client = served
    (card,) = client.models.list().data
    first = client.chat.completions.create(model=card.id, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "read_file" and set(args) == {"path"} and args["path"].endswith("notes.txt")
    messages = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "banana bread recipe\n"}]
    answer = client.chat.completions.create(model=card.id, messages=messages, tools=TOOLS, max_tokens=80,
                                            temperature=0).choices[0]
    assert answer.finish_reason == "stop" and answer.message.content and not answer.message.tool_calls


def test_codexs_captured_turns(served):
    """Codex CLI's own requests (captured, tests/server/fixtures/harnesses/) on the Responses route:
    the first asks for a listing and gets an exec_command call; the second, carrying the call and
    the command's output, gets an answer message and no call."""
    name, client = served
    model = client.models.list().data[0].id
    first, second = (json.loads((CAPTURES / f"codex-{n}.json").read_text().replace("<WORKDIR>", "/tmp/work"))["body"]
                     for n in (1, 2))
    reply = create(client, {**first, "model": model, "stream": False})
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and calls[0].name == "exec_command" and "cmd" in json.loads(calls[0].arguments), reply.output
    reply = create(client, {**second, "model": model, "stream": False})
    assert [item.type for item in reply.output if item.type != "reasoning"] == ["message"], reply.output
    assert reply.output_text.strip()


def create(client, body: dict):
    """responses.create with the captured body: the fields this SDK version has no parameter for
    (Codex's client_metadata) travel as extra_body, as they did on the wire."""
    known = inspect.signature(client.responses.create).parameters
    return client.responses.create(**{k: v for k, v in body.items() if k in known},
                                   extra_body={k: v for k, v in body.items() if k not in known})
