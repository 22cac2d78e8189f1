"""The starlette app: routes, errors in each API's own JSON shape, and the middleware around them
(server/access.py: access log, counters, drain; server/guard.py: Origin, CORS, API key).

Nothing a client sends can crash the server: every failure becomes a JSON error response.
"""
from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Route

from freetoken.log import logger
from freetoken.server import anthropic_api, control, openai_api, openai_completions, responses_api
from freetoken.server.access import Tracker
from freetoken.server.errors import APIError, api_of, error_response
from freetoken.server.guard import Guard
from freetoken.server.state import ServerState

ROUTES = [
    Route("/health", control.health, methods=["GET"]),
    Route("/metrics", control.metrics, methods=["GET"]),
    Route("/v1/models", openai_api.models, methods=["GET"]),
    Route("/v1/models/{model:path}", openai_api.model, methods=["GET"]),    # ids may hold a "/"
    Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai_completions.completions, methods=["POST"]),
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
    app.add_middleware(Tracker, state=state, routes=ROUTES)     # outermost: sees Guard's refusals too
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
