"""Error answers: every failure is `{"object": "error", "message", "type", "param", "code"}`.

`APIError` raised anywhere in a route becomes that body with its status. FastAPI's validation
errors (wrong types, missing fields, malformed JSON) become 400, HTTP exceptions keep their
status, and anything unexpected is logged and answered 500; the server keeps serving.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.headers = headers


def error_body(message: str, status: int, param: str | None = None) -> dict:
    try:
        kind = HTTPStatus(status).phrase.replace(" ", "")
    except ValueError:
        kind = "Error"
    return {"object": "error", "message": message, "type": kind, "param": param, "code": status}


def error_response(
    message: str, status: int = 400, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc(err: dict) -> str:
    """The field path of a validation error, without the union-member tags pydantic puts in it
    (`NativeSamplingParams`, `list[int]`, ...)."""
    parts = [str(x) for x in err.get("loc", ()) if x != "body"]
    return ".".join(
        p for p in parts if not (p[:1].isupper() or "[" in p or p.lower() in _TYPE_TAGS)
    )


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc, msg = _loc(err), err.get("msg", "invalid")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        return error_response(_describe(exc), 400, _loc(first) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(TimeoutError)
    async def _timeout(_: Request, exc: TimeoutError) -> JSONResponse:
        # a scheduler query (`SchedulerClient.query`) not answered in time: busy, not broken
        logger.warning("scheduler query timed out: %s", exc or "no answer")
        return error_response(
            "the scheduler did not answer in time; retry later", 503, headers={"Retry-After": "5"}
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)
