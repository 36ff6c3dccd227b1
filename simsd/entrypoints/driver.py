"""Who runs an :class:`~simsd.entrypoints.api.LLM`'s rounds, and what its finished requests add up to.

:class:`Driver` runs the scheduler's rounds on the scheduler's own thread (started by the first
request) or, without one, on whichever thread waits for a result (:meth:`Driver.drive`): a
waiting :meth:`~simsd.entrypoints.outputs.RequestHandle.result` then steps the rounds itself.
:class:`Totals` counts the finished requests for :meth:`LLM.metrics
<simsd.entrypoints.api.LLM.metrics>` and the server's ``/metrics``.
"""
from __future__ import annotations

import atexit
import threading
import weakref

from ..engine.scheduler import QueueFull, Request, Scheduler

#: the schedulers whose thread has been started (an LLM's first request), ended at exit
_STARTED: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """End the scheduling threads of the LLMs never shut down (vLLM's examples leave theirs) when
    the interpreter exits, cancelling what runs: the interpreter's finalization stopping a daemon
    thread aborts the process (``terminate called without an active exception``, exit status 134)."""
    for scheduler in list(_STARTED):
        scheduler.stop(drain=False, timeout=10)


class Driver:
    """The rounds of ``scheduler``: on its own thread when ``threaded`` (:meth:`start`, called by
    the first request), else on the thread that calls :meth:`drive`."""

    def __init__(self, scheduler: Scheduler, threaded: bool):
        self.scheduler, self.threaded = scheduler, threaded
        self._lock = threading.Lock()
        self._drive_lock = threading.Lock()
        self._started = False

    @property
    def started(self) -> bool:
        """The scheduling thread has been started (by the first request)."""
        return self._started

    def start(self) -> None:
        with self._lock:
            if self.threaded and not self._started:
                self.scheduler.start()
                self._started = True
                _STARTED.add(self.scheduler)

    def enqueue(self, request: Request) -> None:
        """Queue ``request``, waiting for room: on the scheduling thread, or by running rounds here."""
        self.start()
        while True:
            try:
                self.scheduler.submit(request, block=self.threaded)
                return
            except QueueFull:
                if self.threaded:
                    raise
                self.drive(lambda: self.scheduler.has_room)

    def drive(self, until) -> None:
        """Without a scheduling thread: run rounds on this thread until ``until()`` holds
        (``RuntimeError`` when the requests run out first). With one: nothing."""
        if self.threaded:
            return
        with self._drive_lock:
            while not until():
                if not self.scheduler.step() and not until():
                    raise RuntimeError("the scheduler ran out of requests before the awaited event")

    def cancel(self, request: Request) -> bool:
        return self.scheduler.cancel(request)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop taking requests; ``drain``: finish the running and waiting ones (else cancel
        them). True when the scheduling thread has ended within ``timeout`` seconds (without
        one: when the rounds left have run here)."""
        ended = self.scheduler.stop(drain=drain, timeout=timeout)
        if not self.threaded:
            with self._drive_lock:
                while self.scheduler.step():
                    pass
        return ended


class Totals:
    """The finished requests of an LLM: ``requests`` by outcome (``stop``, ``length``,
    ``cancelled``, ``error``), ``prompt_tokens``, ``generation_tokens``, ``target_forwards``,
    ``draft_forwards`` (forwards each request's row took part in), ``proposed``, ``accepted``
    (draft tokens, paper/exact)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._totals = {"requests": {"stop": 0, "length": 0, "cancelled": 0, "error": 0}, "prompt_tokens": 0,
                        "generation_tokens": 0, "target_forwards": 0, "draft_forwards": 0, "proposed": 0,
                        "accepted": 0}

    def count(self, handle, outcome: str) -> None:
        """Add a finished :class:`~simsd.entrypoints.outputs.RequestHandle` with ``outcome``."""
        with self._lock:
            t = self._totals
            t["requests"][outcome] += 1
            t["prompt_tokens"] += len(handle.prompt_token_ids)
            t["generation_tokens"] += len(handle.stream.token_ids)
            prog = handle.program
            if prog is not None:
                t["target_forwards"] += prog.row.forwards.get("target", 0)
                t["draft_forwards"] += prog.row.forwards.get("draft", 0)
                counters = getattr(prog, "stats", None)  # SimSD rows count proposals
                if counters is not None:
                    t["proposed"] += counters.proposed
                    t["accepted"] += counters.accepted

    def snapshot(self) -> dict:
        """A copy of the totals."""
        with self._lock:
            return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._totals.items()}
