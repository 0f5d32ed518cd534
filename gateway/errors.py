"""OpenAI-style errors: every failure a client sees is ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specd.services.common.wire import REQUEST_ERROR_METADATA_KEY
from specd.v1 import target_pb2

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """An error to return to the client as is."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


_CODES = {
    target_pb2.REQUEST_ERROR_CODE_INVALID_VALUE: "invalid_value",
    target_pb2.REQUEST_ERROR_CODE_CONTEXT_LENGTH_EXCEEDED: "context_length_exceeded",
}


def invalid_request(e: grpc.aio.AioRpcError, prompt_param: str) -> APIError:
    """The 400 for a target's INVALID_ARGUMENT, from its typed RequestError (never from the
    message, which is passed on as is). ``prompt_param``: what the prompt is called in this
    request ("messages" in a chat, "prompt" in a completion)."""
    typed = target_pb2.RequestError()
    for key, value in e.trailing_metadata() or ():
        if key == REQUEST_ERROR_METADATA_KEY:
            typed.ParseFromString(value)
    param = {
        target_pb2.REQUEST_FIELD_PROMPT: prompt_param,
        target_pb2.REQUEST_FIELD_MESSAGES: "messages",
        target_pb2.REQUEST_FIELD_SPECULATION: "speculation",
    }.get(typed.field)
    return APIError(400, e.details() or "invalid request", param, _CODES.get(typed.code, "invalid_value"))


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # Pydantic names union members and type wrappers in loc; keep the field path only.
    loc = [x for x in loc if not any(c in x for c in "[]()") and x not in ("str", "list", "int", "float")]
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    if param:
        msg = f"{param}: {msg}"
    return msg, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_response(400, msg, param, "invalid_value" if param else "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)  # the trace goes to the log only
        return error_response(500, "internal server error")
