"""Neutral generation events -> Responses output items, and the typed stream events that build them.

One code path for both modes: the JSON answer is the items an `Output` ends with, the stream is
the events it returned on the way (each a ``(type, payload)`` pair; the route numbers them).
A new item opens whenever the kind of output changes: reasoning, message text, a function call.
"""
from __future__ import annotations

import copy

from freetoken.server.generation import Logprobs, Reasoning, Text, ToolCall, Usage
from freetoken.server.logprobs import chat_entries
from freetoken.server.state import new_id

DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}


def _new_item(kind: str) -> tuple[dict, dict]:
    """An empty in-progress item of `kind` and its one content part."""
    if kind == "message":
        item = {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
        return item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    item = {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [], "content": [],
            "encrypted_content": None}
    return item, {"type": "reasoning_text", "text": ""}


class Output:
    """feed(event) -> stream events; finish(done) closes the open item. `items` is the output."""

    def __init__(self, token_text=None):
        self.items: list[dict] = []
        self.kind: str | None = None          # "message" | "reasoning" while one is open
        self.token_text = token_text          # logprobs.TokenText when the request asked for logprobs
        self.pending: list = []               # TokenLogprobs of tokens whose text has not come yet

    def feed(self, ev) -> list[tuple[str, dict]]:
        if isinstance(ev, Logprobs):
            self.pending.extend(ev.entries)
            return []
        if isinstance(ev, Text):
            return self._text("message", ev.text)
        self.pending = []                     # reasoning and calls carry no logprobs in this API
        if isinstance(ev, Reasoning):
            return self._text("reasoning", ev.text)
        if isinstance(ev, ToolCall):
            return self.close() + self._call(ev)
        return []

    def finish(self, finish_reason: str) -> list[tuple[str, dict]]:
        return self.close("incomplete" if finish_reason == "length" else "completed")

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        events = [] if self.kind == kind else self.close() + self._open(kind)
        part = self.items[-1]["content"][0]
        part["text"] += text
        extra = {"logprobs": self._take_logprobs(part)} if kind == "message" else {}
        return events + [(DELTA[kind], {**self._where(), "delta": text, **extra})]

    def _take_logprobs(self, part: dict) -> list[dict]:
        """The pending tokens' entries, added to the message part too."""
        entries = chat_entries(self.token_text, self.pending) if self.token_text and self.pending else []
        self.pending = []
        part["logprobs"].extend(entries)
        return entries

    def _open(self, kind: str) -> list[tuple[str, dict]]:
        item, part = _new_item(kind)
        self.items.append(item)
        self.kind = kind
        added = ("response.output_item.added", {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)})
        item["content"].append(part)
        return [added, ("response.content_part.added", {**self._where(), "part": dict(part)})]

    def close(self, status: str = "completed") -> list[tuple[str, dict]]:
        if self.kind is None:
            return []
        item, kind = self.items[-1], self.kind
        self.kind = None
        item["status"] = status
        part = item["content"][0]
        if kind == "message":
            self._take_logprobs(part)          # tokens after the last text (an end token)
        extra = {"logprobs": part["logprobs"]} if kind == "message" else {}
        return [(DONE[kind], {**self._where(), "text": part["text"], **extra}),
                ("response.content_part.done", {**self._where(), "part": copy.deepcopy(part)}),
                ("response.output_item.done", {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)})]

    def _call(self, ev: ToolCall) -> list[tuple[str, dict]]:
        item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": new_id("call_"),
                "name": ev.name, "arguments": ""}
        self.items.append(item)
        index = len(self.items) - 1
        added = ("response.output_item.added", {"output_index": index, "item": dict(item)})
        where = {"item_id": item["id"], "output_index": index}
        item.update(arguments=ev.arguments, status="completed")
        # the parser releases a call whole, once its closing tag is generated: one delta carries it all
        return [added, ("response.function_call_arguments.delta", {**where, "delta": ev.arguments}),
                ("response.function_call_arguments.done", {**where, "name": ev.name, "arguments": ev.arguments}),
                ("response.output_item.done", {"output_index": index, "item": dict(item)})]


def usage(u: Usage, reasoning_tokens: int) -> dict:
    """input_tokens counts the whole prompt; cached_tokens is the part reused from the prefix cache."""
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, u.completion_tokens)},
            "total_tokens": u.prompt_tokens + u.completion_tokens}
