"""Who may call: the browser Origin check with CORS for --allowed-origins, and the API key."""
from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from freetoken.server.errors import APIError, api_of, error_response

PUBLIC = {"/health"}
LOOPBACK = {"localhost", "127.0.0.1", "::1"}
CORS_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE = "600"            # seconds a browser may reuse a preflight answer


class Guard:
    """ASGI middleware. A request with an Origin that is neither loopback nor listed gets 403.
    Listed origins (only those: nothing by default) get CORS headers and preflight answers;
    a preflight carries no credentials, so it skips the key check."""

    def __init__(self, app, state):
        self.app = app
        self.keys = [k.encode() for k in state.config.api_keys]
        self.origins = state.config.origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin")
        cors = origin is not None and origin.rstrip("/") in self.origins
        if cors and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            return await _preflight(origin, headers, send)
        refusal = self._refuse(path, origin, headers)
        if cors:
            send = _with_cors(origin, send)
        if refusal is not None:
            return await error_response(refusal, api_of(path))(scope, receive, send)
        return await self.app(scope, receive, send)

    def _refuse(self, path: str, origin: str | None, headers: dict) -> APIError | None:
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


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


def _with_cors(origin: str, send):
    async def cors_send(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *_cors_headers(origin)]}
        await send(message)
    return cors_send


async def _preflight(origin: str, headers: dict, send) -> None:
    """204 naming what the browser may send: these methods, and the headers it asked for."""
    allow = [*_cors_headers(origin), (b"access-control-allow-methods", CORS_METHODS.encode()),
             (b"access-control-max-age", CORS_MAX_AGE.encode())]
    asked = headers.get("access-control-request-headers")
    if asked:
        allow.append((b"access-control-allow-headers", asked.encode("latin-1")))
    await send({"type": "http.response.start", "status": 204, "headers": allow})
    await send({"type": "http.response.body", "body": b""})
