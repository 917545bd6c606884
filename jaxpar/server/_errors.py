"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal goes through :class:`APIError`, and FastAPI's own 422 (a body that does not
validate) becomes the same 400 naming the first bad field.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


#: Parts of a pydantic error location that name a type of a union, not a field.
_TYPE_NAMES = {"str", "int", "float", "bool", "none"}


def _field(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content", "list[TextPart]")`` -> ``"messages.0.content"``."""
    parts = [
        str(p)
        for p in loc[1:]
        if not (isinstance(p, str) and ("[" in p or p.lower() in _TYPE_NAMES))
    ]
    return ".".join(parts) or (str(loc[0]) if loc else None)


def _from_validation(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body", None)
    first = errors[0]
    param = _field(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return bad_request(
            f"the body is not valid JSON: {first.get('msg')}", "body", "invalid_json"
        )
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    code = "missing" if first.get("type") == "missing" else "invalid_value"
    return bad_request(f"{param}: {message}", param, code)


def install(app: FastAPI) -> None:
    """Answers :class:`APIError`, validation errors and HTTP errors as OpenAI errors."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _from_validation(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()
