"""The server's endpoints: module-level handlers on one ``APIRouter`` (:data:`router`), each
reading the server's state from the app (``request.app.state.simsd``, a
:class:`~simsd.entrypoints.openai.state.ServerState`).

``POST /v1/completions``, ``POST /v1/chat/completions`` (:func:`~simsd.entrypoints.openai.serving.serve`),
``GET /v1/models``, ``GET /health``, ``GET /metrics``.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .errors import error_response
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import serve

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 with the running and waiting request counts; 503 while shutting down or when the
    scheduling thread has stopped."""
    state = request.app.state.simsd
    llm = state.llm
    s = llm.scheduler
    if state.draining or s.closed or (llm.started and not s.alive):
        return error_response(503, "the server is shutting down" if state.draining or s.closed
                              else "the scheduler thread has stopped", type_="server_error")
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


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest):
    return await serve(request, body, body.prompts(), chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest):
    return await serve(request, body, [body.chat()], chat=True)
