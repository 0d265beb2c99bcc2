"""Errors of the HTTP API, in OpenAI's JSON shape: {"error": {message, type, param, code}}."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 431: "invalid_request_error",
          500: "server_error", 503: "server_error"}
_CODES = {401: "invalid_api_key", 404: "not_found", 408: "request_timeout",
          413: "request_too_large", 431: "request_header_fields_too_large",
          503: "engine_unavailable"}
_FIELD = re.compile(r"^([a-z_]+) must ")


class APIError(Exception):
    """A request the API refuses; `param` names the offending field when one is known."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _CODES.get(status, status)

    @classmethod
    def bad_request(cls, error: ValueError | str) -> APIError:
        """A 400 whose message is the validation's own (SamplingParams, the prompt checks);
        the field it names, if any, becomes `param`."""
        message = str(error)
        match = _FIELD.match(message)
        return cls(400, message, match.group(1) if match else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)
