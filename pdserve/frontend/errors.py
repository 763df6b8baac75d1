"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

A client mistake is always a 4xx with a message naming the field; 5xx is kept for the engine
being gone (503) or a bug (500).
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.frontend.protocol import UnknownFieldError

logger = logging.getLogger("pdserve.frontend")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int = 1,  # seconds, for a 429 or 503
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


class SafeJSONResponse(JSONResponse):
    """JSON that always renders: text that cannot be encoded (a lone surrogate echoed from a
    request) is escaped instead of failing the response."""

    def render(self, content) -> bytes:
        text = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8", "backslashreplace")


def error_response(
    status: int, message: str, param=None, code=None, headers=None
) -> SafeJSONResponse:
    return SafeJSONResponse(
        error_body(status, message, param, code), status_code=status, headers=headers
    )


_FIELD_RE = re.compile(r"invalid (\w+)")


def from_value_error(e: ValueError) -> APIError:
    """A ValueError from validation ("invalid top_p=2.0: ...") as a 400 naming the field."""
    m = _FIELD_RE.match(str(e))
    return APIError(400, str(e), param=m.group(1) if m else None, code="invalid_value")


def _describe(err: dict) -> tuple[str, str | None]:
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    field = ".".join(loc) or None
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, UnknownFieldError):
        path = ".".join([*loc, cause.field])
        return f"unsupported field '{path}': pdserve does not implement it", path
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if err.get("type") == "missing":
        return f"missing required field '{field}'", field
    return f"invalid '{field}': {err.get('msg')}", field


async def validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request body")
    # A union field reports one error per member: say it once, for the first member.
    message, param = _describe(errors[0])
    if len(errors) > 1 and not all(e.get("loc") == errors[0].get("loc") for e in errors):
        message += f" (and {len(errors) - 1} more problem(s))"
    return error_response(400, message, param, code="invalid_value")


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if exc.status in (429, 503) else None
    return error_response(exc.status, exc.message, exc.param, exc.code, headers)


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else "error"
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    return error_response(exc.status_code, message)


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}")
