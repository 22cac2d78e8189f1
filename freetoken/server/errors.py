"""APIError and its JSON in each API's own shape (OpenAI ``{"error": {...}}``, Anthropic ``{"type": "error"}``)."""
from __future__ import annotations

from starlette.responses import JSONResponse

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
                413: "invalid_request_error", 415: "invalid_request_error", 500: "server_error",
                501: "not_implemented_error", 503: "unavailable_error", 504: "timeout_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                   413: "request_too_large", 415: "invalid_request_error", 500: "api_error",
                   501: "api_error", 503: "overloaded_error", 504: "api_error"}


class APIError(Exception):
    """A request the server answers with an error status; ``param`` names the offending field.

    ``wording`` holds another API's own message for the same error (``{"anthropic": ...}``): clients
    parse some of them (Claude Code reads the counts out of "prompt is too long: N tokens > M
    maximum" to compact its history), so each API gets the sentence its real service sends.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 extra: dict | None = None, headers: dict | None = None, wording: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.extra, self.headers, self.wording = extra or {}, headers, wording or {}


def api_of(path: str) -> str:
    """Which error shape a route answers in."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(err: APIError, api: str) -> dict:
    if api == "anthropic":
        kind = ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": err.wording.get(api, err.message)}}
    kind = OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    return {"error": {"message": err.wording.get(api, err.message), "type": kind, "param": err.param,
                      "code": err.code, **err.extra}}


def error_response(err: APIError, api: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(err, api), status_code=err.status, headers=headers or err.headers)
