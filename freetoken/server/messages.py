"""OpenAI conversations -> one neutral form the chat template renders (Anthropic's:
server/anthropic_messages.py; system messages are placed for the template by server/system_messages.py).

Neutral messages are dicts with role system|user|assistant|tool, string content, and for the
assistant optional ``tool_calls`` ([{id, type: function, function: {name, arguments: dict|str}}])
and ``reasoning_content``; tool results carry ``tool_call_id``. Tools are OpenAI function tools.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from freetoken.server.errors import APIError
from freetoken.server.protocol import Body
from freetoken.server.tool_schemas import checked_schema

MAX_MESSAGES = 100_000
MAX_TOOLS = 1024
TEXT_FIELDS = {"text": "text"}
OPENAI_MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content",
                         "reasoning", "refusal", "annotations", "audio", "function_call"}


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None        # every tool the request declares (the parser needs all schemas)
    choice: str = "auto"            # auto | none | required | a tool name (forced)

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools shown to the model: none for "none", only the forced one for a name."""
        if not self.tools or self.choice == "none":
            return None
        if self.choice in ("auto", "required"):
            return self.tools
        return [t for t in self.tools if t["function"]["name"] == self.choice]


def _unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what} is not supported by this server", param=param)


def _text_parts(value, param: str, fields: dict = TEXT_FIELDS) -> str:
    """Content as a string, or a list of content parts joined; other part types are refused.

    `fields` maps each accepted part type to the key holding its text (None: accepted, adds
    nothing); the default accepts only {"type": "text"} parts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise APIError(400, f"{param} must be a string or an array of content parts", param=param)
    texts = []
    for i, part in enumerate(value):
        p = Body(part, f"{param}[{i}]")
        kind = p.str("type")
        if kind not in fields:
            raise _unsupported(p.param("type"), f"content of type {kind!r}")
        if fields[kind] is not None:
            texts.append(p.str(fields[kind], ""))
    return "".join(texts)


def _arguments(value):
    """Tool-call arguments for the template: a decoded JSON object where possible."""
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        return decoded if isinstance(decoded, dict) else value
    return value


# --- OpenAI ---------------------------------------------------------------------------------

def openai_conversation(body: Body) -> Conversation:
    msgs = body.list("messages", nonempty=True, max_items=MAX_MESSAGES)
    out = [_openai_message(Body(m, f"messages[{i}]")) for i, m in enumerate(msgs)]
    check_tool_results(out, "tool_call_id")
    tools = _openai_tools(body)
    return Conversation(out, tools, _openai_choice(body, tools))


def check_tool_results(messages: list[dict], id_field: str) -> None:
    """Every tool result answers a call an earlier assistant message made, by its id (what the
    hosted APIs refuse too: a result the model never asked for would be rendered as its answer)."""
    made: set[str] = set()
    for m in messages:
        if m["role"] == "assistant":
            made.update(c["id"] for c in m.get("tool_calls", ()) if c["id"])
        elif m["role"] == "tool" and m["tool_call_id"] not in made:
            said = repr(m["tool_call_id"]) if m["tool_call_id"] else "no id"
            raise APIError(400, f"a tool result carries {said} in {id_field}: it must be the id of a tool "
                                "call an earlier assistant message made", param="messages")


def _openai_message(m: Body) -> dict:
    m.only(OPENAI_MESSAGE_FIELDS)
    role = m.str("role", choices=("system", "developer", "user", "assistant", "tool"))
    m.default_only("function_call", (), "(legacy function calling) is not supported; use tool_calls")
    m.str("name", None)
    if role == "assistant":
        msg = {"role": "assistant", "content": _text_parts(m.data.get("content") or "", m.param("content"),
                                                            {"text": "text", "refusal": None})}
        reasoning = m.str("reasoning_content", None) or m.str("reasoning", None)
        if reasoning:
            msg["reasoning_content"] = reasoning
        calls = m.list("tool_calls", None, max_items=MAX_TOOLS)
        if calls:
            msg["tool_calls"] = [_openai_call(Body(c, m.param(f"tool_calls[{i}]"))) for i, c in enumerate(calls)]
        return msg
    content = _text_parts(_required(m, "content"), m.param("content"))
    if role == "tool":
        return {"role": "tool", "tool_call_id": m.str("tool_call_id", ""), "content": content}
    return {"role": "system" if role == "developer" else role, "content": content}


def _required(b: Body, key: str):
    if b.data.get(key) is None:
        raise APIError(400, f"{b.param(key)} is required", param=b.param(key))
    return b.data[key]


def _openai_call(c: Body) -> dict:
    c.str("type", "function", choices=("function",))
    f = c.obj("function")
    name = f.str("name", nonempty=True, max_len=256)
    return {"id": c.str("id", ""), "type": "function",
            "function": {"name": name, "arguments": _arguments(f.data.get("arguments") or "{}")}}


def parse_tools(body: Body, kind: str, refused: str, function_of) -> list[dict] | None:
    """`tools` as chat-template function tools; every entry must have type `kind` (the other
    types are refused as `refused`); function_of(entry Body) -> the function dict."""
    tools = body.list("tools", None, max_items=MAX_TOOLS)
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        tb = Body(t, f"tools[{i}]")
        got = tb.str("type", kind)
        if got != kind:
            raise _unsupported(tb.param("type"), f"tool type {got!r}{refused}")
        out.append({"type": "function", "function": function_of(tb)})
    return out


def _openai_function(tb: Body) -> dict:
    f = tb.obj("function")
    return _function(f, f.data.get("parameters"), "parameters")


def _openai_tools(body: Body) -> list[dict] | None:
    return parse_tools(body, "function", "", _openai_function)


def _function(f: Body, schema, schema_key: str) -> dict:
    fn = {"name": f.str("name", nonempty=True, max_len=256)}
    if f.has("description"):
        fn["description"] = f.str("description")
    if schema is not None:
        fn["parameters"] = checked_schema(schema, f.param(schema_key))
    return fn


def _openai_choice(body: Body, tools) -> str:
    v = body.data.get("tool_choice")
    if v is None:
        return "auto"
    if isinstance(v, str):
        return body.str("tool_choice", choices=("none", "auto", "required"))
    name = body.obj("tool_choice").obj("function").str("name", nonempty=True)
    return _forced(name, tools, "tool_choice.function.name")


def _forced(name: str, tools, param: str) -> str:
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"{param}: no tool named {name!r} was given", param=param)
    return name
