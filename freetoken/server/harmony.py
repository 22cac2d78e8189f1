"""gpt-oss's harmony output format, parsed while it streams: each message's channel decides where
its text goes.

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{"x": 1}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

A message is a header (role, ``<|channel|>`` name, ``to=`` recipient, ``<|constrain|>`` type, in
any order) then ``<|message|>`` and its body up to ``<|end|>``, ``<|call|>``, ``<|return|>`` or the
end of the output. The generation prompt ends in ``<|start|>assistant``, so the output starts in a
header. analysis -> reasoning; a message to ``functions.NAME`` -> a tool call (its body the JSON
arguments), emitted when the message ends; final, and commentary without a recipient (a preamble
the user sees) -> content; a message to a built-in tool (browser, python) is dropped with a WARN
line (this server runs none). Output with no markup at all is content. A call whose body is no JSON
object is dropped with a WARN line, as toolcalls.py drops Qwen's: markup never reaches the client.

Our own parser, not openai-harmony: that library (0.0.8) works on token ids of its o200k vocabulary,
which it downloads on first use (offline: "error downloading or loading vocab file"), while the
text markers above are what every gpt-oss tokenizer detokenizes to.
"""
from __future__ import annotations

import json
import re

from freetoken.log import logger
from freetoken.server.reasoning import partial_tag
from freetoken.server.toolcalls import ParsedCall

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN) + ENDS
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    """feed(text) -> [("reasoning" | "content", text) or ("call", ParsedCall)]; finish() flushes."""

    def __init__(self):
        self.buf = ""
        self.header = ""              # the current message's header text so far
        self.kind = None              # in a body: "reasoning" | "content" | "call"; None: in a header
        self.call_name, self.call_body = "", ""
        self.marked = False           # some marker was seen: text before any is content otherwise

    def feed(self, text: str) -> list:
        self.buf += text
        out: list = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list:
        out: list = []
        while self._step(out):
            pass
        self._take(self.buf, out)
        self.buf = ""
        self._end_message(out)
        return out

    def _step(self, out: list) -> bool:
        """Consume up to the next whole marker; False when none is in the buffer."""
        at, marker = _next_marker(self.buf)
        if marker is None:
            hold = max(partial_tag(self.buf, m) for m in MARKERS)
            self._take(self.buf[:len(self.buf) - hold], out)
            self.buf = self.buf[len(self.buf) - hold:]
            return False
        self._take(self.buf[:at], out)
        self.buf = self.buf[at + len(marker):]
        self.marked = True
        if marker == MESSAGE:
            self._open_body()
        elif marker in ENDS or marker == START:
            self._end_message(out)
        else:                          # <|channel|>, <|constrain|>: part of the header
            self.header += " " + marker
        return True

    def _take(self, text: str, out: list) -> None:
        """Text of the current message: its header, or its body's share."""
        if not text:
            return
        if self.kind is None and self.marked:
            self.header += text
        elif self.kind == "call":
            self.call_body += text
        elif self.kind != "dropped":
            _emit(out, self.kind or "content", text)

    def _open_body(self) -> None:
        recipient = _RECIPIENT.search(self.header)
        channel = (self.header.split(CHANNEL)[-1].split() or [""])[0] if CHANNEL in self.header else ""
        if recipient and recipient.group(1).startswith("functions."):
            self.kind, self.call_name, self.call_body = "call", recipient.group(1)[len("functions."):], ""
        elif recipient:                # a built-in tool (browser, python): this server runs none
            logger.warning("a harmony message to %s (a built-in tool, not served) was dropped", recipient.group(1))
            self.kind = "dropped"
        else:
            self.kind = "reasoning" if channel == "analysis" else "content"

    def _end_message(self, out: list) -> None:
        if self.kind == "call":
            call = _parsed_call(self.call_name, self.call_body)
            if call is not None:
                out.append(("call", call))
        self.kind, self.header = None, ""


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as gpt-oss's own template reads them: an assistant turn's reasoning in
    `thinking` (what the API calls reasoning_content), rendered before its tool call."""
    return [{**m, "thinking": m["reasoning_content"]} if m.get("reasoning_content") and "thinking" not in m else m
            for m in messages]


def _next_marker(buf: str) -> tuple[int, str | None]:
    found = [(at, m) for m in MARKERS if (at := buf.find(m)) >= 0]
    return min(found) if found else (-1, None)


def _emit(out: list, kind: str, text: str) -> None:
    if out and out[-1][0] == kind and isinstance(out[-1][1], str):
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))


def _parsed_call(name: str, body: str) -> ParsedCall | None:
    try:
        args = json.loads(body) if body.strip() else {}
    except ValueError:
        args = None
    if not isinstance(args, dict) or not name:
        logger.warning("a harmony tool call that does not parse was dropped: %s %s", name, repr(body.strip()[:120]))
        return None
    # the arguments as the model wrote them (the grammar's compact JSON): a harness sends them back in
    # the next request, and the template renders that text, so the model reads its own form again
    return ParsedCall(name, body.strip() or "{}")
