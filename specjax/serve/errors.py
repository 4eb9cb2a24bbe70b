"""OpenAI-style error bodies, and the exception handlers that make every error one of them.

Clients (the official `openai` library among them) read `{"error": {"message", "type",
"param", "code"}}`; a body never carries a stack trace, and never more than a bounded excerpt
of what the client sent (`specjax.validation.shown`; unknown field names are cut too), so a
200 KB value cannot come back 200 KB long. Lone surrogates a client sent in JSON are escaped
before the body is encoded as UTF-8.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from specjax.validation import InvalidArgument, shown

log = logging.getLogger("specjax.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}
MAX_NAME_CHARS = 64   # of an unknown field name echoed back


class APIError(Exception):
    """An error answered with an OpenAI-style body; `param` names the request field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _encodable(text: str | None) -> str | None:
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": _encodable(message),
                      "type": _TYPES.get(status, "invalid_request_error"),
                      "param": _encodable(param), "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


INTERNAL_ERROR = "internal server error; the request was not completed"


def _bounded(name: str) -> str:
    return name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS - 3] + "..."


def _param_from_loc(loc: tuple, fields: frozenset[str], extra: bool = False) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content".

    Pydantic puts union-branch tags ("float", "list[int]", a model's name) into locations;
    only request field names (`fields`) and list indices make up the parameter path, plus the
    unknown name itself for an extra field (cut to a bounded length: the client chose it).
    """
    parts = [p for p in loc if p != "body"]
    if not parts or not isinstance(parts[0], str):
        return None
    path = _bounded(parts[0])
    for i, p in enumerate(parts[1:], start=1):
        if isinstance(p, int):
            path += f"[{p}]"
        elif p in fields or (extra and i == len(parts) - 1):
            path += "." + _bounded(str(p))
    return path


def validation_message(errors: list[dict[str, Any]],
                       fields: frozenset[str] = frozenset()) -> tuple[str, str | None]:
    """One readable message (and the parameter) from FastAPI's validation errors; `fields`
    holds every field name of the request models."""
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    param_of = lambda e: _param_from_loc(tuple(e.get("loc", ())), fields,
                                         e.get("type") == "extra_forbidden")
    param = param_of(first)
    if kind == "string_unicode":   # a lone surrogate where pydantic needs a str (a key)
        return (f"{param or 'the request body'} is not valid Unicode text: it holds a lone "
                "surrogate", param)
    if param is None:
        return "the request body must be a JSON object", None
    if kind == "missing":
        return f"{param} is required", param
    if kind == "extra_forbidden":
        return f"unrecognized request argument supplied: {param}", param
    # Union members each report why they did not match; say so once per parameter.
    reasons = list(dict.fromkeys(e.get("msg", "invalid") for e in errors if param_of(e) == param))
    return (f"invalid type for {param}: {'; or '.join(reasons)} "
            f"(got {shown(first.get('input'))})", param)


def install_error_handlers(app, on_error: Callable[[int], None] | None = None,
                           fields: frozenset[str] = frozenset()) -> None:
    """422s become OpenAI 400s; HTTP errors and crashes get the same body shape. `on_error`
    sees every status answered here (for metrics); `fields` names the request models' fields."""
    count = on_error or (lambda status: None)

    def respond(status: int, message: str, param: str | None, code: str | None,
                headers: dict[str, str] | None = None) -> JSONResponse:
        count(status)
        return error_response(status, message, param, code, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()), fields)
        return respond(400, message, param, "invalid_type")

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(InvalidArgument)
    async def _invalid(request: Request, exc: InvalidArgument) -> JSONResponse:
        return respond(400, str(exc), exc.param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(exc.status_code, str(exc.detail), None, None,
                       headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s", request.url.path)
        # Starlette re-raises after this answer and uvicorn then closes the connection: say
        # so, or a keep-alive client sends its next request into a closed socket.
        return respond(500, INTERNAL_ERROR, None, "internal_error",
                       headers={"Connection": "close"})
