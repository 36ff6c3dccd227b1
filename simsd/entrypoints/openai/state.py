"""What the server's endpoints share (:class:`ServerState`, the app's ``state.simsd``) and the
engine requests of one HTTP request from submission to their end (:class:`Call`)."""
from __future__ import annotations

import asyncio
import math
import time
from functools import partial

from starlette.concurrency import run_in_threadpool

from ...config.serving import ROUND_TIMEOUT, SSE_KEEPALIVE
from ..api import LLM
from ..errors import ParamError
from .errors import ServerStopped
from .metrics import Metrics


class ServerState:
    """What the endpoints share: the LLM, the served model name, the metrics, the drain flag and
    the calls in flight (:class:`Call`: from submission until each of their engine requests has
    ended). ``shutdown_llm``: the app's shutdown drains and stops the LLM; ``round_timeout``:
    seconds a scheduler round may run before ``/health`` reports a stuck engine;
    ``sse_keepalive``: seconds between the keep-alive comments of a stream with nothing to send."""

    def __init__(self, llm: LLM, model_name: str, shutdown_llm: bool = True, round_timeout: float = ROUND_TIMEOUT,
                 sse_keepalive: float = SSE_KEEPALIVE):
        self.llm, self.model_name, self.shutdown_llm = llm, model_name, shutdown_llm
        self.round_timeout, self.sse_keepalive = round_timeout, sse_keepalive
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
        """Record a finished request (``seconds``: its latency) in the metrics and the moving
        average behind :meth:`retry_after`."""
        self.metrics.observe(output, seconds)
        self._latency = seconds if self._latency is None else 0.8 * self._latency + 0.2 * seconds

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely (the waiting requests' share of the
        rows at the recent latency), 1 to 60."""
        s = self.llm.scheduler
        est = (self._latency or 1.0) * (s.num_waiting + 1) / max(s.max_rows, 1)
        return int(min(60, max(1, math.ceil(est))))


class Call:
    """The engine requests of one HTTP request (``handles``: one per choice, ``n`` per prompt, submitted by
    :meth:`start` straight to :meth:`simsd.LLM.submit`), their events in one queue: ``(i, kind,
    payload)`` of :class:`~simsd.entrypoints.outputs.RequestHandle`, and ``(None, "stopped",
    message)`` first when the server cancels the call (:meth:`stop`). In ``state.calls`` from
    its start until every engine request has ended."""

    def __init__(self, state: ServerState, loop):
        self.state, self.loop = state, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles = []
        self.n = 1  # choices per prompt
        self.started = time.perf_counter()
        self.submitted = False  # all prompts submitted (or the submission failed)
        self.finished = 0       # engine requests ended (done, error, cancelled)
        self.stopped = False

    @classmethod
    async def start(cls, state: ServerState, items: list, n: int, rid: str, param: str, fit_max_tokens: bool):
        """Submit ``items``, ``(prompt, params)`` of each choice (``n`` per prompt, in a row), from
        a worker thread: tokenization and the size checks of a large prompt never hold up the
        event loop (other clients' streams, ``/health``).

        Raises:
            ParamError: a bad prompt or setting (``param``: ``prompt`` or ``messages`` for the
                prompts), or more choices than the server can ever hold at once (named ``n``
                when ``n > 1``, else the prompts).
            QueueFull, SchedulerClosed, ServerStopped: no room, shutting down.
        """
        call = cls(state, asyncio.get_running_loop())
        call.n = n
        state.calls.add(call)
        try:
            await run_in_threadpool(call._submit, items, rid, param, fit_max_tokens)
        finally:
            call.submitted = True
            call._check_ended()
        return call

    def _submit(self, items: list, rid: str, param: str, fit_max_tokens: bool):
        llm, n = self.state.llm, self.n
        s = llm.scheduler
        room = s.max_rows + s.max_waiting
        if len(items) > room:  # could never be queued at once: not worth a retry
            what = (f"{len(items) // n} prompts x n={n} = {len(items)} completions" if n > 1
                    else f"{len(items)} prompts")
            raise ParamError("n" if n > 1 else param,
                             f"{what} in one request, but this server holds at most {room} at once ({s.max_rows} "
                             f"rows + --max-waiting {s.max_waiting}): send them in several requests")
        try:
            for i, (p, params) in enumerate(items):
                if self.stopped:
                    raise ServerStopped("the server is shutting down")
                try:
                    self.handles.append(llm.submit(p, params, listener=partial(self.put, i),
                                                   request_id=rid if len(items) == 1 else f"{rid}-{i}",
                                                   fit_max_tokens=fit_max_tokens))
                except ParamError as exc:
                    name = param if exc.param in ("prompt", "messages") else exc.param
                    where = f"prompt {i // n}: " if len(items) > n else ""
                    raise ParamError(name, where + exc.template) from None
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
        """Cancel the call's engine requests (those that have ended are left as they are)."""
        for h in self.handles:
            h.cancel()
