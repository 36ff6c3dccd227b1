"""The server's endpoints: module-level handlers on one ``APIRouter`` (:data:`router`), each
reading the server's state from the app (``request.app.state.simsd``, a
:class:`~simsd.entrypoints.openai.state.ServerState`).

``POST /v1/completions``, ``POST /v1/chat/completions`` (:func:`~simsd.entrypoints.openai.serving.serve`),
``GET /v1/models``, ``GET /health``, ``GET /metrics``.
"""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .errors import error_response
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import serve

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 with the running and waiting request counts; 503 while shutting down, when the
    scheduling thread has stopped, or when its round in progress has run longer than the
    server's ``round_timeout`` (a stuck engine: a load balancer stops sending to it)."""
    state = request.app.state.simsd
    llm = state.llm
    s = llm.scheduler
    if state.draining or s.closed or (llm.started and not s.alive):
        return error_response(503, "the server is shutting down" if state.draining or s.closed
                              else "the scheduler thread has stopped", type_="server_error")
    started = s.round_started
    if started is not None and time.monotonic() - started > state.round_timeout:
        return error_response(503, f"the engine has not finished a round for {time.monotonic() - started:.0f} s "
                                   f"(simsd serve --round-timeout {state.round_timeout:g}): it may be stuck",
                              type_="server_error")
    return {"status": "ok", "running": s.num_running, "waiting": s.num_waiting}


@router.get("/v1/models")
async def models(request: Request):
    """The served model (OpenAI's list object), with its ``max_model_len``."""
    state = request.app.state.simsd
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                        "owned_by": "simsd", "max_model_len": state.llm.max_model_len}]}


@router.get("/metrics")
async def metrics(request: Request):
    """Prometheus text (:mod:`simsd.entrypoints.openai.metrics`)."""
    body, ctype = request.app.state.simsd.metrics.render()
    return Response(body, media_type=ctype)


def request_body(model) -> dict:
    """The OpenAPI ``requestBody`` of a handler that reads ``model`` itself (the schema: in the
    components, :func:`~simsd.entrypoints.openai.api_server.openapi_with_bodies`)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


#: the request bodies the handlers read themselves, for the OpenAPI schema
BODIES = (CompletionRequest, ChatCompletionRequest)


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
async def completions(request: Request):
    """OpenAI's Completions: a text, token ids, or a list of either (one choice each)."""
    return await serve(request, CompletionRequest, chat=False)


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def chat_completions(request: Request):
    """OpenAI's Chat Completions: messages through the checkpoint's chat template."""
    return await serve(request, ChatCompletionRequest, chat=True)
