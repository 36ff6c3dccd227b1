"""The OpenAI-compatible HTTP server over an :class:`~simsd.entrypoints.api.LLM` (FastAPI; vLLM's
layout): the app (``api_server``: :func:`~simsd.entrypoints.openai.api_server.build_app`), its
endpoints (``router``), serving one request (``serving``), the shared state and the engine
requests of one HTTP request (``state``), OpenAI's error bodies and the exception handlers
(``errors``), the body limit and the API key (``middleware``), the request bodies (``protocol``)
and the Prometheus metrics (``metrics``). ``simsd serve`` runs it under uvicorn
(:mod:`simsd.entrypoints.serve`).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` gives
server-sent events: one chunk per finished block with its committed text, a final chunk per
choice with ``finish_reason`` and ``usage``, with ``stream_options.include_usage`` OpenAI's
usage-only chunk, then ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text).

Each choice carries a ``simsd`` extension object: ``seed`` (given or fresh: replay with it),
``stop_reason`` and ``stats`` (acceptance rate, forwards per token, ... as ``simsd generate
--json``).

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
input (malformed JSON, unknown fields, unknown model, a prompt longer than the positions allow,
``max_tokens < 1``, ``n > 1``, ``temperature < 0``, ...; ``param`` names the field), 503 with
``Retry-After`` when the scheduler's queue is full or the server is shutting down, 500 when
the request itself failed inside the engine (the other requests go on). A client that
disconnects cancels its requests, which frees their rows before the next round.

Shutdown (:meth:`~simsd.entrypoints.openai.state.ServerState.drain`): new requests get a 503
while the requests in flight finish; those still running at the deadline (or at
:meth:`~simsd.entrypoints.openai.state.ServerState.cancel_calls`) are cancelled and answered
with a 503 (a stream: an error chunk, then ``[DONE]``).
"""
