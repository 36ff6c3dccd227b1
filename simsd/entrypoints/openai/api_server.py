"""The server's app (:func:`build_app`): its state, middleware, exception handlers, routes and
lifespan."""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from ...config.serving import MAX_REQUEST_BYTES, ROUND_TIMEOUT, SSE_KEEPALIVE, check_api_key
from ..api import LLM
from .errors import EXCEPTION_HANDLERS
from .middleware import APIKeyAuth, BodyLimit
from .router import BODIES, router
from .state import ServerState


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The app's lifespan: at its end (SIGTERM under uvicorn, after uvicorn has let the open
    requests finish) refuse new requests and, with ``shutdown_llm``, drain and stop the LLM."""
    yield
    state = app.state.simsd
    state.draining = True
    if state.shutdown_llm:
        await run_in_threadpool(state.llm.shutdown, True)


def build_app(llm: LLM, model_name: str | None = None, shutdown_llm: bool = True, *, api_key: str | None = None,
              allowed_origins=(), allowed_headers=("*",), allowed_methods=("*",), docs: bool = True,
              max_request_bytes: int = MAX_REQUEST_BYTES, round_timeout: float = ROUND_TIMEOUT,
              sse_keepalive: float = SSE_KEEPALIVE) -> FastAPI:
    """The FastAPI app serving ``llm`` as ``model_name`` (default: the target directory's name).
    ``shutdown_llm``: drain and stop the LLM when the app shuts down (SIGTERM under uvicorn:
    uvicorn first lets the open requests finish).

    ``api_key``: every ``/v1/*`` request needs ``Authorization: Bearer <api_key>``
    (:class:`~simsd.entrypoints.openai.middleware.APIKeyAuth`; a key a client could never send is
    refused, :func:`~simsd.config.serving.check_api_key`); ``/health`` and ``/metrics`` stay open
    (for probes; put them behind the proxy's rules if needed). ``allowed_origins``: the browser
    origins CORS allows (``["*"]``: any; empty: none, preflights are then 405), with the request
    headers ``allowed_headers`` and the methods ``allowed_methods`` (``["*"]``: any, as vLLM).
    ``docs`` False: no ``/docs``, ``/redoc``, ``/openapi.json``. ``max_request_bytes``: the body
    limit (:class:`~simsd.entrypoints.openai.middleware.BodyLimit`). ``round_timeout``: seconds a
    scheduler round may run before ``/health`` answers 503. ``sse_keepalive``: seconds between
    the keep-alive comments of a stream with nothing to send.

    Raises:
        ParamError: an ``api_key`` a client could never send.
    """
    if api_key is not None:
        check_api_key(api_key)
    app = FastAPI(title="simsd", lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS,
                  **({} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    app.state.simsd = ServerState(llm, model_name or llm.target.path.name, shutdown_llm, round_timeout=round_timeout,
                                  sse_keepalive=sse_keepalive)
    if api_key is not None:
        app.add_middleware(APIKeyAuth, api_key=api_key)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    if allowed_origins:  # added last: the outermost layer, so preflights and 401s carry the CORS headers
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                           allow_headers=list(allowed_headers))
    app.include_router(router)
    app.openapi = openapi_with_bodies(app.openapi)
    return app


def openapi_with_bodies(generate):
    """FastAPI's OpenAPI schema function ``generate`` with the request bodies the handlers read
    themselves (:data:`~simsd.entrypoints.openai.router.BODIES`) added to its components."""
    def openapi() -> dict:
        schema = generate()  # (FastAPI keeps it: the same dict on every call)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in BODIES:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        return schema
    return openapi
