"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import math
import re

import msgspec
from aiohttp import web

from contracts.messages import ErrorReply
from contracts.openai_api import ErrorDetail, ErrorResponse

_ENCODER = msgspec.json.Encoder()
_PATH = re.compile(r"at `\$\.([A-Za-z0-9_]+)")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]+)`")
_MISSING_FIELD = re.compile(r"Object missing required field `([^`]+)`")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_denied_error",
          404: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="kvlane"'
        return web.Response(
            status=self.status, body=_ENCODER.encode(self.body()), content_type="application/json", headers=headers
        )

    @classmethod
    def from_reply(cls, reply: ErrorReply) -> ApiError:
        return cls(reply.status, reply.message, code=reply.code, param=reply.param, retry_after_s=reply.retry_after_s)


def from_decode_error(exc: msgspec.DecodeError) -> ApiError:
    """A readable 400 for a body msgspec could not decode or validate."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return ApiError(400, f"request body is not valid JSON: {text}", code="invalid_json")
    if match := _UNKNOWN_FIELD.search(text):
        path = _PATH.search(text)
        name = f"{path.group(1)}.{match.group(1)}" if path else match.group(1)
        return ApiError(400, f"Unrecognized request argument supplied: {name}", code="unknown_parameter", param=name)
    if match := _MISSING_FIELD.search(text):
        path = _PATH.search(text)
        name = f"{path.group(1)}.{match.group(1)}" if path else match.group(1)
        return ApiError(400, f"Missing required parameter: '{name}'", code="missing_required_parameter", param=name)
    path = _PATH.search(text)
    return ApiError(400, f"Invalid request: {text}", code="invalid_value", param=path.group(1) if path else None)
