"""Continuous batching over a :class:`~simsd.engine.batching.BatchEngine` (docs/design.md §6).

The engine has a fixed number of rows (its static KV caches); a :class:`Scheduler` keeps them
busy with a stream of requests:

* **admit** between rounds: while a row is free and a request waits, the row is emptied
  (:meth:`BatchEngine.release`) and its program starts: first the prompt's prefill
  (:meth:`BatchEngine.prefill`: one forward request per chunk of at most the engine's
  ``max_prefill_tokens`` and per model, each run alone over the row, as in a single run), then
  the request's row program;
* **round**: one batched forward of the pending requests of the running rows (the group
  :meth:`BatchEngine.pick` chooses: a prefill chunk of one row, or decoding forwards of several;
  a row's next chunk waits for a decoding round; a request passed over for
  :data:`~simsd.engine.batching.MAX_WAIT` rounds goes first), then every served program
  advances to its next request. A long prompt's prefill is thus interleaved with the other
  rows' decoding: they pause for a chunk's forward at a time, not the whole prompt's;
* **pages** (an engine with a shared KV page pool, :mod:`simsd.engine.pages`): a request is
  admitted only while the pool has the pages of its prompt and one forward free; when a forward's
  rows cannot grow, the most recently admitted request is **preempted** (its row and pages
  freed, queued again at the head; readmitted, it starts over and keyed noise gives it the same
  tokens);
* **retire** at once: a program that returns (or raises, or is cancelled) frees its row in the
  same round, so the next round can admit a waiting request into it.

The rows are bounded by the engine (``max_batch_size`` rows of ``capacity`` tokens each, the
KV memory); the waiting requests by ``max_waiting`` (beyond it :meth:`Scheduler.submit`
raises :class:`QueueFull`, or blocks when asked to). A request's program only ever sees its
own row, its own prefill and its own seed (stateless keyed noise), so its tokens do not depend on what
else is in flight (in float32/float64; docs/exactness.md "Batch invariance").

Faults stay with their request: an exception raised by a row program fails that request
only, as does a program that issues more forward requests than one that progresses can
(:meth:`BatchEngine.max_requests`: it would never end); a batched forward that raises is
undone (row lengths and forward counts; the sampling noise is stateless, so nothing else) and
re-run row by row, so that only the rows whose own forward fails are failed.

Time: :meth:`Scheduler.decode_clock` is a clock that stands still while prompts are prefilled
(each prefill round is bracketed by device synchronisations, so a chunk's device time falls
inside it and the decoding rounds' device time outside). A request's ``decode_seconds`` is the
time of that clock from the end of its prefill to its end: the decoding rounds it took part in
(shared with the requests in flight), no prefill chunk, its own or another's. Over a run, the
clock's span from the first prefill's end to the last end is the run's decode time
(docs/statistics.md "Decode time").

The scheduler is the one driver of row programs: the batch decoders run their prompts through
it on the calling thread (:func:`run_requests`), :class:`simsd.LLM` on its own thread or the
caller's, and the server, ``simsd generate`` and ``simsd bench`` through :class:`simsd.LLM`.
It knows rows and programs, not decoding: a request brings a ``program(row, tail)`` factory
(e.g. a :class:`simsd.decoding.program.RowProgram`'s). It runs on the thread that calls
:meth:`Scheduler.step`, or on its own thread (:meth:`Scheduler.start`); :meth:`submit` and
:meth:`cancel` may be called from any thread. Callbacks run on the scheduling thread (a
waiting request's cancellation: on the cancelling thread).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .batching import BatchEngine
from .pages import PagesExhausted

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The scheduler's waiting queue holds ``max_waiting`` requests: retry later."""


class SchedulerClosed(RuntimeError):
    """The scheduler is stopping or stopped and takes no new requests."""


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One request of a :class:`Scheduler`.

    Args:
        prompt_ids: the prompt's token ids (prefilled into the row on admission).
        program: ``program(row, tail) -> generator``: the row program (yields
            :class:`~simsd.engine.batching.Fwd`, receives logits, returns the result) for
            engine row ``row`` (a fresh :class:`~simsd.engine.batching.Row`) and the prompt
            tail left after the block-aligned prefill.
        capacity: cache tokens the request may write (prompt and generation, whole blocks);
            at most the engine's ``capacity``.
        on_finish: ``on_finish(request)``, called once on the scheduling thread when the
            request ends: ``result`` (the program's return value), ``error`` (an exception)
            or ``cancelled`` is set.
        request_id: a name for logs (default: a counter).
        source: what the request was built from, for the other ranks of a tensor-parallel
            leader to build the same request (:mod:`simsd.engine.tp_rounds`); None otherwise.

    Times (``time.perf_counter()`` seconds): ``arrived`` (submitted), ``admitted`` (its prefill's
    last chunk done, decoding starts; None while it prefills), ``finished``;
    ``decode_interval``: ``(start, end)`` on the scheduler's :meth:`~Scheduler.decode_clock` from
    ``admitted`` (None if it never got there), ``decode_seconds`` its length;
    ``row``: the engine row while running; ``forward_requests``: the forward requests its
    program issued, prefill chunks included (since its last admission); ``preemptions``: the
    times it was stopped for want of KV pages and queued again (:meth:`Scheduler._preempt`);
    ``admission``: its admission's rank (the most recent is preempted first).
    """
    prompt_ids: list
    program: Callable
    capacity: int = 0
    on_finish: Callable | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    source: object = None
    result: object = None
    error: BaseException | None = None
    cancelled: bool = False
    row: int | None = None
    arrived: float | None = None
    admitted: float | None = None
    finished: float | None = None
    decode_interval: tuple | None = None
    forward_requests: int = 0
    preemptions: int = 0
    admission: int = -1

    @property
    def done(self) -> bool:
        return self.finished is not None

    @property
    def decode_seconds(self) -> float:
        """Seconds of decoding, prefills excluded (0 if never admitted)."""
        return 0.0 if self.decode_interval is None else self.decode_interval[1] - self.decode_interval[0]


class Scheduler:
    """Continuous batching of requests over ``engine`` (see the module doc).

    Args:
        engine: a :class:`BatchEngine`; its rows are the batch limit.
        max_waiting: requests that may wait for a row (>= 0); beyond it :meth:`submit`
            refuses with :class:`QueueFull` (or blocks).
        publish: ``publish(cancels, admits)``, called on the scheduling thread with each
            round's inputs before the round runs (a tensor-parallel leader sends them to the
            other ranks: :mod:`simsd.engine.tp_rounds`); None (the default): nothing. A leader
            whose round fails halts: it fails the requests in flight and waiting, takes no new
            ones, and keeps the exception in ``error``.

    Attributes (read from any thread): ``rounds`` (batched forwards run, prefill chunks
    included), ``round_seconds`` (their total wall time, forward and row programs),
    ``prefill_seconds`` (the prefill rounds' total, device-synchronised), ``finished`` (requests ended, by outcome:
    ``ok``, ``error``, ``cancelled``), ``round_started`` (``time.monotonic()`` when the scheduling
    thread's round in progress began, admissions included; None between rounds: a stuck engine
    shows as a round that does not end), ``preemptions`` (requests stopped for want of KV pages).
    """

    def __init__(self, engine: BatchEngine, max_waiting: int = 64, publish: Callable | None = None):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._free = set(range(len(engine.rows)))
        self._running: dict = {}   # row -> Request
        self._pending: dict = {}   # row -> (program, Fwd): the request the row waits on
        self._waited: dict = {}    # row -> rounds its pending request has been passed over
        self._held: set = set()    # rows that ran a prefill chunk since the last decoding round
        self._paused: float | None = None  # perf_counter() when the prefill round under way began
        self._waiting: deque = deque()
        self._cancels: set = set()
        self._admitting: list = []  # taken off the queue by take_inputs, not in a row yet
        self.publish = publish
        self.error: BaseException | None = None  # why a leader halted (see step)
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.rounds = 0
        self.round_seconds = 0.0
        self.prefill_seconds = 0.0
        self.finished = {"ok": 0, "error": 0, "cancelled": 0}
        self.preemptions = 0
        #: preempted requests go back to the queue (a tensor-parallel follower's are dropped)
        self.requeue = True
        self._admissions = itertools.count()
        self.round_started: float | None = None

    # -- any thread ---------------------------------------------------------------------
    @property
    def max_rows(self) -> int:
        return len(self.engine.rows)

    @property
    def num_running(self) -> int:
        """Requests holding a row."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a row."""
        return len(self._waiting)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def has_room(self) -> bool:
        """A request submitted now would be queued, not refused with :class:`QueueFull`."""
        with self._cv:
            return self._room()

    def _room(self) -> bool:
        """Whether the queue takes one more request (under the lock): ``max_waiting`` beyond the
        free rows, counting those a round is admitting."""
        return len(self._waiting) + len(self._admitting) < self.max_waiting + len(self._free)

    def decode_clock(self) -> float:
        """``time.perf_counter()`` less the time spent in prefill rounds (the one under way
        included): a clock that runs while rows decode and stands still while prompts are
        prefilled (see the module doc)."""
        now = time.perf_counter()
        paused = self._paused
        return now - self.prefill_seconds - (0.0 if paused is None else now - paused)

    def submit(self, req: Request, block: bool = False, timeout: float | None = None) -> Request:
        """Queue ``req`` for a row.

        Args:
            block: wait for room in the queue instead of refusing (``timeout`` seconds at
                most, None: no limit).

        Raises:
            QueueFull: ``max_waiting`` requests wait already (and ``block`` is False, or the
                timeout passed).
            SchedulerClosed: :meth:`stop` was called.
            ValueError: ``req.capacity`` exceeds the engine's row capacity, or needs more pages
                than the engine's pool holds.
        """
        if req.capacity > self.engine.capacity:
            raise ValueError(f"request {req.request_id} needs {req.capacity} cache tokens, a row holds "
                             f"{self.engine.capacity}")
        if self.engine.pages is not None:
            self.engine.pages.check_fits(req.request_id, req.capacity)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if self._closed:
                    raise SchedulerClosed("the scheduler was stopped and takes no new requests")
                if self._room():  # free rows take requests at once
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if not block or (left is not None and left <= 0):
                    # the first len(self._free) of the queue take the free rows at the next round: the
                    # rest wait (max_waiting of them when the queue is full)
                    n, rows = len(self._waiting) - len(self._free), self.max_rows
                    raise QueueFull(f"{n} request{'s' * (n != 1)} already waiting for a row (max_waiting="
                                    f"{self.max_waiting}; {rows} row{'s' * (rows != 1)}, all taken)")
                self._cv.wait(left)
            req.arrived = time.perf_counter()
            self._waiting.append(req)
            self._cv.notify_all()
        return req

    def cancel(self, req: Request) -> bool:
        """Cancel ``req``: a waiting request leaves the queue at once, a running one frees its
        row before the next round. Returns False when it had ended already."""
        with self._cv:
            if req.done or req in self._cancels:
                return False
            if req in self._waiting:
                self._waiting.remove(req)
                self._cv.notify_all()
                waiting = True
            else:
                self._cancels.add(req)
                self._cv.notify_all()
                waiting = False
        if waiting:
            req.cancelled = True
            self._end(req)
        return True

    def start(self) -> None:
        """Run the rounds on a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            raise RuntimeError("the scheduler thread is already running")
        self._thread = threading.Thread(target=self._loop, name="simsd-scheduler", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Take no new requests; with ``drain`` finish the running and waiting ones, else
        cancel them; then end the thread. Returns True when the thread has ended (within
        ``timeout`` seconds)."""
        with self._cv:
            self._closed = True
            if not drain:
                dropped = list(self._waiting)
                self._waiting.clear()
                self._cancels.update(self._running.values())
                self._cancels.update(self._admitting)  # running from the round under way
            self._cv.notify_all()
        if not drain:
            for req in dropped:
                req.cancelled = True
                self._end(req)
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """The scheduling thread runs (False before :meth:`start` and after :meth:`stop`)."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._waiting or self._running or self._cancels or self._closed):
                    self._cv.wait()
                if self._closed and not (self._waiting or self._running or self._cancels):
                    return
            try:
                self.round_started = time.monotonic()
                self.step()
            except Exception as exc:  # a fault outside any one request: fail the running ones, go on
                log.exception("simsd scheduler: round failed")
                self._fail_running(exc)
                if self.publish is not None:  # a leader: the ranks may have parted, no round is safe
                    self._halt(exc)
            finally:
                self.round_started = None

    # -- the scheduling thread ------------------------------------------------------------
    def _halt(self, exc: BaseException) -> None:
        """Stop for good after ``exc`` (a tensor-parallel leader's failed round): take no new
        requests and fail the waiting ones with ``exc`` (``error`` keeps it)."""
        with self._cv:
            self._closed = True
            self.error = exc
            dropped = list(self._waiting)
            self._waiting.clear()
            self._cv.notify_all()
        for req in dropped:
            req.error = exc
            self._end(req)

    def step(self) -> bool:
        """One round: drop cancelled rows, admit waiting requests into free rows, run one
        batched forward and advance its rows. Returns True while requests run or wait.

        The round's inputs from other threads (:meth:`take_inputs`) are taken first; with a
        ``publish`` hook (a tensor-parallel leader, :mod:`simsd.engine.tp_rounds`) they are
        handed to it before the round runs (:meth:`run_round`): a hook that raises ends the
        requests to admit with its exception and re-raises."""
        cancels, admits = self.take_inputs()
        if self.publish is not None:
            try:
                self.publish(cancels, admits)
            except BaseException as exc:
                with self._cv:
                    self._admitting = []
                for req in admits:
                    req.error = exc
                    self._end(req)
                raise
        return self.run_round(cancels, admits)

    def take_inputs(self) -> tuple[list, list]:
        """``(cancels, admits)``: the running requests cancelled since the last round and the
        waiting requests this round admits (first come, as many as rows will be free), taken
        off the queue (the scheduling thread)."""
        with self._cv:
            cancels, self._cancels = self._cancels, set()
            cancels = [r for r in cancels if r.row is not None and self._running.get(r.row) is r]
            n = min(len(self._waiting), len(self._free) + len(cancels))
            pages = self.engine.pages
            budget = None if pages is None else pages.free_after([r.row for r in cancels])
            admits = []
            while len(admits) < n:  # first come; with a pool, while the pages of their prompts are free
                if budget is not None:
                    need = pages.admission_pages(len(self._waiting[0].prompt_ids))
                    if need > budget and (admits or len(self._running) > len(cancels)):
                        break
                    budget -= need
                admits.append(self._waiting.popleft())
            self._admitting = list(admits)
            if admits:
                self._cv.notify_all()  # room in the queue
        return cancels, admits

    def run_round(self, cancels: list, admits: list) -> bool:
        """One round with these inputs (:meth:`take_inputs`, or a tensor-parallel leader's,
        rebuilt by another rank: the same inputs give the same round on every rank): retire
        ``cancels``, admit ``admits`` into the lowest free rows, run one batched forward and
        advance its rows. Returns True while requests run or wait."""
        for req in cancels:
            if req.row is not None and self._running.get(req.row) is req:
                entry = self._pending.pop(req.row, None)
                req.cancelled = True
                self._retire(req.row, prog=None if entry is None else entry[0])
        with self._cv:
            self._admitting = list(admits)  # (a follower's: rebuilt, never queued here)
        for req in admits:
            self._admit(req)
        if self._pending:
            name, mode, rows = self.engine.pick(self._pending, self._waited, frozenset(self._held))
            reqs = self._make_room(name, {i: self._pending[i][1] for i in rows})
            if not reqs:  # every request of the forward was preempted: the next round picks again
                return bool(self._running or self._waiting)
            rows = sorted(reqs)
            prefill = any(r.prefill for r in reqs.values())
            if prefill:  # off the decode clock: the rounds so far end on it, the chunk's device time off it
                self.engine.synchronize()
            start = time.perf_counter()
            if prefill:
                self._paused = start
            undo = self._snapshot(name, reqs)
            try:
                outs, failed = self.engine.forward(name, mode, reqs), {}
            except Exception as exc:
                outs, failed = self._row_by_row(name, reqs, undo, exc)
            for i in rows:
                prog = self._pending.pop(i)[0]
                error = failed[i] if i in failed else self._over_limit(i)
                if error is not None:
                    self._retire(i, error=error, prog=prog)
                else:
                    self._advance(i, prog, outs[i])
            if prefill:
                self.engine.synchronize()
            end = time.perf_counter()
            if prefill:
                self.prefill_seconds += end - start
                self._paused = None
                self._held.update(rows)
            else:
                self._held.clear()
            self.rounds += 1
            self.round_seconds += end - start
            self._waited = {i: 0 if i in rows else self._waited.get(i, 0) + 1 for i in self._pending}
        return bool(self._running or self._waiting)

    def run_until_idle(self, max_rounds: int | None = None) -> None:
        """Step until no request runs or waits (on this thread; not with :meth:`start`)."""
        n = 0
        while self.step():
            n += 1
            if max_rounds is not None and n >= max_rounds:
                raise RuntimeError(f"still busy after {max_rounds} rounds")

    def _make_room(self, name: str, reqs: dict) -> dict:
        """With a pool: take the pages model ``name``'s forward of ``reqs`` writes
        (:meth:`BatchEngine.reserve`), preempting the most recently admitted running request
        while the pool is short (:meth:`_preempt`); returns the requests left (all of them
        without a pool or when the pages were there)."""
        while reqs:
            try:
                self.engine.reserve(name, reqs)
                return reqs
            except PagesExhausted:
                victim = max(self._running, key=lambda i: self._running[i].admission)
                self._preempt(victim)
                reqs = {i: r for i, r in reqs.items() if i != victim}
        return reqs

    def _preempt(self, i: int) -> None:
        """Stop row ``i``'s request for want of pages: its program is closed, its row and pages
        freed, and it waits again at the head of the queue (a tensor-parallel follower's is
        dropped: the leader admits it again). Readmitted, it starts over from its prompt: keyed
        noise gives it the same tokens, and its blocks delivered already are not delivered again
        (:class:`simsd.entrypoints.outputs.RequestHandle`)."""
        req = self._running.pop(i)
        entry = self._pending.pop(i, None)
        self._waited.pop(i, None)
        self._held.discard(i)
        if entry is not None:
            try:
                entry[0].close()
            except Exception:
                pass
        self.engine.release(i)
        req.row, req.admitted, req.decode_interval, req.forward_requests = None, None, None, 0
        req.preemptions += 1
        self.preemptions += 1
        log.info("simsd scheduler: request %s preempted for KV pages (%d free)", req.request_id,
                 self.engine.pages.free_pages)
        with self._cv:
            self._free.add(i)
            if self.requeue:
                self._waiting.appendleft(req)
            self._cv.notify_all()

    def _admit(self, req: Request) -> None:
        """Start ``req``'s program (:meth:`_prefilled`) in the lowest free row (low rows first:
        forwards cover a short row range)."""
        with self._cv:
            index = min(self._free)
            self._free.discard(index)
            self._admitting.remove(req)
            req.row = index
            req.admission = next(self._admissions)
            self._running[index] = req
        try:
            row = self.engine.release(index)
        except Exception as exc:
            self._retire(index, error=exc)
            return
        self._advance(index, self._prefilled(req, row), None)

    def _prefilled(self, req: Request, row):
        """``req``'s program on ``row``: the prompt's prefill (:meth:`BatchEngine.prefill`), then
        (``admitted``, the start of ``decode_interval``) the request's own row program, built
        with the prompt tail."""
        tail = yield from self.engine.prefill(row.index, req.prompt_ids)
        prog = req.program(row, tail)
        req.admitted = time.perf_counter()
        req.decode_interval = (self.decode_clock(),) * 2
        return (yield from prog)

    def _over_limit(self, i: int) -> RuntimeError | None:
        """Count a served request of row ``i``; the error of a program past
        :meth:`BatchEngine.max_requests` (it makes no progress), else None."""
        req = self._running[i]
        req.forward_requests += 1
        limit = self.engine.max_requests()
        if req.forward_requests <= limit:
            return None
        return RuntimeError(f"row {i}: {req.forward_requests} forward requests without finishing (a program that "
                            f"progresses needs at most {limit} for {self.engine.capacity} tokens)")

    def _advance(self, i: int, prog, value) -> None:
        try:
            self._pending[i] = (prog, prog.send(value))
        except StopIteration as stop:
            self._running[i].result = stop.value
            self._retire(i)
        except Exception as exc:
            self._retire(i, error=exc)

    def _retire(self, i: int, error: BaseException | None = None, prog=None) -> None:
        """Free row ``i`` at once and end its request."""
        req = self._running.pop(i)
        self._pending.pop(i, None)
        self._waited.pop(i, None)
        self._held.discard(i)
        if prog is not None:
            try:
                prog.close()
            except Exception:  # a program that fails while closing is ended all the same
                pass
        self.engine.release(i, offer=error is None)
        with self._cv:
            self._free.add(i)
            self._cv.notify_all()
        req.error = error
        if error is not None:
            log.warning("simsd scheduler: request %s failed: %r", req.request_id, error)
        self._end(req)

    def _end(self, req: Request) -> None:
        req.finished = time.perf_counter()
        if req.decode_interval is not None:
            req.decode_interval = (req.decode_interval[0], self.decode_clock())
        self.finished["cancelled" if req.cancelled else "error" if req.error is not None else "ok"] += 1
        if req.on_finish is not None:
            try:
                req.on_finish(req)
            except Exception:
                log.exception("simsd scheduler: on_finish of request %s raised", req.request_id)

    def _snapshot(self, name: str, reqs: dict) -> tuple:
        """What a failed batched forward of ``reqs`` must undo: the rows' cache lengths, forward
        counts and query tokens of model ``name`` and the engine's batched-forward count."""
        rows = self.engine.rows
        return self.engine.forwards[name], {i: (rows[i].cached[name], rows[i].forwards[name],
                                                rows[i].query_tokens[name]) for i in reqs}

    def _row_by_row(self, name: str, reqs: dict, undo: tuple, exc: Exception) -> tuple:
        """After a batched forward failed with ``exc``: ``(outs, failed)`` of the rows run one by
        one from the state before it, ``failed[row]`` the exception of each row whose own
        forward fails."""
        if len(reqs) == 1:
            return {}, {i: exc for i in reqs}
        log.warning("simsd scheduler: a forward of %d rows failed (%r); running them one by one", len(reqs), exc)
        batched, rows = undo
        self.engine.forwards[name] = batched
        outs, failed = {}, {}
        for i, r in reqs.items():
            row = self.engine.rows[i]
            cached, forwards, tokens = rows[i]
            row.cached[name], row.forwards[name], row.query_tokens[name] = cached, forwards, tokens
            self.engine.caches[name].seqlens[i] = cached
            try:
                outs.update(self.engine.forward(name, r.mask_mode, {i: r}))
            except Exception as err:
                failed[i] = err
        return outs, failed

    def _fail_running(self, exc: BaseException) -> None:
        for i in list(self._running):
            entry = self._pending.get(i)
            self._retire(i, error=exc, prog=None if entry is None else entry[0])


def decode_span(requests) -> float:
    """The decode time of a run of requests of one scheduler (anything with a
    ``decode_interval``): the span of the decode clock from the first prefill's end to the last
    end; prefill rounds excluded (docs/statistics.md "Decode time")."""
    spans = [r.decode_interval for r in requests if r.decode_interval is not None]
    return max(b for _, b in spans) - min(a for a, _ in spans) if spans else 0.0


def run_requests(engine: BatchEngine, requests: list) -> None:
    """Run ``requests`` to their end on this thread, through a fresh :class:`Scheduler` over
    ``engine`` (all queued before the first round, admitted in order while rows are free).

    Raises:
        the first failed request's exception (after every request has ended).
    """
    sched = Scheduler(engine, max_waiting=len(requests))
    for req in requests:
        sched.submit(req)
    sched.run_until_idle()
    for req in requests:
        if req.error is not None:
            raise req.error
