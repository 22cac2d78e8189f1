"""Tool calls in model output, Qwen formats: ``<tool_call>`` around JSON or around XML.

    <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>
    <tool_call><function=f><parameter=x>1</parameter></function></tool_call>

Streaming-safe: content is released as it comes except a suffix that could still become the
opening tag; a call is emitted when its closing tag arrives (or at the end, if it parses). A
block that does not parse is dropped with a WARN line: markup never reaches the client as text.
XML parameter values are typed by the tool's JSON schema (strings stay strings).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from freetoken.log import logger
from freetoken.server.reasoning import partial_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str          # a JSON object, as text


def parse_calls(body: str, schemas: dict[str, dict] | None = None) -> list[ParsedCall] | None:
    """The calls inside one <tool_call> block, or None when it is not a valid call."""
    body = body.strip()
    if body.startswith("<function="):
        return _parse_xml(body, schemas or {})
    return _parse_json(body)


def _parse_json(body: str) -> list[ParsedCall] | None:
    calls, at, decoder = [], 0, json.JSONDecoder()
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False)))
        at = end
        while at < len(body) and body[at] in " \t\r\n,":
            at += 1
    return calls or None


def _parse_xml(body: str, schemas: dict[str, dict]) -> list[ParsedCall] | None:
    calls = []
    for match in _FUNCTION.finditer(body):
        name = match.group(1).strip()
        props = (schemas.get(name) or {}).get("properties") or {}
        args = {}
        for p in _PARAMETER.finditer(match.group(2)):
            key = p.group(1).strip()
            args[key] = _typed(_strip_newline(p.group(2)), props.get(key) or {})
        calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
    return calls or None


def _strip_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: dict):
    """A parameter's text as its schema type says; anything that does not parse stays a string."""
    kinds = schema.get("type", "string")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if "string" in kinds or not kinds:
        return value
    if "boolean" in kinds and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value


class ToolCallParser:
    """feed(text) -> items (str content or ParsedCall); finish() flushes what is held back.

    Whitespace that only separates content from calls is dropped; content without any call
    comes out unchanged.
    """

    def __init__(self, tools: list[dict] | None):
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}
        self.buf = ""
        self.inside = False
        self.blank = ""          # trailing whitespace held: dropped if a call follows
        self.calls = 0
        self.fresh = False       # right after a call: leading whitespace is dropped

    def feed(self, text: str) -> list:
        self.buf += text
        out: list = []
        while True:
            if self.inside:
                at = self.buf.find(CLOSE)
                if at < 0:
                    return out
                self._close(self.buf[:at], out)
                self.buf = self.buf[at + len(CLOSE):]
                continue
            at = self.buf.find(OPEN)
            if at < 0:
                hold = partial_tag(self.buf, OPEN)
                self._text(self.buf[:len(self.buf) - hold], out)
                self.buf = self.buf[len(self.buf) - hold:]
                return out
            self._text(self.buf[:at], out)
            self.inside, self.buf = True, self.buf[at + len(OPEN):]

    def finish(self) -> list:
        out: list = []
        if self.inside:
            self._close(self.buf, out, truncated=True)
        else:
            self._text(self.buf, out)
        self.buf = ""
        if not self.calls and self.blank:
            out.append(self.blank)
        self.blank = ""
        return out

    def _close(self, body: str, out: list, truncated: bool = False) -> None:
        self.inside = False
        calls = parse_calls(body, self.schemas)
        if calls is None:       # no grammar held it, or the budget cut it: never markup as text
            logger.warning("a tool call that does not parse was dropped%s: %s",
                           " (the output ended inside it)" if truncated else "", repr(body.strip()[:120]))
            self.fresh = True
            return
        self.blank, self.fresh = "", True
        self.calls += len(calls)
        out.extend(calls)

    def _text(self, text: str, out: list) -> None:
        text = self.blank + (text.lstrip() if self.fresh else text)
        body = text.rstrip()
        self.blank = text[len(body):]
        if body:
            self.fresh = False
            out.append(body)
