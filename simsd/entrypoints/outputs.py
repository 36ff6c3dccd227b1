"""What a request of the Python API gives back: :class:`RequestOutput`, the :class:`RequestHandle`
of a submitted request (events, result, cancellation) and the errors of a request."""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

from ..decoding.logprobs import as_vllm
from ..engine.scheduler import Request
from .detokenize import TextStream

log = logging.getLogger(__name__)


class RequestError(RuntimeError):
    """A request failed inside the engine (the other requests go on); ``__cause__`` is the
    original exception."""


class RequestCancelled(RuntimeError):
    """The request was cancelled before it finished."""


def json_safe(x):
    """``x`` for strict JSON: NaN and infinities become null (in dicts and lists too)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def request_failure(request_id: str, error: BaseException | None) -> RuntimeError:
    """The exception of a request that failed (:class:`RequestError`, ``error`` its
    ``__cause__``) or, for ``error`` None, was cancelled (:class:`RequestCancelled`)."""
    if error is None:
        return RequestCancelled(f"request {request_id} was cancelled")
    exc = RequestError(f"request {request_id} failed: {error!r}")
    exc.__cause__ = error
    return exc


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request, as vLLM's ``CompletionOutput`` (:attr:`RequestOutput.outputs`):
    ``index`` (0 to ``n - 1``: the choice), ``text``, ``token_ids``,
    ``finish_reason`` and ``stop_reason`` (the choice's, see :class:`RequestOutput`);
    ``logprobs`` and ``cumulative_logprob`` with ``SamplingParams(logprobs=k)`` (else None; see
    :class:`RequestOutput`); ``lora_request`` is None (simsd has no LoRA adapters)."""
    index: int
    text: str | None
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None
    stop_reason: object = None
    lora_request: object = None

    def finished(self) -> bool:
        """vLLM's: the completion has ended (always, for a returned output)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one request.

    vLLM's ``RequestOutput`` in shape: ``request_id``, ``prompt``, ``prompt_token_ids``,
    :attr:`outputs` (one :class:`CompletionOutput` per choice, ``SamplingParams.n`` of them;
    ``outputs[0].text`` is ``text``) and :attr:`finished` as vLLM names them; ``text``,
    ``token_ids``, ``finish_reason``, ``stop_reason``, ``seed`` and ``stats`` are choice 0's.
    ``other_choices``: with ``n > 1``, the outputs of choices 1 to ``n - 1``, each a
    :class:`RequestOutput` of its own (its seed, :func:`~simsd.config.request.choice_seed` of
    the request's, its statistics; request id ``<request_id>-<i>``); empty for ``n=1``.

    ``prompt``: as given (text, chat messages or ids; vLLM's is the text, None for ids and the
    rendered template for chat); ``prompt_token_ids``: what was decoded
    after; ``text``: the generated text (None without a tokenizer), ending before a stop string
    and without the text of a final stop token; ``token_ids``: generated ids, up to and
    including the stop id (or the token that completed a stop string), at most ``max_tokens``;
    ``finish_reason``: ``stop`` (a stop id or string) or ``length`` (``max_tokens``);
    ``stop_reason``: the stop id or string, None for ``length``; ``seed``: the seed the request
    sampled with (given or fresh); ``stats``: the statistics ``simsd generate --json`` prints
    (``new_tokens``, ``cut_tokens``, ``decode_seconds`` — the rounds from the request's
    admission to its end, shared with the requests in flight, no prefill (its own or
    another's), see :mod:`simsd.engine.scheduler` —, ``tokens_per_second`` (``new_tokens`` /
    ``decode_seconds``), ``target_forwards``, ``target_forwards_per_token``,
    ``prefill_forwards``, ``blocks``; paper/exact add ``draft_forwards``, ``proposed``,
    ``accepted``, ``acceptance_rate``, ``from_draft``, ``draft_share``, ``rounds``,
    ``accepted_per_round``, ``fallback_steps``, ...) plus ``batch_size`` (the engine's rows),
    ``queue_seconds`` (submission to the end of the prefill) and ``time_to_first_token``
    (seconds from submission to the first finished block). ``logprobs`` (vLLM's, with
    ``SamplingParams(logprobs=k)``, else None): per token of ``token_ids`` a dict ``{token_id:
    Logprob(logprob, rank, decoded_token)}`` of the token and the ``k`` most likely ones
    (:class:`simsd.decoding.logprobs.Logprob`; the definition per mode: :mod:`simsd.decoding.logprobs`);
    ``cumulative_logprob``: the sum of the tokens' log-probabilities (None without ``logprobs``);
    ``prompt_logprobs`` (with ``SamplingParams(prompt_logprobs=k)``): per prompt token None (the
    first) or such a dict (:mod:`simsd.decoding.prompt_logprobs`). ``decode_interval``: ``(start,
    end)`` on the scheduler's decode clock; :func:`simsd.engine.scheduler.decode_span` of a run's
    outputs is the run's decode time (the first admission to the last end; prefills excluded).
    """
    request_id: str
    prompt: object
    prompt_token_ids: list
    text: str | None
    token_ids: list
    finish_reason: str
    stop_reason: object
    seed: int
    stats: dict = field(default_factory=dict)
    decode_interval: tuple | None = None
    other_choices: tuple = ()
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None

    @property
    def outputs(self) -> list:
        """vLLM's ``RequestOutput.outputs``: a :class:`CompletionOutput` per choice, made of the
        choices' fields (choice 0's ``text`` and ``token_ids`` are this output's, the same objects)."""
        return [CompletionOutput(i, o.text, o.token_ids, o.cumulative_logprob, o.logprobs, o.finish_reason,
                                 o.stop_reason) for i, o in enumerate((self, *self.other_choices))]

    @property
    def finished(self) -> bool:
        """vLLM's ``RequestOutput.finished``: True (an output is returned when its request ends)."""
        return True


class RequestHandle:
    """A submitted request (:meth:`LLM.submit`): its events, result and cancellation.

    Events, in order: ``("delta", (text, token_ids, logprobs))`` per finished block (``text`` may be
    empty while a character or a possible stop string is incomplete; ``logprobs``: those of
    ``token_ids`` as :attr:`RequestOutput.logprobs` has them, None when not asked for), then one of
    ``("done", RequestOutput)``, ``("error", exception)``, ``("cancelled", None)``. With a
    ``listener`` they are passed to ``listener(kind, payload)`` on the scheduling thread;
    otherwise :meth:`events` yields them. Without a scheduling thread
    (``LLM(scheduler_thread=False)``), :meth:`result` and :meth:`events` run the scheduler's
    rounds on the calling thread until what they wait for has happened.
    """

    def __init__(self, llm, request_id: str, prompt, prompt_ids: list, seed: int, stream: TextStream,
                 listener=None):
        self.llm, self.request_id, self.prompt, self.prompt_token_ids = llm, request_id, prompt, prompt_ids
        self.seed, self.stream, self.listener = seed, stream, listener
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.first_token_at: float | None = None
        self._queue: queue.Queue | None = None if listener is not None else queue.Queue()
        self._done = threading.Event()
        #: the scheduler's :class:`~simsd.engine.scheduler.Request` (set by the request builder)
        self.request: Request | None = None
        #: the row program (a :class:`~simsd.decoding.program.RowProgram`), once admitted
        self.program = None
        #: the prompt's log-probability entries (:func:`simsd.decoding.prompt_logprobs.prompt_logprobs`), when asked for
        self.prompt_entries: list | None = None
        self._blocks: list = []  # the finished blocks' ids delivered so far
        self._replayed = 0  # blocks the current program has finished (a preempted request's starts over)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        """Cancel the request (its row is freed before the next round). False if it had ended."""
        if self.done or self.request is None:
            return False
        return self.llm.driver.cancel(self.request)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the output.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (a scheduling thread only;
                without one the rounds run here until the request ends).
            RequestError: the request failed (``__cause__``: why).
            RequestCancelled: it was cancelled.
        """
        self.llm.driver.drive(lambda: self.done)
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self.error is not None or self.cancelled:
            raise request_failure(self.request_id, self.error)
        return self.output

    def events(self, timeout: float | None = None):
        """Yield ``(kind, payload)`` until the final event (see the class doc); ``timeout``:
        the longest wait for one event (``TimeoutError`` after it)."""
        if self._queue is None:
            raise RuntimeError("this request reports its events to its listener")
        while True:
            self.llm.driver.drive(lambda: not self._queue.empty())
            try:
                kind, payload = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event from request {self.request_id} for {timeout} s") from None
            yield kind, payload
            if kind != "delta":
                return

    # -- the scheduling thread -----------------------------------------------------------
    def _emit(self, kind: str, payload) -> None:
        if self._queue is not None:
            self._queue.put((kind, payload))
            return
        try:
            self.listener(kind, payload)
        except Exception:
            log.exception("simsd: the listener of request %s raised", self.request_id)

    def start(self, program) -> None:
        """A row program of this request starts: the first or, after a preemption, another one,
        which decodes its blocks again (:meth:`on_block`)."""
        self.program, self._replayed = program, 0

    def on_block(self, new_ids: list) -> bool:
        """A finished block's ids (the row program's ``on_block``): True ends the generation.

        A request preempted for KV pages starts over (:meth:`simsd.engine.scheduler.Scheduler._preempt`):
        the blocks delivered before are not delivered again, and must come out the same (keyed
        noise: the tokens depend on the prompt, the parameters and the seed alone).

        Raises:
            RuntimeError: a block decoded again differs from the one delivered.
        """
        k, self._replayed = self._replayed, self._replayed + 1
        if k < len(self._blocks):
            if list(new_ids) != self._blocks[k]:
                raise RuntimeError(f"request {self.request_id} started over after a preemption and decoded block {k} "
                                   f"as {list(new_ids)}, not {self._blocks[k]} as delivered")
            return False
        self._blocks.append(list(new_ids))
        before = len(self.stream.token_ids)
        text = self.stream.push(new_ids)
        kept = self.stream.token_ids[before:]
        if kept and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if kept:
            self._emit("delta", (text, kept, self._logprobs(before, len(self.stream.token_ids))))
        return self.stream.finished

    def _decode(self, token_id: int) -> str | None:
        tok = self.llm.tokenizer
        return None if tok is None else tok.decode([token_id])

    def _logprobs(self, a: int, b: int) -> list | None:
        """vLLM's logprob dicts of generated tokens ``a .. b - 1`` (None when not asked for)."""
        entries = self.program.logprobs
        if entries is None:
            return None
        ids = self.stream.token_ids
        return [as_vllm(ids[i], entries[i], self._decode) for i in range(a, b)]

    def prompt_logprobs(self) -> list | None:
        """vLLM's ``prompt_logprobs`` of the request (None when not asked for), once admitted."""
        if self.prompt_entries is None:
            return None
        return [None if e is None else as_vllm(t, e, self._decode)
                for t, e in zip(self.prompt_token_ids, self.prompt_entries)]

    def on_finish(self, req: Request) -> None:
        """The request ended (the scheduler's ``on_finish``): its final event."""
        if req.cancelled:
            self.cancelled = True
            self.llm.totals.count(self, "cancelled")
            self._emit("cancelled", None)
        elif req.error is not None:
            self.error = req.error
            self.llm.totals.count(self, "error")
            self._emit("error", req.error)
        else:
            try:
                self.output = self._output(req)
            except Exception as exc:  # a fault in the bookkeeping stays with this request too
                self.error = exc
                self.llm.totals.count(self, "error")
                self._emit("error", exc)
            else:
                self.llm.totals.count(self, self.output.finish_reason)
                self._emit("done", self.output)
        self._done.set()

    def _output(self, req: Request) -> RequestOutput:
        rest = self.stream.finish()
        if rest:
            self._emit("delta", (rest, [], None if self.program.logprobs is None else []))
        stats = self.program.stats_for(len(self.stream.token_ids), req.decode_seconds)
        stats["batch_size"] = self.llm.batch_size
        stats["queue_seconds"] = req.admitted - req.arrived
        stats["time_to_first_token"] = (None if self.first_token_at is None
                                        else self.first_token_at - req.arrived)
        logprobs = self._logprobs(0, len(self.stream.token_ids))
        cumulative = None if logprobs is None else sum(e[0] for e in self.program.logprobs[:len(logprobs)])
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.stream.text,
                             list(self.stream.token_ids), self.stream.finish_reason, self.stream.stop_reason,
                             self.seed, stats, req.decode_interval, logprobs=logprobs, cumulative_logprob=cumulative,
                             prompt_logprobs=self.prompt_logprobs())
