"""OpenAI-compatible HTTP server over an :class:`~simsd.entrypoints.api.LLM` (FastAPI).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` gives
server-sent events: one chunk per finished block with its committed text, a final chunk per
choice with ``finish_reason`` and ``usage``, with ``stream_options.include_usage`` OpenAI's
usage-only chunk, then ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text, :mod:`simsd.entrypoints.metrics`).

Each choice carries a ``simsd`` extension object: ``seed`` (given or fresh: replay with it),
``stop_reason`` and ``stats`` (acceptance rate, forwards per token, ... as ``simsd generate
--json``).

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
input (malformed JSON, unknown fields, unknown model, a prompt longer than the positions allow,
``max_tokens < 1``, ``n > 1``, ``temperature < 0``, ...; ``param`` names the field), 503 with
``Retry-After`` when the scheduler's queue is full or the server is shutting down, 500 when
the request itself failed inside the engine (the other requests go on). A client that
disconnects cancels its requests, which frees their rows before the next round.

Shutdown (:meth:`ServerState.drain`): new requests get a 503 while the requests in flight
finish; those still running at the deadline (or at :meth:`ServerState.cancel_calls`) are
cancelled and answered with a 503 (a stream: an error chunk, then ``[DONE]``).
"""
from __future__ import annotations

import asyncio
import hmac
import math
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config.serving import MAX_REQUEST_BYTES
from ..engine.scheduler import QueueFull, SchedulerClosed
from .api import LLM
from .errors import ParamError
from .metrics import Metrics
from .outputs import RequestError, json_safe, request_failure
from .protocol import ChatCompletionRequest, CompletionRequest


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """OpenAI's error body (a response's, or a stream's error chunk)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                   headers: dict | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error body (:func:`error_body`) with ``status``."""
    return JSONResponse(error_body(message, param, type_, code), status_code=status, headers=headers)


class ServerStopped(RuntimeError):
    """A request in flight was cancelled because the server is shutting down (a 503)."""


class ServerState:
    """What the endpoints share: the LLM, the served model name, the metrics, the drain flag and
    the calls in flight (:class:`_Call`: from submission until each of their engine requests has
    ended)."""

    def __init__(self, llm: LLM, model_name: str):
        self.llm, self.model_name = llm, model_name
        self.metrics = Metrics(llm)
        self.draining = False
        self.created = int(time.time())
        self.calls: set = set()
        self._idle: asyncio.Event | None = None  # set when the last call ends, during a drain
        self._latency = None  # moving average of request latency (seconds), for Retry-After

    def ended(self, call) -> None:
        """``call``'s engine requests have all ended (the event loop)."""
        self.calls.discard(call)
        if not self.calls and self._idle is not None:
            self._idle.set()

    def cancel_calls(self, message: str) -> None:
        """Cancel every call in flight: each client is answered with a 503 carrying ``message``
        (a stream: an error chunk with it, then ``[DONE]``) and the rows are freed before the
        next round (the event loop)."""
        for call in list(self.calls):
            call.stop(message)

    async def drain(self, timeout: float, grace: float = 10.0) -> None:
        """Shut down gently: refuse new requests (503 with ``Retry-After``; ``/health`` answers
        503), let the calls in flight finish for at most ``timeout`` seconds, then cancel the
        rest (:meth:`cancel_calls`). Returns when no call is left (or ``grace`` seconds after
        the cancellation, should the engine not answer it)."""
        self.draining = True
        self._idle = asyncio.Event()
        if not self.calls:
            self._idle.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return
        except asyncio.TimeoutError:
            self.cancel_calls(f"the server is shutting down: the request did not finish within its "
                              f"{timeout:g} s (simsd serve --shutdown-timeout)")
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except asyncio.TimeoutError:
            pass

    def observe(self, output, seconds: float) -> None:
        self.metrics.observe(output, seconds)
        self._latency = seconds if self._latency is None else 0.8 * self._latency + 0.2 * seconds

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely (the waiting requests' share of the
        rows at the recent latency), 1 to 60."""
        s = self.llm.scheduler
        est = (self._latency or 1.0) * (s.num_waiting + 1) / max(s.max_rows, 1)
        return int(min(60, max(1, math.ceil(est))))


class _Call:
    """The engine requests of one HTTP request (``handles``: one per prompt, submitted by the
    route straight to :meth:`simsd.LLM.submit`), their events in one queue: ``(i, kind,
    payload)`` of :class:`~simsd.entrypoints.outputs.RequestHandle`, and ``(None, "stopped",
    message)`` first when the server cancels the call (:meth:`stop`). In ``state.calls`` from
    its start until every engine request has ended."""

    def __init__(self, state: ServerState, loop):
        self.state, self.loop = state, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles = []
        self.started = time.perf_counter()
        self.submitted = False  # all prompts submitted (or the submission failed)
        self.finished = 0       # engine requests ended (done, error, cancelled)
        self.stopped = False

    @classmethod
    async def start(cls, state: ServerState, prompts: list, params, rid: str, param: str, fit_max_tokens: bool):
        """Submit the prompts from a worker thread: tokenization and the size checks of a large
        prompt never hold up the event loop (other clients' streams, ``/health``)."""
        call = cls(state, asyncio.get_running_loop())
        state.calls.add(call)
        try:
            await run_in_threadpool(call._submit, state, prompts, params, rid, param, fit_max_tokens)
        finally:
            call.submitted = True
            call._check_ended()
        return call

    def _submit(self, state: ServerState, prompts: list, params, rid: str, param: str, fit_max_tokens: bool):
        s = state.llm.scheduler
        if len(prompts) > s.max_rows + s.max_waiting:  # could never be queued at once: not worth a retry
            raise ParamError(param, f"{len(prompts)} prompts in one request, but this server holds at most "
                                    f"{s.max_rows + s.max_waiting} at once ({s.max_rows} rows + --max-waiting "
                                    f"{s.max_waiting}): send them in several requests")
        try:
            for i, p in enumerate(prompts):
                if self.stopped:
                    raise ServerStopped("the server is shutting down")
                try:
                    self.handles.append(state.llm.submit(p, params, listener=partial(self.put, i),
                                                         request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                                                         fit_max_tokens=fit_max_tokens))
                except ParamError as exc:
                    name = param if exc.param in ("prompt", "messages") else exc.param
                    raise ParamError(name, (f"prompt {i}: " if len(prompts) > 1 else "") + exc.template) from None
        except BaseException:
            self.cancel()
            raise
        if self.stopped:  # stopped while the last prompt was submitted
            self.cancel()

    def put(self, i, kind, payload) -> None:  # the scheduling thread
        try:
            self.loop.call_soon_threadsafe(self._event, i, kind, payload)
        except RuntimeError:  # the event loop has closed: nobody is left to tell
            pass

    def _event(self, i, kind, payload) -> None:
        self.queue.put_nowait((i, kind, payload))
        if kind != "delta":
            self.finished += 1
            self._check_ended()

    def _check_ended(self) -> None:
        if self.submitted and self.finished >= len(self.handles):
            self.state.ended(self)

    def stop(self, message: str) -> None:
        """Cancel the call because the server shuts down: its reader gets ``("stopped",
        message)`` before anything else still to come (the event loop)."""
        if not self.stopped:
            self.stopped = True
            self.queue.put_nowait((None, "stopped", message))
            self.cancel()

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()


async def _disconnected(request: Request) -> None:
    """Return when the client has gone (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _usage(outs) -> dict:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _extension(o) -> dict:
    return json_safe({"seed": o.seed, "stop_reason": o.stop_reason, "stats": o.stats})


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is a 413 with OpenAI's body, at once
    when ``Content-Length`` says so, else as soon as the bytes received pass it (a chunked body
    is never read past the limit)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def message(self) -> str:
        return f"the request body exceeds the server's limit of {self.limit} bytes (simsd serve --max-request-bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await error_response(413, self.message())(scope, receive, send)
        total = 0

        async def limited():
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.limit:
                    raise HTTPException(413, self.message())  # FastAPI passes it on to the handler below
            return message
        return await self.app(scope, limited, send)


def build_app(llm: LLM, model_name: str | None = None, shutdown_llm: bool = True, *, api_key: str | None = None,
              allowed_origins=(), docs: bool = True, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``model_name`` (default: the target directory's name).
    ``shutdown_llm``: drain and stop the LLM when the app shuts down (SIGTERM under uvicorn:
    uvicorn first lets the open requests finish).

    ``api_key``: every ``/v1/*`` request needs ``Authorization: Bearer <api_key>`` (compared in
    constant time; 401 with OpenAI's body and code ``invalid_api_key`` otherwise); ``/health``
    and ``/metrics`` stay open (for probes; put them behind the proxy's rules if needed).
    ``allowed_origins``: the browser origins CORS allows (``["*"]``: any; empty: none, preflights
    are then 405). ``docs`` False: no ``/docs``, ``/redoc``, ``/openapi.json``.
    ``max_request_bytes``: the body limit (:class:`BodyLimit`).
    """
    state = ServerState(llm, model_name or llm.target.path.name)

    @asynccontextmanager
    async def lifespan(app):
        yield
        state.draining = True
        if shutdown_llm:
            await run_in_threadpool(llm.shutdown, True)

    app = FastAPI(title="simsd", lifespan=lifespan,
                  **({} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    app.state.simsd = state
    if api_key is not None:
        want = api_key.encode()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            if request.url.path.startswith("/v1/") and request.method != "OPTIONS":
                scheme, _, token = request.headers.get("authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), want):
                    return error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                          headers={"WWW-Authenticate": "Bearer"}, code="invalid_api_key")
            return await call_next(request)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    if allowed_origins:  # added last: the outermost layer, so preflights and 401s carry the CORS headers
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(RequestValidationError)
    async def on_validation(request, exc: RequestValidationError):
        err = exc.errors()[0]
        # union members show up in the location as their type (``str``, ``list[int]``): not a field
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_type_tag(str(x))]
        if err.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
        param = ".".join(loc) or None
        msg = err.get("msg", "bad request").removeprefix("Value error, ")
        return error_response(400, f"{param}: {msg}" if param else msg, param)

    @app.exception_handler(ParamError)
    async def on_param(request, exc: ParamError):
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(QueueFull)
    async def on_full(request, exc):
        state.metrics.rejected.labels("queue_full").inc()
        return error_response(503, f"the server is busy: {exc}", type_="server_busy",
                              headers={"Retry-After": str(state.retry_after())})

    @app.exception_handler(SchedulerClosed)
    async def on_closed(request, exc):
        state.metrics.rejected.labels("shutting_down").inc()
        return error_response(503, "the server is shutting down", type_="server_busy", headers={"Retry-After": "5"})

    @app.exception_handler(ServerStopped)
    async def on_stopped(request, exc):
        return error_response(503, str(exc), type_="server_error", code="shutting_down",
                              headers={"Retry-After": "5"})

    @app.exception_handler(RequestError)
    async def on_request_error(request, exc):
        return error_response(500, str(exc), type_="server_error")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request, exc):
        return error_response(exc.status_code, str(exc.detail), type_="invalid_request_error")

    @app.exception_handler(Exception)
    async def on_other(request, exc):
        return error_response(500, f"internal error: {exc!r}", type_="server_error")

    def check_model(body) -> None:
        if state.draining:
            raise SchedulerClosed("draining")
        if body.model != state.model_name:
            raise ParamError("model", f"model {body.model!r} is not served here (served: {state.model_name!r})")

    @app.get("/health")
    async def health():
        s = llm.scheduler
        if state.draining or s.closed or (llm.started and not s.alive):
            return error_response(503, "the server is shutting down" if state.draining or s.closed
                                  else "the scheduler thread has stopped", type_="server_error")
        return {"status": "ok", "running": s.num_running, "waiting": s.num_waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "simsd", "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        body, ctype = state.metrics.render()
        return Response(body, media_type=ctype)

    async def run(request: Request, body, prompts: list, chat: bool):
        check_model(body)
        params = body.sampling_params(llm.default_params)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        omitted = body.max_tokens is None and getattr(body, "max_completion_tokens", None) is None
        call = await _Call.start(state, prompts, params, rid, "messages" if chat else "prompt", omitted)
        created = int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_sse(state, call, rid, created, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        outs = await _collect(state, call, request)
        if outs is None:  # the client has gone
            return Response(status_code=499)
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                        "finish_reason": o.finish_reason, "simsd": _extension(o)} for i, o in enumerate(outs)]
        else:
            choices = [{"index": i, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason,
                        "simsd": _extension(o)} for i, o in enumerate(outs)]
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": state.model_name, "choices": choices, "usage": _usage(outs)}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await run(request, body, body.prompts(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await run(request, body, [body.chat()], chat=True)

    return app


async def _collect(state: ServerState, call: _Call, request: Request):
    """The outputs of a non-streaming call, or None when the client disconnects first (then
    its requests are cancelled).

    Raises:
        RequestError: a request failed (the call's other requests are cancelled).
    """
    outs = [None] * len(call.handles)
    left = len(outs)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while left:
            get = asyncio.ensure_future(call.queue.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                call.cancel()
                return None
            i, kind, payload = get.result()
            if kind == "stopped":
                raise ServerStopped(payload)
            if kind == "done":
                outs[i] = payload
                left -= 1
                state.observe(payload, time.perf_counter() - call.started)
            elif kind in ("error", "cancelled"):
                call.cancel()
                raise request_failure(call.handles[i].request_id, payload)
    finally:
        gone.cancel()
    return outs


async def _sse(state: ServerState, call: _Call, rid: str, created: int, chat: bool, include_usage: bool):
    """Server-sent events of a streaming call; cancelling it (client gone) cancels the requests."""
    import json

    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices, **extra) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": choices}
        body.update(extra)
        return f"data: {json.dumps(body)}\n\n"

    def piece(i, text, finish=None, ext=None) -> dict:
        c = ({"index": i, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
             if chat else {"index": i, "text": text, "logprobs": None, "finish_reason": finish})
        if ext is not None:
            c["simsd"] = ext
        return c

    outs = [None] * len(call.handles)
    left = len(outs)
    try:
        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(outs))])
        while left:
            i, kind, payload = await call.queue.get()
            if kind == "stopped":
                yield f"data: {json.dumps(error_body(payload, type_='server_error', code='shutting_down'))}\n\n"
                break
            if kind == "delta":
                if payload[0]:
                    yield chunk([piece(i, payload[0])])
            elif kind == "done":
                outs[i] = payload
                left -= 1
                state.observe(payload, time.perf_counter() - call.started)
                extra = {"usage": _usage(outs)} if not left else {}
                yield chunk([piece(i, "", payload.finish_reason, _extension(payload))], **extra)
            else:
                message = str(request_failure(call.handles[i].request_id, payload))
                yield f"data: {json.dumps(error_body(message, type_='server_error'))}\n\n"
                call.cancel()
                break
        if include_usage and not left:
            yield chunk([], usage=_usage(outs))
        yield "data: [DONE]\n\n"
    finally:
        call.cancel()  # no-op for finished requests; a disconnect cancels the task here


def _is_type_tag(part: str) -> bool:
    """Whether a pydantic error location part names a union member's type, not a field."""
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")
