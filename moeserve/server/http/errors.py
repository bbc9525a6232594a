"""HTTP errors in OpenAI's shape, and the handlers that turn every failure into one.

Every error response of the server is `{"error": {"message", "type", "param", "code"}}` with a 4xx or 5xx
status, whatever went wrong: malformed JSON, a field of the wrong type, an unknown field, a prompt the engine
refuses, a dead worker, or a bug (500, logged with its traceback).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.server.rank_client import EngineDeadError
from moeserve.server.tokenizer_manager import InvalidRequestError, RequestFailedError

logger = logging.getLogger(__name__)
RETRY_AFTER = {"Retry-After": "1"}  # seconds

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          503: "service_unavailable", 500: "internal_server_error"}


class APIError(Exception):
    """An error the client sees: HTTP status + OpenAI-style body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    # 429: full, try later (sglang-router retries it and, a 4xx, does not count it against the server)
    return JSONResponse(err.body(), status_code=err.status, headers=RETRY_AFTER if err.status == 429 else None)


def validation_message(exc: ValidationError | RequestValidationError, what: str = "request") -> APIError:
    """One APIError naming the first bad field of a pydantic error, in words a client can act on."""
    errors = exc.errors()
    if not errors:
        return APIError(f"invalid {what}")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    # Drop pydantic's union-branch names (e.g. 'str', 'list[int]') from the location.
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        msg = f"unknown field {param!r}: it is not a parameter of this {what}"
    elif kind == "missing":
        msg = f"missing required field {param!r}"
    else:
        msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid value")
        if "input" in first and kind not in ("json_invalid",):
            msg += f" (got {_short(first['input'])})"
    more = len(errors) - 1
    if more and kind != "extra_forbidden":
        msg += f"; and {more} more problem(s)"
    return APIError(msg, 400, param=param, code=kind or None)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def engine_error(e: BaseException) -> APIError:
    """The HTTP error for an exception from the engine client."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return APIError(str(e), 400, param=e.param or _param_of(str(e)), code=e.code)
    if isinstance(e, RequestFailedError):
        return APIError(str(e), e.status, code="request_failed")
    if isinstance(e, EngineDeadError):
        return APIError(f"the engine is not running: {e}", 503, code="engine_dead")
    if isinstance(e, asyncio.TimeoutError):
        return APIError("the engine did not answer in time", 503, code="timeout")
    raise e


_PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
            "repetition_penalty", "stop_token_ids", "stop", "seed", "ignore_eos", "skip_special_tokens", "n",
            "input_ids", "text", "top_logprobs_num", "sampling_params", "json_schema", "regex", "ebnf")


def _param_of(message: str) -> str | None:
    """The request field an engine error message is about (its first word, or the prompt)."""
    first = message.split(" ", 1)[0].rstrip(":,")
    if first in _PARAMS:
        return first
    if "unknown sampling_params" in message:
        return "sampling_params"
    if "prompt" in message:
        return "prompt"
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(APIError(message, exc.status_code).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(f"internal server error: {type(exc).__name__}: {exc}", 500))
