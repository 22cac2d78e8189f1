"""Anthropic Messages request -> the neutral conversation of server/messages.py.

``system`` (a string or text blocks) opens the conversation; ``messages`` may hold system
messages too, wherever the harness put them (server/system_messages.py places them for the
template). ``context_management`` edits of type ``clear_thinking_20251015`` drop the thinking of
older assistant turns before rendering, as Anthropic's service does; other edits are logged and
not applied.
"""
from __future__ import annotations

from freetoken.log import logger
from freetoken.server.errors import APIError
from freetoken.server.messages import (MAX_MESSAGES, Conversation, check_tool_results, _forced, _function, _required, _text_parts,
                                       _unsupported, parse_tools)
from freetoken.server.protocol import Body

CLEAR_THINKING = "clear_thinking_20251015"


def anthropic_conversation(body: Body) -> Conversation:
    out = []
    if body.has("system"):
        out.append({"role": "system", "content": _text_parts(body.data["system"], "system")})
    for i, m in enumerate(body.list("messages", nonempty=True, max_items=MAX_MESSAGES)):
        out.extend(_message(Body(m, f"messages[{i}]")))
    check_tool_results(out, "tool_use_id")
    keep = _thinking_turns_kept(body)
    if keep is not None:
        _clear_thinking(out, keep)
    tools = _anthropic_tools(body)
    return Conversation(out, tools, _anthropic_choice(body, tools))


def _message(mb: Body) -> list[dict]:
    mb.only({"role", "content"})
    role = mb.str("role", choices=("user", "assistant", "system"))
    content = _required(mb, "content")
    if role == "system":
        return [{"role": "system", "content": _text_parts(content, mb.param("content"))}]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise APIError(400, f"{mb.param('content')} must be a string or an array of blocks",
                       param=mb.param("content"))
    blocks = [Body(b, mb.param(f"content[{j}]")) for j, b in enumerate(blocks)]
    return _assistant(blocks) if role == "assistant" else _user(blocks)


def _user(blocks: list[Body]) -> list[dict]:
    out: list[dict] = []
    for b in blocks:
        kind = b.str("type")
        if kind == "tool_result":
            content = b.data.get("content") or ""
            text = _text_parts(content, b.param("content"))
            if b.bool("is_error", False):
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": b.str("tool_use_id"), "content": text})
        elif kind == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += b.str("text")
            else:
                out.append({"role": "user", "content": b.str("text")})
        else:
            raise _unsupported(b.param("type"), f"a user content block of type {kind!r}")
    return out


def _assistant(blocks: list[Body]) -> list[dict]:
    msg: dict = {"role": "assistant", "content": ""}
    for b in blocks:
        kind = b.str("type")
        if kind == "text":
            msg["content"] += b.str("text")
        elif kind == "thinking":
            msg["reasoning_content"] = msg.get("reasoning_content", "") + b.str("thinking", "")
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            call = {"id": b.str("id", ""), "type": "function",
                    "function": {"name": b.str("name", nonempty=True),
                                 "arguments": b.obj("input").data if b.has("input") else {}}}
            msg.setdefault("tool_calls", []).append(call)
        else:
            raise _unsupported(b.param("type"), f"an assistant content block of type {kind!r}")
    return [msg]


def _thinking_turns_kept(body: Body) -> int | None:
    """How many recent assistant turns keep their thinking (None: all), from context_management."""
    if not body.has("context_management"):
        return None
    keep = None
    for i, e in enumerate(body.obj("context_management").list("edits", [], max_items=16)):
        edit = Body(e, f"context_management.edits[{i}]")
        kind = edit.str("type")
        if kind != CLEAR_THINKING:
            logger.debug("context_management edit %r not applied: only %s is", kind, CLEAR_THINKING)
            continue
        value = edit.data.get("keep", {"type": "thinking_turns", "value": 1})   # Anthropic's default
        if value == "all":
            continue
        turns = Body(value, edit.param("keep"))
        turns.str("type", choices=("thinking_turns",))
        keep = turns.int("value", lo=0)
    return keep


def _clear_thinking(messages: list[dict], keep: int) -> None:
    """Drop the thinking of every assistant turn but the last `keep` ones."""
    turns = [m for m in messages if m["role"] == "assistant"]
    for m in turns[:max(len(turns) - keep, 0)]:
        m.pop("reasoning_content", None)


def _anthropic_tools(body: Body) -> list[dict] | None:
    return parse_tools(body, "custom", " (server tools)",
                       lambda tb: _function(tb, tb.data.get("input_schema"), "input_schema"))


def _anthropic_choice(body: Body, tools) -> str:
    if not body.has("tool_choice"):
        return "auto"
    c = body.obj("tool_choice")
    kind = c.str("type", choices=("auto", "any", "tool", "none"))
    if kind == "tool":
        return _forced(c.str("name", nonempty=True), tools, "tool_choice.name")
    return {"auto": "auto", "any": "required", "none": "none"}[kind]
