"""OpenAI's error JSON, `{"error": {message, type, param, code}}`, and `APIError`, which carries a complaint to the
client in it, naming the field (a ValueError from SamplingParams or the engine included)."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from fastapi.responses import JSONResponse
from pydantic import BaseModel

# Error types by status, as the OpenAI Python client names its exceptions.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",  # vLLM's type for a retryable refusal (a pause) and an unavailable engine
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}` with HTTP status `code`."""

    def __init__(self, code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def response(self) -> ErrorResponse:
        info = ErrorInfo(
            message=self.message, type=ERROR_TYPES.get(self.code, "APIError"), param=self.param, code=self.code
        )
        return ErrorResponse(error=info)

    @classmethod
    def from_value_error(
        cls, exc: ValueError, fields: Collection[str], default: str | None, rename: Mapping[str, str] | None = None
    ) -> APIError:
        """400 for a ValueError from rlserve, whose messages start with the offending field ("temperature must ...",
        "prompt: ..."); `rename` maps engine names to this request's names (chat's top_logprobs), in `param` and at the
        message's start."""
        message = str(exc)
        match = re.match(r"(\w+)[: ]", message)
        param = match.group(1) if match and match.group(1) in fields else default
        if param is not None and rename and param in rename:
            if match and match.group(1) == param:  # the message names the field as this request does
                message = rename[param] + message[len(param) :]
            param = rename[param]
        return cls(400, message, param)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.response().model_dump(), status_code=error.code)
