"""Anthropic Messages as harnesses send it now (issue 11 item 1), through the official SDKs:
Claude Code's request shape, system messages anywhere, thinking switches, clear_thinking edits,
fields with no meaning here ignored with a DEBUG line, templates that refuse mid-conversation
system messages."""
import contextlib
import copy
import logging

import anthropic
import openai
import pytest
from claude_code_request import AGENTS, BETAS, first_request, sdk_kwargs, tools
from fake_core import FakeCore
from server_helpers import MODEL, ServerThread

CONTEXT = 65536         # room for Claude Code's ~27k-token prompt plus its max_tokens 32000
DEMO_SYSTEM_TURN = "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
TEMPLATES = {   # the demo template, changed to treat a later system message as other templates do
    "refuses": "{%- if message.role == 'system' and not loop.first %}"
               "{{- raise_exception('System message must be at the beginning.') }}"
               "{%- elif message.role == 'user' %}",
    "drops": "{%- if message.role == 'user' %}",
}


def start(tokenizer, **config) -> ServerThread:
    return ServerThread(lambda: FakeCore(tokenizer, max_model_len=CONTEXT, kv_tokens=2 * CONTEXT), **config).start()


@pytest.fixture(scope="module")
def server(demo_tokenizer):
    s = start(demo_tokenizer)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def with_template(tokenizer, kind: str):
    """A copy of the demo tokenizer whose template `refuses` or `drops` later system messages."""
    assert DEMO_SYSTEM_TURN in tokenizer.chat_template
    t = copy.copy(tokenizer)
    t.chat_template, t._compiled = tokenizer.chat_template.replace(DEMO_SYSTEM_TURN, TEMPLATES[kind]), {}
    return t


def echo(client, messages, **kw) -> str:
    """The prompt the server rendered (the scripted core echoes it when the last user turn says ECHO)."""
    kw.setdefault("max_tokens", 3000)
    m = client.beta.messages.create(model=MODEL, messages=messages, betas=BETAS, **kw)
    return m.content[0].text


def test_claude_code_first_request_streamed(client):
    events = list(client.beta.messages.create(**sdk_kwargs(first_request("SAY:Here are the files.", MODEL))))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens > 20000          # ~25k of tools plus the system prompt
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert text == "Here are the files." and events[-2].delta.stop_reason == "end_turn"


def test_claude_code_request_counted_like_it_is_billed(client):
    body = first_request("SAY:ok", MODEL, stream=False)
    m = client.beta.messages.create(**sdk_kwargs(body))
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "ok"
    count = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")}
    counted = client.beta.messages.count_tokens(**sdk_kwargs(count))
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 20000


def conversation(last: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "first question"}]},
            {"role": "system", "content": AGENTS},
            {"role": "assistant", "content": "an answer"},
            {"role": "system", "content": [{"type": "text", "text": "late rule",
                                            "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "content": last}]


def test_system_messages_render_in_place(client):
    prompt = echo(client, conversation("ECHO"), system=[{"type": "text", "text": "top rule"}],
                  tools=tools(notes=1, fields=1)[:2])
    order = ["top rule", "first question", "system\nAvailable agent types", "an answer", "system\nlate rule", "ECHO"]
    at = [prompt.find(s) for s in order]
    assert -1 not in at and at == sorted(at), (at, prompt[-600:])
    assert "<system-reminder>" not in prompt     # the demo template renders them as system turns


def test_leading_system_messages_become_one(client):
    messages = [{"role": "system", "content": "second rule"}, {"role": "user", "content": "ECHO"}]
    prompt = echo(client, messages, system="first rule")
    assert prompt.startswith("system\nfirst rule\n\nsecond rule\nuser\nECHO")


@pytest.mark.parametrize("kind", ["refuses", "drops"])
def test_template_without_mid_system_gets_reminders_in_place(demo_tokenizer, kind):
    server = start(with_template(demo_tokenizer, kind))
    try:
        an = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        prompt = echo(an, conversation("ECHO"))
        order = ["first question", "user\n<system-reminder>\nAvailable agent types", "an answer",
                 "user\n<system-reminder>\nlate rule\n</system-reminder>", "ECHO"]
        at = [prompt.find(s) for s in order]
        assert -1 not in at and at == sorted(at), (at, prompt)
        oa = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        r = oa.chat.completions.create(model=MODEL, max_tokens=2000, messages=[
            {"role": "user", "content": "q"}, {"role": "system", "content": "mid rule"},
            {"role": "user", "content": "ECHO"}])
        assert "user\n<system-reminder>\nmid rule\n</system-reminder>" in r.choices[0].message.content
    finally:
        server.stop()


@pytest.mark.parametrize("kind, thinks", [("adaptive", True), ("enabled", True), ("disabled", False)])
def test_thinking_maps_to_the_template_switch(client, kind, thinks):
    thinking = {"type": kind, "budget_tokens": 1024} if kind == "enabled" else {"type": kind}
    prompt = echo(client, [{"role": "user", "content": "ECHO"}], thinking=thinking)
    assert prompt.endswith("<think>\n\n</think>\n\n") != thinks


def tool_loop() -> list[dict]:
    """Two assistant turns with thinking inside one tool loop: the template shows both."""
    def turn(thought, n):
        return {"role": "assistant", "content": [{"type": "thinking", "thinking": thought, "signature": "sig"},
                                                 {"type": "tool_use", "id": f"t{n}", "name": "Read", "input": {}}]}
    return [{"role": "user", "content": "read both files"}, turn("THOUGHT-ONE", 1),
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "first"}]},
            turn("THOUGHT-TWO", 2),
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "ECHO"}]}]


@pytest.mark.parametrize("keep, kept", [(None, {"ONE", "TWO"}), ("all", {"ONE", "TWO"}),
                                        ({"type": "thinking_turns", "value": 1}, {"TWO"}),
                                        ("default", {"TWO"}), ({"type": "thinking_turns", "value": 0}, set())])
def test_clear_thinking_drops_older_thinking(client, keep, kept):
    kw = {}
    if keep is not None:
        edit = {"type": "clear_thinking_20251015"} if keep == "default" else {"type": "clear_thinking_20251015",
                                                                             "keep": keep}
        kw["context_management"] = {"edits": [edit]}
    prompt = echo(client, tool_loop(), tools=tools(notes=1, fields=1)[:2], **kw)
    assert {w for w in ("ONE", "TWO") if f"THOUGHT-{w}" in prompt} == kept


@contextlib.contextmanager
def debug_lines():
    """DEBUG records of the freetoken logger (whatever handlers the CLI tests left on it)."""
    lines, log = [], logging.getLogger("freetoken")

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    handler, level = Keep(logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def test_fields_without_meaning_here_are_ignored_with_a_debug_line(client):
    with debug_lines() as lines:
        m = client.beta.messages.create(
            model=MODEL, max_tokens=50, betas=BETAS, messages=[{"role": "user", "content": "SAY:fine"}],
            metadata={"user_id": "u"}, output_config={"effort": "max"},
            system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            context_management={"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses",
                                                                                      "value": 3}}]},
            extra_body={"future_knob": {"level": 3}, "speed": "fast"})
    assert m.content[0].text == "fine"
    for needle in ("metadata ignored", "output_config.effort 'max' ignored", "future_knob ignored",
                   "speed ignored", "cache_control ignored", "'clear_tool_uses_20250919' not applied"):
        assert any(needle in line for line in lines), (needle, lines)
