"""OpenAI-shaped errors: every non-2xx answer is `{"error": {"message", "type", "param", "code"}}`.

Bad input is always a 4xx that names the offending field; a 500 means a bug in the server, and even
then the body carries no traceback.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

log = logging.getLogger("dspark_server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_error", 503: "service_unavailable"}
_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"}


class APIError(Exception):
    """Raised by handlers; becomes an OpenAI error body with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code if code is not None else _CODES.get(status)
        self.type = type or _TYPES.get(status, "invalid_request_error")


class _AsciiJSON(JSONResponse):
    # Escaping everything keeps a body valid even when a message quotes text with lone surrogates.
    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(error: APIError, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    return _AsciiJSON(body, status_code=error.status, headers=headers)


def param_name(loc) -> str | None:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic or the JSON parser found, with the field path as `param`."""
    err = exc.errors()[0]
    kind, loc, ctx = err.get("type"), tuple(err.get("loc", ())), err.get("ctx") or {}
    if kind == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {ctx.get('error', err.get('msg'))}",
                        code="invalid_json")
    if loc in ((), ("body",)):
        what = "is required" if kind == "missing" else "must be a JSON object"
        return APIError(400, f"request body {what} (send Content-Type: application/json)", code="invalid_body")
    param = param_name(loc[1:] if loc[0] == "body" else loc)
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}: this server does not support it", param=param,
                        code="unknown_field")
    detail = str(ctx["error"]) if kind == "value_error" and "error" in ctx else err.get("msg", "invalid value")
    return APIError(400, f"{param}: {detail}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc)

    async def on_validation(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc))

    async def on_http(request: Request, exc: HTTPException):
        # FastAPI raises a bare 400 when the body is not decodable at all (e.g. invalid UTF-8).
        message, code = {
            400: ("request body could not be parsed: it must be UTF-8 encoded JSON", "invalid_json"),
            404: (f"no route {request.method} {request.url.path}", None),
            405: (f"method {request.method} not allowed on {request.url.path}", None),
        }.get(exc.status_code, (str(exc.detail), None))
        return error_response(APIError(exc.status_code, message, code=code), headers=getattr(exc, "headers", None))

    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error", code="internal_error"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
