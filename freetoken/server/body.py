"""Request bodies as JSON objects, read and parsed without stalling the event loop.

Small bodies parse with the C decoder at once. Larger ones parse in a worker thread with a decoder
that never holds the GIL for long: the structure is walked in Python and strings are decoded in
slices, so /health keeps answering while a 30 MB body is parsed. Text that is not valid Unicode
(bad UTF-8, a lone UTF-16 surrogate such as ``"\\ud800"``) is a 400, never a 500 later on.
"""
from __future__ import annotations

import codecs
import json
import json.decoder
import json.scanner
import re

import anyio
from starlette.requests import ClientDisconnect, Request

from freetoken.server.errors import APIError

SMALL = 256 << 10       # bytes: the C decoder holds the GIL for at most ~10 ms on a body this size
PIECE = 1 << 20         # bytes decoded per call while checking the encoding
# One slice of a string's JSON text: up to 1024 runs of plain characters or escapes (<= ~1 MB). A
# surrogate pair's two escapes are one element, so no slice boundary falls between them.
_SLICE = re.compile(r'(?:[^"\\]{1,1024}|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}'
                    r'|\\u[0-9a-fA-F]{4}|\\.){0,1024}', re.S)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_WS = json.decoder.WHITESPACE


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 415 when it is declared as another media type (no
    content-type is taken as JSON), 413 over `limit` bytes, 400 when it is not a JSON object."""
    _check_media_type(request.headers.get("content-type"))
    raw = await _read(request, limit)
    if len(raw) <= SMALL:
        data = parse(raw)
    else:
        data = await anyio.to_thread.run_sync(parse, raw)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def _check_media_type(declared: str | None) -> None:
    media = (declared or "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"the request body must be JSON (content-type: application/json), not {media!r}"
                       + ("; curl sends that for -d unless given -H 'content-type: application/json'"
                          if media == "application/x-www-form-urlencoded" else ""))


async def _read(request: Request, limit: int) -> bytes:
    too_large = APIError(413, f"the request body is larger than {limit} bytes",
                         headers={"Connection": "close"})    # the unread rest makes the connection unusable
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body") from None
    return b"".join(chunks)


def parse(raw: bytes):
    """JSON text -> Python value, or APIError(400) saying what is wrong with it."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; expected a JSON object")
    text = _decode(raw)
    try:
        data = json.loads(text, parse_constant=_no_constants) if len(raw) <= SMALL else _SlicedDecoder().decode(text)
    except (ValueError, RecursionError) as e:     # JSONDecodeError, digit limits, deep nesting
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if _has_surrogate_escape(text):               # only a \uD800-\uDFFF escape can make a surrogate
        _refuse_lone_surrogates(data)
    return data


def _has_surrogate_escape(text: str) -> bool:
    # windows overlap by an escape's length, so none is missed at a boundary
    return any(_SURROGATE_ESCAPE.search(text, i, i + PIECE + 6) for i in range(0, len(text), PIECE))


def _decode(raw: bytes) -> str:
    """Strict decoding (json.loads itself lets UTF-8-encoded surrogates through), in pieces."""
    encoding = json.detect_encoding(raw)
    decoder = codecs.getincrementaldecoder(encoding)("strict")
    view, parts = memoryview(raw), []
    try:
        for start in range(0, len(raw), PIECE):
            parts.append(decoder.decode(view[start:start + PIECE]))
        parts.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError as e:
        at = start + e.start
        raise APIError(400, f"the request body is not valid {encoding.upper()} text: byte "
                            f"0x{raw[at]:02x} at offset {at} ({e.reason})") from None
    return "".join(parts)


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _refuse_lone_surrogates(data) -> None:
    stack = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if (m := _SURROGATE.search(value)):
                where = f" in {path}" if path else ""
                raise APIError(400, f"the request body has a lone UTF-16 surrogate (\\u{ord(m.group()):04x}){where}, "
                                    "which is not valid Unicode text", param=path or None)
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path))
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))


class _SlicedDecoder(json.JSONDecoder):
    """json's pure-Python scanner with strings decoded in slices: every C call is short, so the
    GIL passes to the event loop often. Same results as json.loads."""

    def __init__(self):
        super().__init__(parse_constant=_no_constants)
        self.parse_string = scan_string
        self.parse_object = _parse_object
        self.scan_once = json.scanner.py_make_scanner(self)


def scan_string(s: str, end: int, strict: bool = True) -> tuple[str, int]:
    """json's scanstring (``end`` is just past the opening quote), one <= ~1 MB slice at a time."""
    c_scan = json.decoder.scanstring
    parts, pos = [], end
    while True:
        cut = _SLICE.match(s, pos).end()
        closed = cut < len(s) and s[cut] == '"'
        if closed and pos == end:
            return c_scan(s, end, strict)                 # a short string: one C call
        if not closed and (cut == pos or cut >= len(s)):  # the text ends inside the string
            raise json.JSONDecodeError("Unterminated string starting at", s, end - 1)
        try:
            parts.append(c_scan(s[pos:cut] + '"', 0, strict)[0])
        except json.JSONDecodeError as e:
            raise json.JSONDecodeError(e.msg, s, pos + e.pos) from None
        if closed:
            return "".join(parts), cut + 1
        pos = cut


def _parse_object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
    """A JSON object whose keys are read with scan_string (the stock one uses the C scanner)."""
    s, end = s_and_end
    memo = {} if memo is None else memo
    pairs = {}
    end = _WS.match(s, end).end()
    if s[end:end + 1] == "}":
        return pairs, end + 1
    while True:
        if s[end:end + 1] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", s, end)
        key, end = scan_string(s, end + 1, strict)
        key = memo.setdefault(key, key)
        end = _WS.match(s, end).end()
        if s[end:end + 1] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", s, end)
        end = _WS.match(s, end + 1).end()
        try:
            pairs[key], end = scan_once(s, end)
        except StopIteration as e:
            raise json.JSONDecodeError("Expecting value", s, e.value) from None
        end = _WS.match(s, end).end()
        if s[end:end + 1] == "}":
            return pairs, end + 1
        if s[end:end + 1] != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", s, end)
        end = _WS.match(s, end + 1).end()
