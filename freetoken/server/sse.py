"""Server-sent events: framing, keep-alives and the streaming response."""
from __future__ import annotations

import json

from starlette.responses import StreamingResponse

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
OPENAI_PING = ": ping\n\n"                 # a comment line: clients ignore it, proxies see traffic


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def data(obj) -> str:
    """One OpenAI-style frame (no event name)."""
    return f"data: {dumps(obj)}\n\n"


def event(name: str, obj) -> str:
    """One named event (Anthropic style): the data repeats the name as ``type``."""
    return f"event: {name}\ndata: {dumps(obj)}\n\n"


def response(frames) -> StreamingResponse:
    """Stream the frames of an async iterator. A client that disconnects cancels the iterator,
    which aborts its request in the engine (see Generation.events)."""
    return StreamingResponse(frames, media_type="text/event-stream", headers=HEADERS)
