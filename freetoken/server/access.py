"""Every HTTP request, from arrival to its last byte: the access-log line, the per-status counter,
and the drain on shutdown (new requests get 503; those still open at the deadline are ended with
a 503 or an error event in their API's own shape)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.routing import Match

from freetoken.server import sse
from freetoken.server.errors import APIError, api_of, error_body, error_response

ACCESS_LOG = logging.getLogger("freetoken.access")
MAX_REASON = 240                # characters of an error's message the access line carries
CUT_MESSAGE = "the server is shutting down and this request did not finish within --shutdown-timeout"


@dataclass
class Record:
    """One request as the access log reports it; generations add their token counts."""

    method: str
    path: str
    client: str
    t0: float
    status: int = 0
    started: bool = False           # the response head was sent
    finished: bool = False          # the last body chunk was sent
    stream: bool = False            # an SSE response
    prompt: int = 0
    completion: int = 0
    cached: int = 0
    first_token_at: float | None = None
    generated: bool = False
    cut: bool = False               # the drain ended it at the shutdown deadline
    reason: str = ""                # an error answer's message (4xx/5xx JSON bodies)

    def line(self, now: float) -> str:
        parts = [f'{self.client} "{self.method} {self.path}" {self.status}']
        if self.generated:
            ttft = f"{self.first_token_at - self.t0:.3f}s" if self.first_token_at is not None else "-"
            parts += [f"prompt {self.prompt} (cached {self.cached})", f"output {self.completion}", f"ttft {ttft}"]
        parts.append(f"{now - self.t0:.3f}s")
        if self.cut:
            parts.append("ended at shutdown")
        if self.reason:
            parts.append(self.reason)
        return " | ".join(parts)


_CURRENT: ContextVar[Record | None] = ContextVar("freetoken_request", default=None)


def note_generation(prompt: int, completion: int, cached: int, ttft: float | None, seconds: float) -> None:
    """Credit a finished generation to the request it ran for (a no-op outside a request)."""
    record = _CURRENT.get()
    if record is None:
        return
    now = time.perf_counter()
    record.generated = True
    record.prompt += prompt
    record.completion += completion
    record.cached += cached
    if ttft is not None and record.first_token_at is None:
        record.first_token_at = now - seconds + ttft


class Tracker:
    """ASGI middleware, outermost. Runs each request as its own task so the drain can end it."""

    def __init__(self, app, state, routes):
        self.app, self.state, self.routes = app, state, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client = scope.get("client") or ("-", 0)
        record = Record(scope["method"], scope["path"], f"{client[0]}:{client[1]}", time.perf_counter())
        try:
            await self._run(record, scope, receive, _recording(record, send))
        finally:
            self.state.metrics.observe_http(self._route(scope), record.status or 500)
            if self.state.config.access_log:
                ACCESS_LOG.info("%s", record.line(time.perf_counter()))

    async def _run(self, record: Record, scope, receive, send) -> None:
        if self.state.stopping and record.path != "/health":
            refusal = APIError(503, "the server is shutting down", headers={"Connection": "close"})
            return await error_response(refusal, api_of(record.path))(scope, receive, send)
        token = _CURRENT.set(record)
        work = asyncio.ensure_future(self.app(scope, receive, send))   # copies the context: sees `record`
        _CURRENT.reset(token)
        self.state.open_requests[work] = record
        try:
            await asyncio.wait({work})
        except asyncio.CancelledError:          # the server itself cancelled us: take the request along
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise
        finally:
            self.state.open_requests.pop(work, None)
        if work.cancelled():                    # the drain's deadline
            record.cut = True
            await _end_cut(record, send)
            return
        work.result()                           # re-raise what the app raised (already answered as 500)

    def _route(self, scope) -> str:
        """The route's path template as a metrics label (unknown paths share one label)."""
        for route in self.routes:
            if route.matches(scope)[0] is not Match.NONE:
                return route.path_format
        return "other"


async def drain(state, timeout: float) -> int:
    """Wait up to `timeout` s for the open requests, then end the rest; returns how many were ended."""
    deadline = time.monotonic() + timeout
    while state.open_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = list(state.open_requests)
    for task in left:
        task.cancel()               # Tracker._run answers it with a 503 or an error event
    return len(left)


def _recording(record: Record, send):
    async def recorded(message):
        if message["type"] == "http.response.start":
            record.status, record.started = message["status"], True
            record.stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in message.get("headers", ()))
        elif message["type"] == "http.response.body":
            record.finished = not message.get("more_body", False)
            if record.status >= 400 and not record.stream and not record.reason:
                record.reason = _error_message(message.get("body", b""))
        await send(message)
    return recorded


def _error_message(body: bytes) -> str:
    """The message of an error answer's JSON body (either API's shape), shortened to one line."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    message = error.get("message", "") if isinstance(error, dict) else str(error or "")
    message = " ".join(str(message).split())
    return message if len(message) <= MAX_REASON else message[:MAX_REASON - 3] + "..."


async def _end_cut(record: Record, send) -> None:
    """A 503 if nothing was sent yet; else the API's error event, and the end of the body."""
    try:
        if not record.started:
            err = APIError(503, CUT_MESSAGE, headers={"Connection": "close"})
            return await error_response(err, api_of(record.path))(
                {"type": "http"}, _no_receive, send)
        if not record.finished:
            tail = _cut_event(record.path).encode() if record.stream else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})
    except Exception:  # noqa: BLE001 - the client may be gone already; nothing is left to tell it
        pass


async def _no_receive():
    return {"type": "http.disconnect"}


def _cut_event(path: str) -> str:
    err = APIError(503, CUT_MESSAGE)
    if api_of(path) == "anthropic":
        return sse.event("error", error_body(err, "anthropic"))
    if path == "/v1/responses":
        return sse.event("error", {"type": "error", "code": "server_shutting_down", "message": CUT_MESSAGE,
                                   "param": None})
    return sse.data(error_body(err, "openai"))
