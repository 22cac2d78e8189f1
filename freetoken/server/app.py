"""The starlette app: routes, API-key and Origin checks, errors in each API's own JSON shape.

Nothing a client sends can crash the server: every failure becomes a JSON error response.
"""
from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Route

from freetoken.log import logger
from freetoken.server import anthropic_api, control, openai_api, responses_api
from freetoken.server.errors import APIError, api_of, error_response
from freetoken.server.state import ServerState

PUBLIC = {"/health"}
LOOPBACK = {"localhost", "127.0.0.1", "::1"}
ROUTES = [
    Route("/health", control.health, methods=["GET"]),
    Route("/metrics", control.metrics, methods=["GET"]),
    Route("/v1/models", openai_api.models, methods=["GET"]),
    Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai_api.completions, methods=["POST"]),
    Route("/v1/responses", responses_api.responses, methods=["POST"]),
    Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"]),
    Route("/v1/cache/status", control.cache_status, methods=["GET"]),
    Route("/v1/cache/rebuild", control.cache_rebuild, methods=["POST"]),
]


def build_app(state: ServerState) -> Starlette:
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(routes=ROUTES, exception_handlers=handlers)
    app.state.server = state
    app.add_middleware(Guard, state=state)
    return app


async def _api_error(request: Request, exc: APIError):
    return error_response(exc, api_of(request.url.path))


async def _http_error(request: Request, exc: HTTPException):
    message = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return error_response(APIError(exc.status_code, message), api_of(request.url.path), exc.headers)


async def _internal_error(request: Request, exc: Exception):
    logger.exception("internal error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}"), api_of(request.url.path))


class Guard:
    """ASGI middleware: Origin check (browsers), API key, and one counter per response status."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        self.keys = [k.encode() for k in state.config.api_keys]
        self.origins = state.config.origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refuse(path, headers)
        status = [500]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            if refusal is not None:
                return await error_response(refusal, api_of(path))(scope, receive, counted_send)
            return await self.app(scope, receive, counted_send)
        finally:
            route = path if any(r.path == path for r in ROUTES) else "other"
            self.state.metrics.observe_http(route, status[0])

    def _refuse(self, path: str, headers: dict) -> APIError | None:
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin):
            return APIError(403, f"requests from the browser origin {origin!r} are not allowed "
                                 "(see --allowed-origins)")
        if self.keys and path not in PUBLIC and not self._key_ok(headers):
            return APIError(401, "missing or invalid API key (send Authorization: Bearer KEY or x-api-key: KEY)",
                            code="invalid_api_key")
        return None

    def _origin_ok(self, origin: str) -> bool:
        if origin.rstrip("/") in self.origins:
            return True
        try:
            host = urlsplit(origin).hostname
        except ValueError:
            return False
        return host in LOOPBACK

    def _key_ok(self, headers: dict) -> bool:
        given = headers.get("x-api-key")
        auth = headers.get("authorization", "")
        if given is None and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if not given:
            return False
        given_b = given.encode()
        # compare against every key (no early exit) so timing says nothing about which matched
        return bool(sum(hmac.compare_digest(given_b, k) for k in self.keys))
