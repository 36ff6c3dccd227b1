"""Serving one completion or chat request (vLLM's ``serving_completion`` / ``serving_chat``):
:func:`serve` reads and validates its body in a worker thread
(:func:`~simsd.entrypoints.openai.protocol.parse_request`), submits its prompts
(:class:`~simsd.entrypoints.openai.state.Call`) and answers with the whole response
(:func:`collect`) or with server-sent events (:func:`stream`).

A request with ``n > 1`` runs ``n`` engine requests per prompt, choice ``i`` of a prompt sampled
with :func:`~simsd.config.request.choice_seed` of the request's seed (one drawn when none is
given): choice index ``prompt * n + i``, OpenAI's order. A response's choices carry a ``simsd``
extension object each (:func:`extension`: ``seed``, ``stop_reason``, ``stats``) and the usage
counts every choice's tokens and each prompt once (:func:`usage`). A completion with ``echo``
has the prompt's text before each choice's (:func:`echo_text`; a stream sends it first).
Log-probabilities, when asked for, come in OpenAI's shapes (:mod:`simsd.entrypoints.openai.logprobs`),
streamed with the tokens of each chunk (a streamed ``echo`` then waits for its prompt's, computed
when the request is admitted).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from ...config.request import split_choices
from ...engine.scheduler import SchedulerClosed
from ..outputs import json_safe, request_failure
from .errors import ModelNotFound, ServerStopped, error_body
from .logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json
from .protocol import parse_request
from .state import Call, ServerState


def check_model(state: ServerState, body) -> None:
    """Refuse a request while the server drains (:class:`SchedulerClosed`, a 503) or for another
    model than the one served (:class:`ModelNotFound`, a 404 naming ``model``, as vLLM answers)."""
    if state.draining:
        raise SchedulerClosed("draining")
    if body.model != state.model_name:
        raise ModelNotFound(f"The model `{body.model}` does not exist (served: {state.model_name!r})")


def parsed(model, raw: bytes) -> tuple:
    """``(body, prompts)``: ``raw`` validated as ``model`` and its prompts, one per choice."""
    body = parse_request(model, raw)
    return body, body.prompts()


async def serve(request: Request, model, chat: bool):
    """Answer a completion (``chat`` False, ``model`` the request's class) or chat request: an
    OpenAI response body, a ``StreamingResponse`` of server-sent events for ``stream: true``, or
    an empty 499 when the client left first (before its body arrived, or before the answer). The
    body is parsed and validated in a worker thread: a large one never holds up other clients'
    streams or ``/health``.

    Raises:
        ParamError, ModelNotFound, QueueFull, SchedulerClosed, ServerStopped, RequestError:
            answered by the app's exception handlers (:mod:`simsd.entrypoints.openai.errors`).
    """
    state = request.app.state.simsd
    try:
        raw = await request.body()
    except ClientDisconnect:  # e.g. closed at the read deadline (simsd serve --request-read-timeout)
        return Response(status_code=499)
    body, prompts = await run_in_threadpool(parsed, model, raw)
    check_model(state, body)
    params = body.sampling_params(state.llm.default_params)
    n = params.n
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    omitted = body.max_tokens is None and getattr(body, "max_completion_tokens", None) is None
    items = [(p, choice) for p in prompts for choice in split_choices(params)]
    call = await Call.start(state, items, n, rid, "messages" if chat else "prompt", omitted)
    created = int(time.time())
    echo = [echo_text(state, h) for h in call.handles] if getattr(body, "echo", False) else None
    k = params.logprobs
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(stream(state, call, rid, created, chat, include_usage, echo, k),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    outs = await collect(state, call, request)
    if outs is None:  # the client has gone
        return Response(status_code=499)
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                    "logprobs": None if k is None else chat_logprobs(list(zip(o.token_ids, o.logprobs)), k),
                    "finish_reason": o.finish_reason, "simsd": extension(o)} for i, o in enumerate(outs)]
    else:
        choices = []
        for i, o in enumerate(outs):
            toks = list(zip(o.token_ids, o.logprobs or ()))
            if echo is not None and k is not None:
                toks = list(zip(o.prompt_token_ids, o.prompt_logprobs)) + toks
            choices.append({"index": i, "text": o.text if echo is None or o.text is None else echo[i] + o.text,
                            "logprobs": None if k is None else completion_logprobs(toks, 0, token_text(state)),
                            "finish_reason": o.finish_reason, "simsd": extension(o)})
            if body.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.model_name, "choices": choices, "usage": usage(outs, n)}


def usage(outs, n: int = 1) -> dict:
    """OpenAI's ``usage`` of the outputs ``outs`` (all finished), ``n`` choices per prompt in a
    row: the completion tokens of every choice, the prompt tokens of each prompt once, and
    ``prompt_tokens_details.cached_tokens`` (OpenAI's and vLLM's: the prompt tokens the prefix
    cache held) when there are any."""
    p = sum(len(o.prompt_token_ids) for o in outs[::n])
    c = sum(len(o.token_ids) for o in outs)
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    cached = sum(o.stats.get("cached_prompt_tokens", 0) for o in outs[::n])
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def echo_text(state: ServerState, handle) -> str | None:
    """The prompt's text that ``echo`` puts before a completion's: the prompt as given, or the
    decoded ids of a token id prompt (None without a tokenizer, whose completions have no text)."""
    if isinstance(handle.prompt, str):
        return handle.prompt
    tok = state.llm.tokenizer
    return None if tok is None else tok.decode(handle.prompt_token_ids)


def token_text(state: ServerState):
    """``decode(token_id) -> str`` of the served tokenizer (None without one)."""
    tok = state.llm.tokenizer
    return None if tok is None else (lambda t: tok.decode([t]))


def extension(o) -> dict:
    """A choice's ``simsd`` object: the seed (replay with it), the stop reason, the statistics."""
    return json_safe({"seed": o.seed, "stop_reason": o.stop_reason, "stats": o.stats})


async def disconnected(request: Request) -> None:
    """Return when the client has gone (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(state: ServerState, call: Call, request: Request):
    """The outputs of a non-streaming call, or None when the client disconnects first (then
    its requests are cancelled).

    Raises:
        RequestError: a request failed (the call's other requests are cancelled).
        ServerStopped: the server cancelled the call (shutting down).
    """
    outs = [None] * len(call.handles)
    left = len(outs)
    gone = asyncio.ensure_future(disconnected(request))
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


async def stream(state: ServerState, call: Call, rid: str, created: int, chat: bool, include_usage: bool,
                 echo: list | None = None, k: int | None = None):
    """Server-sent events of a streaming call: with ``echo`` (a completion's) a first chunk per
    choice with its prompt's text (with log-probabilities, ``k`` not None: sent with the choice's
    first event, the prompt's log-probabilities with it), a chunk per finished block with its
    text and, with ``k``, its tokens' log-probabilities (each chunk names its choice by
    ``index``), a final
    chunk per choice (``finish_reason``, ``simsd``; the last one with the usage of all), with
    ``include_usage`` OpenAI's usage-only chunk, then ``data: [DONE]``; an error chunk and
    ``[DONE]`` when a request fails or the server stops the call. While nothing comes for
    ``state.sse_keepalive`` seconds (a request waiting for a row, a slow round) a comment
    ``: keep-alive`` goes out, which SSE clients skip, so that proxies do not take the stream for
    dead. Cancelling it (client gone) cancels the requests."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices, **extra) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": choices}
        body.update(extra)
        return f"data: {json.dumps(body)}\n\n"

    offsets = [0] * len(call.handles)  # the text offset of each choice's next token

    def lp(i, tokens):
        if k is None or not tokens:
            return None
        if chat:
            return chat_logprobs(tokens, k)
        out = completion_logprobs(tokens, offsets[i], token_text(state))
        offsets[i] = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def piece(i, text, finish=None, ext=None, tokens=()) -> dict:
        logprobs = lp(i, tokens)
        c = ({"index": i, "delta": {"content": text} if text else {}, "logprobs": logprobs, "finish_reason": finish}
             if chat else {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
        if ext is not None:
            c["simsd"] = ext
        return c

    outs = [None] * len(call.handles)
    left = len(outs)
    get = None
    echoing = list(echo or ())  # the echo chunks still to send (with log-probabilities: at the choice's first event)

    def echoed(i):
        text, echoing[i] = echoing[i], None
        if k is None:
            return chunk([piece(i, text)]) if text else None
        h = call.handles[i]
        return chunk([piece(i, text or "", tokens=list(zip(h.prompt_token_ids, h.prompt_logprobs())))])

    try:
        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(outs))])
        for i in range(len(echoing) if k is None else 0):
            first = echoed(i)
            if first:
                yield first
        while left:
            get = get or asyncio.ensure_future(call.queue.get())
            done, _ = await asyncio.wait({get}, timeout=state.sse_keepalive)
            if not done:
                yield ": keep-alive\n\n"
                continue
            (i, kind, payload), get = get.result(), None
            if kind == "stopped":
                yield f"data: {json.dumps(error_body(payload, type_='server_error', code='shutting_down'))}\n\n"
                break
            if echoing and kind in ("delta", "done") and echoing[i] is not None:
                first = echoed(i)
                if first:
                    yield first
            if kind == "delta":
                tokens = list(zip(payload[1], payload[2] or ()))
                if payload[0] or (k is not None and tokens):
                    yield chunk([piece(i, payload[0], tokens=tokens)])
            elif kind == "done":
                outs[i] = payload
                left -= 1
                state.observe(payload, time.perf_counter() - call.started)
                extra = {"usage": usage(outs, call.n)} if not left else {}
                yield chunk([piece(i, "", payload.finish_reason, extension(payload))], **extra)
            else:
                message = str(request_failure(call.handles[i].request_id, payload))
                yield f"data: {json.dumps(error_body(message, type_='server_error'))}\n\n"
                call.cancel()
                break
        if include_usage and not left:
            yield chunk([], usage=usage(outs, call.n))
        yield "data: [DONE]\n\n"
    finally:
        if get is not None:
            get.cancel()
        call.cancel()  # no-op for finished requests; a disconnect cancels the task here
