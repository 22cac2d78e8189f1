"""Each built-in model as a user runs it, `python -m freetoken serve --model NAME`, driven by the
official openai SDK through a tool round trip: given a tool list and a request that needs a tool,
the reply is a call of a listed tool with arguments that fit its schema; given the tool's result,
the model answers in text. The statistics over held-out requests are in each model's README
(tools/eval_demo.py); this is the path they are measured on, end to end."""
import json

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
