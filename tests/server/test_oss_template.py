"""The built-in gpt-oss model's compact harmony template (tools/harmony_template.jinja) on Codex
CLI's own requests (captured traffic, through the Responses route's conversion): the first request
(12 KB of instructions, 7 tools) and the second (the call and the command's output) render to a
few hundred tokens in harmony's form, keeping the working directory, one line per tool, the
request, the call on the commentary channel and the result as a message from functions.NAME."""
import json
from pathlib import Path

from freetoken.models.demo import BUILTIN, DATA
from freetoken.server.harmony import template_messages
from freetoken.server.protocol import Body
from freetoken.server.responses_items import function_tools, input_messages, with_instructions
from freetoken.server.system_messages import place_system
from freetoken.tokenizer import Tokenizer

CAPTURES = Path(__file__).resolve().parent / "fixtures" / "harnesses"


def rendered(tok, capture: str) -> str:
    raw = json.loads((CAPTURES / f"{capture}.json").read_text().replace("<WORKDIR>", "/tmp/work"))["body"]
    body = Body(raw, "body")
    tools, _ = function_tools(body, "resp_test")
    messages = with_instructions(raw.get("instructions"), input_messages(body))
    return tok.apply_chat_template(place_system(tok, template_messages(messages)), tools=tools,
                                   add_generation_prompt=True)


def tokenizer() -> Tokenizer:
    tok = Tokenizer.from_dir(DATA / BUILTIN["demo-oss"])
    assert tok.speaks_harmony
    return tok


def test_codexs_first_request_renders_compactly_in_harmony():
    tok = tokenizer()
    text = rendered(tok, "codex-1")
    assert len(tok.encode(text)) < 600
    assert text.startswith("<|start|>system<|message|>Reasoning: ")
    assert "<|end|><|start|>developer<|message|>You are a coding agent running in the Codex CLI" in text
    assert "\n- exec_command(cmd, " in text and text.count("\n- ") >= 5
    assert "<environment_context>" not in text
    assert text.endswith("<|start|>user<|message|>cwd: /tmp/work<|end|><|start|>user<|message|>list the files in "
                         "this directory<|end|><|start|>assistant")


def test_codexs_second_request_renders_the_call_and_the_named_result():
    tok = tokenizer()
    text = rendered(tok, "codex-2")
    assert len(tok.encode(text)) < 800
    call = text.index("<|start|>assistant<|channel|>commentary to=functions.exec_command <|constrain|>json<|message|>{")
    result = text.index("<|start|>functions.exec_command to=assistant<|channel|>commentary<|message|>")
    assert call < result and text[call:result].endswith("<|call|>")
    assert "river" in text[result:] and text.endswith("<|end|><|start|>assistant")
