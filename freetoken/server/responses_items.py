"""Responses API input -> the neutral conversation of server/messages.py, its tools and tool_choice.

Input items: ``message`` (roles user, system, developer, assistant; text parts), ``reasoning``,
``function_call`` and ``function_call_output``. A run of reasoning / assistant message /
function_call items is one assistant turn, the way chat templates render it. Output items are
valid input items, so a stored response's output goes through the same conversion.
"""
from __future__ import annotations

from collections import OrderedDict

from freetoken.log import logger
from freetoken.server.errors import APIError
from freetoken.server.messages import MAX_MESSAGES, MAX_TOOLS, _arguments, _required, _text_parts, _unsupported
from freetoken.server.protocol import Body
from freetoken.server.tool_schemas import checked_schema

ROLES = ("user", "system", "developer", "assistant")
TEXT_FIELDS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}   # part type -> its text
STORE_CAPACITY = 256             # responses kept for previous_response_id (each holds its whole conversation)
_warned_tool_types: set[str] = set()


class _Turns:
    """Neutral messages built item by item; `open` is the assistant turn still being assembled."""

    def __init__(self):
        self.messages: list[dict] = []
        self.open: dict | None = None

    def assistant(self, fresh: bool = False) -> dict:
        if self.open is None or fresh:
            self.open = {"role": "assistant", "content": ""}
            self.messages.append(self.open)
        return self.open

    def other(self, message: dict) -> None:
        self.open = None
        self.messages.append(message)

    def add(self, item: Body) -> None:
        kind = item.str("type", "message")          # an easy input message may leave the type out
        handler = _HANDLERS.get(kind)
        if handler is None:
            why = "send the item itself" if kind == "item_reference" else "this server runs function tools only"
            raise _unsupported(item.param("type"), f"input item type {kind!r} ({why})")
        handler(self, item)


def _message(turns: _Turns, item: Body) -> None:
    role = item.str("role", choices=ROLES)
    text = _text_parts(_required(item, "content"), item.param("content"), TEXT_FIELDS)
    if role == "assistant":
        # text after a call starts a new turn: the template puts content before the calls
        turn = turns.assistant(fresh=turns.open is not None and "tool_calls" in turns.open)
        turn["content"] += text
    else:
        turns.other({"role": "user" if role == "user" else "system", "content": text})


def _reasoning(turns: _Turns, item: Body) -> None:
    parts = item.list("content", None) or []
    key = "content"
    if not parts:                                  # only a summary: better than nothing
        parts, key = item.list("summary", None) or [], "summary"
    texts = [Body(p, item.param(f"{key}[{i}]")).str("text", "") for i, p in enumerate(parts)]
    open_ = turns.open
    turn = turns.assistant(fresh=open_ is not None and bool(open_["content"] or "tool_calls" in open_))
    text = "\n\n".join(t for t in texts if t)
    if text:
        turn["reasoning_content"] = (turn.get("reasoning_content", "") + "\n\n" + text).lstrip("\n")


def _function_call(turns: _Turns, item: Body) -> None:
    call = {"id": item.str("call_id", nonempty=True), "type": "function",
            "function": {"name": item.str("name", nonempty=True, max_len=256),
                         "arguments": _arguments(item.str("arguments", "{}") or "{}")}}
    turns.assistant().setdefault("tool_calls", []).append(call)


def _function_call_output(turns: _Turns, item: Body) -> None:
    output = _required(item, "output")
    turns.other({"role": "tool", "tool_call_id": item.str("call_id", nonempty=True),
                 "content": _text_parts(output, item.param("output"), TEXT_FIELDS)})


_HANDLERS = {"message": _message, "reasoning": _reasoning, "function_call": _function_call,
             "function_call_output": _function_call_output}


def items_messages(items: list, param: str = "input") -> list[dict]:
    turns = _Turns()
    for i, item in enumerate(items):
        turns.add(Body(item, f"{param}[{i}]"))
    return turns.messages


def input_messages(body: Body) -> list[dict]:
    """`input`: a string (one user message) or an array of items; required (also with
    previous_response_id: a continuation says what comes next)."""
    value = body.data.get("input")
    if value is None:
        raise APIError(400, "input is required: a string or an array of input items", param="input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}] if value else []
    return items_messages(body.list("input", [], max_items=MAX_MESSAGES))


def with_instructions(instructions: str | None, messages: list[dict]) -> list[dict]:
    """`instructions` and the leading system/developer messages as one first system message
    (chat templates accept a system message only there)."""
    lead = [instructions] if instructions else []
    at = 0
    while at < len(messages) and messages[at]["role"] == "system":
        lead.append(messages[at]["content"])
        at += 1
    return ([{"role": "system", "content": "\n\n".join(lead)}] if lead else []) + messages[at:]


def function_tools(body: Body, rid: str) -> tuple[list[dict] | None, list[dict]]:
    """(tools in the chat shape for the template, the flat function tools to echo back).

    Agents such as Codex send hosted and freeform tools (web_search, custom, namespace, ...)
    next to their function tools: those are not offered to the model, and the log says so.
    """
    chat, echo, skipped = [], [], []
    for i, t in enumerate(body.list("tools", None, max_items=MAX_TOOLS) or ()):
        tb = Body(t, f"tools[{i}]")
        kind = tb.str("type")
        if kind != "function":
            skipped.append(kind)
            continue
        fn = {"name": tb.str("name", nonempty=True, max_len=256)}
        if tb.has("description"):
            fn["description"] = tb.str("description")
        if tb.has("parameters"):
            fn["parameters"] = checked_schema(tb.data["parameters"], tb.param("parameters"))
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "description": None, "parameters": None, **fn,
                     "strict": tb.bool("strict", None)})
    _warn_skipped(skipped, rid)
    return chat or None, echo


def _warn_skipped(kinds: list[str], rid: str) -> None:
    new = sorted(set(kinds) - _warned_tool_types)
    if new:
        _warned_tool_types.update(new)
        logger.warning("%s: tools of type %s are not offered to the model (this server runs function tools "
                       "only; logged once per type)", rid, ", ".join(new))


def tool_choice(body: Body, tools: list[dict] | None) -> str:
    """auto | none | required | the name of the one function the model must call."""
    v = body.data.get("tool_choice")
    if v is None:
        return "auto"
    if isinstance(v, str):
        return body.str("tool_choice", choices=("none", "auto", "required"))
    c = body.obj("tool_choice")
    kind = c.str("type")
    if kind != "function":
        raise _unsupported(c.param("type"), f"tool_choice of type {kind!r}")
    name = c.str("name", nonempty=True)
    if name not in {t["function"]["name"] for t in tools or ()}:
        raise APIError(400, f"tool_choice.name: no function tool named {name!r} was given", param="tool_choice.name")
    return name


class ResponseStore:
    """The conversations of the last STORE_CAPACITY stored responses, for previous_response_id.

    In memory and least-recently-used: a server restart or enough newer responses forget one.
    """

    def __init__(self, capacity: int = STORE_CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict]] = OrderedDict()

    def get(self, rid: str) -> list[dict] | None:
        messages = self._items.get(rid)
        if messages is not None:
            self._items.move_to_end(rid)
        return messages

    def put(self, rid: str, messages: list[dict]) -> None:
        self._items[rid] = messages
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
