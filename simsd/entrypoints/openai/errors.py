"""The server's errors as OpenAI answers them: the body ``{"error": {"message", "type", "param",
"code"}}`` (:func:`error_body`, :func:`error_response`) and the exception handlers that turn each
exception into its status (:data:`EXCEPTION_HANDLERS`, given to the app by
:func:`~simsd.entrypoints.openai.api_server.build_app`):

* :class:`ParamError`: 400, ``param`` the setting or field (a bad body's first error:
  :func:`~simsd.entrypoints.openai.protocol.parse_request`);
* :class:`ModelNotFound`: 404, type ``NotFoundError``, ``param`` ``model``, code 404 (vLLM's
  answer for a model it does not serve; OpenAI's clients raise ``openai.NotFoundError``);
* ``QueueFull``: 503 ``server_busy`` with ``Retry-After``
  (:meth:`~simsd.entrypoints.openai.state.ServerState.retry_after`);
* ``SchedulerClosed``: 503 ``server_busy``, the server is shutting down;
* :class:`ServerStopped`: 503 ``server_error``, code ``shutting_down``;
* ``RequestError``: 500 ``server_error`` (the request failed inside the engine, e.g. on
  non-finite logits: the same request would fail again, so ``x-should-retry: false``, which
  OpenAI's clients honour);
* an HTTP error (404, 405, 413 ...): its status, ``invalid_request_error``;
* anything else: 500 ``server_error``, ``internal error: ...``.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...engine.scheduler import QueueFull, SchedulerClosed
from ..errors import ParamError
from ..outputs import RequestError


class ModelNotFound(LookupError):
    """A request named a model the server does not serve (a 404, as vLLM answers it)."""


class ServerStopped(RuntimeError):
    """A request in flight was cancelled because the server is shutting down (a 503)."""


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | int | None = None) -> dict:
    """OpenAI's error body (a response's, or a stream's error chunk)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                   headers: dict | None = None, code: str | int | None = None) -> JSONResponse:
    """OpenAI's error body (:func:`error_body`) with ``status``."""
    return JSONResponse(error_body(message, param, type_, code), status_code=status, headers=headers)


async def on_param(request, exc: ParamError):
    return error_response(400, str(exc), exc.param)


async def on_model_not_found(request, exc: ModelNotFound):
    return error_response(404, str(exc), "model", type_="NotFoundError", code=404)


async def on_queue_full(request, exc: QueueFull):
    state = request.app.state.simsd
    state.metrics.rejected.labels("queue_full").inc()
    return error_response(503, f"the server is busy: {exc}", type_="server_busy",
                          headers={"Retry-After": str(state.retry_after())})


async def on_closed(request, exc: SchedulerClosed):
    request.app.state.simsd.metrics.rejected.labels("shutting_down").inc()
    return error_response(503, "the server is shutting down", type_="server_busy", headers={"Retry-After": "5"})


async def on_stopped(request, exc: ServerStopped):
    return error_response(503, str(exc), type_="server_error", code="shutting_down", headers={"Retry-After": "5"})


async def on_request_error(request, exc: RequestError):
    return error_response(500, str(exc), type_="server_error", headers={"x-should-retry": "false"})


async def on_http(request, exc: StarletteHTTPException):
    return error_response(exc.status_code, str(exc.detail), type_="invalid_request_error")


async def on_other(request, exc: Exception):
    return error_response(500, f"internal error: {exc!r}", type_="server_error")


#: the app's exception handlers (FastAPI's ``exception_handlers``)
EXCEPTION_HANDLERS = {ParamError: on_param, ModelNotFound: on_model_not_found, QueueFull: on_queue_full,
                      SchedulerClosed: on_closed, ServerStopped: on_stopped, RequestError: on_request_error,
                      StarletteHTTPException: on_http, Exception: on_other}
