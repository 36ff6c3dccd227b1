"""The Python API: :class:`LLM` (vLLM's offline API in shape) over the continuous-batching
scheduler.

::

    import simsd
    llm = simsd.LLM()                                   # the bundled tiny pair, exact mode
    outs = llm.generate(["Hello", [{"role": "user", "content": "Hi"}]], simsd.SamplingParams(max_tokens=32))
    print(outs[0].text, outs[0].finish_reason, outs[0].stats["acceptance_rate"])
    for piece in llm.stream("Once upon a time", simsd.SamplingParams(temperature=0.8, seed=1)):
        print(piece, end="")

An :class:`LLM` owns one :class:`~simsd.engine.batching.BatchEngine` (``batch_size`` rows of
``max_model_len`` tokens, for the target and, in paper/exact mode, the draft) and one
:class:`~simsd.engine.scheduler.Scheduler` thread that admits requests into free rows
between rounds. Every request runs the same row program as ``simsd generate`` (vanilla
decoding, or SimSD's rounds) with the keyed noise of its own seed, so its output
does not depend on what else is in flight (float32/float64; see "Batch invariance" in the
README) and equals the CLI's for the same settings and seed. Methods may be called from
any thread.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decoding.config import check_prompt
from ..decoding.vanilla import vanilla_program, vanilla_stats
from ..engine.batching import BatchEngine
from ..engine.scheduler import QueueFull, Request, Scheduler, SchedulerClosed  # noqa: F401  (re-exported)
from ..models.loading import Checkpoint, load_checkpoint
from ..speculative.decoder import SpeculativeDecoder, check_pair
from .detokenize import TextStream
from .errors import ParamError
from .params import SamplingParams, Settings, resolve

log = logging.getLogger(__name__)

MODES = ("vanilla", "paper", "exact")


class RequestError(RuntimeError):
    """A request failed inside the engine (the other requests go on); ``__cause__`` is the
    original exception."""


class RequestCancelled(RuntimeError):
    """The request was cancelled before it finished."""


@dataclass
class RequestOutput:
    """The result of one request.

    ``prompt``: as given (text, chat messages or ids); ``prompt_token_ids``: what was decoded
    after; ``text``: the generated text (None without a tokenizer), ending before a stop string
    and without the text of a final stop token; ``token_ids``: generated ids, up to and
    including the stop id (or the token that completed a stop string), at most ``max_tokens``;
    ``finish_reason``: ``stop`` (a stop id or string) or ``length`` (``max_tokens``);
    ``stop_reason``: the stop id or string, None for ``length``; ``seed``: the seed the request
    sampled with (given or fresh); ``stats``: the statistics ``simsd generate --json`` prints
    (``new_tokens``, ``decode_seconds`` — from admission to the end, shared with the requests
    in flight —, ``tokens_per_second``, ``target_forwards``, ``target_forwards_per_token``,
    ``prefill_forwards``, ``blocks``; paper/exact add ``draft_forwards``, ``proposed``,
    ``accepted``, ``acceptance_rate``, ``rounds``, ``accepted_per_round``, ``fallback_steps``,
    ...) plus ``batch_size`` (the engine's rows), ``queue_seconds`` (submission to the end
    of the prefill) and ``time_to_first_token`` (seconds from submission to the first
    finished block).
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


class RequestHandle:
    """A submitted request (:meth:`LLM.submit`): its events, result and cancellation.

    Events, in order: ``("delta", (text, token_ids))`` per finished block (``text`` may be
    empty while a character or a possible stop string is incomplete), then one of
    ``("done", RequestOutput)``, ``("error", exception)``, ``("cancelled", None)``. With a
    ``listener`` they are passed to ``listener(kind, payload)`` on the scheduling thread;
    otherwise :meth:`events` yields them.
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
        self._request: Request | None = None
        self._row = None      # the engine row (vanilla) or SimSD row state, once admitted
        self._stats = None    # (row, n, blocks, seconds) -> stats

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        """Cancel the request (its row is freed before the next round). False if it had ended."""
        if self.done or self._request is None:
            return False
        return self.llm.scheduler.cancel(self._request)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the output.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            RequestError: the request failed (``__cause__``: why).
            RequestCancelled: it was cancelled.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self.error is not None:
            raise RequestError(f"request {self.request_id} failed: {self.error!r}") from self.error
        if self.cancelled:
            raise RequestCancelled(f"request {self.request_id} was cancelled")
        return self.output

    def events(self, timeout: float | None = None):
        """Yield ``(kind, payload)`` until the final event (see the class doc); ``timeout``:
        the longest wait for one event (``TimeoutError`` after it)."""
        if self._queue is None:
            raise RuntimeError("this request reports its events to its listener")
        while True:
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

    def _on_block(self, new_ids: list) -> bool:
        before = len(self.stream.token_ids)
        text = self.stream.push(new_ids)
        kept = self.stream.token_ids[before:]
        if kept and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if kept:
            self._emit("delta", (text, kept))
        return self.stream.finished

    def _on_finish(self, req: Request) -> None:
        if req.cancelled:
            self.cancelled = True
            self.llm._count(self, "cancelled", req)
            self._emit("cancelled", None)
        elif req.error is not None:
            self.error = req.error
            self.llm._count(self, "error", req)
            self._emit("error", req.error)
        else:
            try:
                self.output = self._output(req)
            except Exception as exc:  # a fault in the bookkeeping stays with this request too
                self.error = exc
                self.llm._count(self, "error", req)
                self._emit("error", exc)
            else:
                self.llm._count(self, self.output.finish_reason, req)
                self._emit("done", self.output)
        self._done.set()

    def _output(self, req: Request) -> RequestOutput:
        generated, blocks = req.result
        rest = self.stream.finish()
        if rest:
            self._emit("delta", (rest, []))
        n = len(self.stream.token_ids)
        stats = self._stats(self._row, n, blocks, req.finished - req.admitted, len(generated) - n)
        stats["batch_size"] = self.llm.batch_size
        stats["queue_seconds"] = req.admitted - req.arrived
        stats["time_to_first_token"] = (None if self.first_token_at is None
                                        else self.first_token_at - req.arrived)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.stream.text,
                             list(self.stream.token_ids), self.stream.finish_reason, self.stream.stop_reason,
                             self.seed, stats)


def _is_messages(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)


def _is_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in x)


def _device(name: str, value) -> torch.device:
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name} {value!r} is not a device name (cpu, cuda, cuda:1, ...)") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {value}: no CUDA device is available (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {value}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"{name} {value}: only cpu and cuda devices are supported")
    return dev


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V one cached token takes in ``model`` (all layers)."""
    c = model.config
    return 2 * c.num_hidden_layers * model.num_local_kv_heads * c.head_dim * model.dtype.itemsize


class LLM:
    """SDAR decoding (vanilla, or SimSD paper/exact) behind a request API with continuous batching.

    Args:
        target: checkpoint directory (HF format) or a loaded
            :class:`~simsd.models.loading.Checkpoint`; None: the bundled tiny target.
        draft: the same for the draft (paper/exact); None: the bundled tiny draft.
        mode: ``vanilla`` | ``paper`` | ``exact`` (see the README's "Decoding modes").
        device, draft_device: ``cpu``, ``cuda``, ``cuda:1`` ... (default: cuda when available;
            the draft's: the target's). Ignored for loaded checkpoints.
        dtype: ``float32`` | ``bfloat16`` | ``float16`` (default: bfloat16 on cuda, float32 on
            cpu). Ignored for loaded checkpoints.
        batch_size: the most requests decoded together (engine rows).
        max_model_len: the most positions a request may use (prompt + ``max_tokens``); default
            the models' ``max_position_embeddings``. Each row's KV cache holds this many tokens.
        kv_cache_memory: bytes the KV caches (target and draft) may take; the rows are cut to
            fit (``ValueError`` if not even one fits). None: ``batch_size`` rows.
        max_waiting: requests that may wait for a row; beyond it :meth:`submit` raises
            :class:`~simsd.engine.scheduler.QueueFull` (``generate`` and ``stream`` wait instead).
        block_length: B (default: the target's ``block_size``, 4 if unset).
        fold_commit, on_reject, rope_copy, optimistic: as ``simsd generate``'s
            ``--fold-commit``, ``--on-reject``, ``--no-rope-copy``, ``--optimistic``.
        attention_backend: ``auto | cuda | triton | torch``.
        cuda_graphs: replay the forwards as CUDA graphs (CUDA devices only).
        default_params: the :class:`SamplingParams` of requests that give none.

    Raises:
        ValueError: a bad mode, device, block length, size or option combination (the message
            names it); :class:`~simsd.models.config.CheckpointError` for a bad checkpoint; a
            draft whose tokenizer differs from the target's.
    """

    def __init__(self, target=None, draft=None, mode: str = "exact", *, device=None, draft_device=None,
                 dtype=None, batch_size: int = 8, max_model_len: int | None = None,
                 kv_cache_memory: int | None = None, max_waiting: int = 64, block_length: int | None = None,
                 fold_commit: bool = False, on_reject: str = "redraft", rope_copy: bool = True,
                 optimistic: bool | None = None, attention_backend: str = "auto", cuda_graphs: bool = False,
                 default_params: SamplingParams | None = None):
        from ..assets import DEFAULT_DRAFT, DEFAULT_TARGET
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        for name, value in (("batch_size", batch_size), ("max_waiting", max_waiting)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "batch_size" else 0):
                raise ValueError(f"{name} must be an integer >= {1 if name == 'batch_size' else 0}, got {value!r}")
        if on_reject not in ("redraft", "fallback"):
            raise ValueError(f"on_reject must be 'redraft' or 'fallback', got {on_reject!r}")
        if mode == "vanilla":
            given = [n for n, v in (("draft", draft), ("draft_device", draft_device), ("optimistic", optimistic))
                     if v is not None] + (["on_reject"] if on_reject != "redraft" else [])
            if given:
                raise ValueError(f"{', '.join(given)}: used by the paper and exact modes only (mode is vanilla)")
        if not rope_copy and mode != "paper":
            raise ValueError("rope_copy=False is an ablation of paper mode")
        self.mode = mode
        device = _device("device", device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if draft_device is not None:
            draft_device = _device("draft_device", draft_device)
        dtype = dtype or ("bfloat16" if device.type == "cuda" else "float32")
        self.target = self._load(target or DEFAULT_TARGET, dtype, device, attention_backend)
        self.draft = None
        if mode != "vanilla":
            self.draft = self._load(draft or DEFAULT_DRAFT, dtype, draft_device or device, attention_backend)
            check_pair(self.target, self.draft)
        self.models = [m for m in (self.target, self.draft) if m is not None]
        tc = self.target.config
        B = block_length if block_length is not None else (tc.block_size or 4)
        limit = min(m.config.max_position_embeddings for m in self.models)
        if isinstance(B, bool) or not isinstance(B, int) or not 1 <= B < limit:
            raise ValueError(f"block_length must be an integer in [1, {limit}), got {B!r}")
        if max_model_len is None:
            max_model_len = limit
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not B < max_model_len <= limit:
            raise ValueError(f"max_model_len must be an integer in ({B}, {limit}] (the models' positions), "
                             f"got {max_model_len!r}")
        self.max_model_len = max_model_len
        self.settings = Settings(mode, B, tc.vocab_size, fold_commit, on_reject, rope_copy, optimistic)
        capacity = -(-max_model_len // B) * B + B
        margin = 2 * B if mode == "vanilla" else (B + 2) * B  # the longest query of a row (gamma <= B)
        per_row = sum(kv_bytes_per_token(m.model) for m in self.models) * (capacity + margin)
        rows = batch_size
        if kv_cache_memory is not None:
            rows = min(batch_size, int(kv_cache_memory // per_row))
            if rows < 1:
                raise ValueError(f"kv_cache_memory {kv_cache_memory / 2**30:.2f} GiB holds no row of "
                                 f"{max_model_len} tokens ({per_row / 2**30:.2f} GiB per row); lower max_model_len")
        self.kv_cache_bytes = rows * per_row
        engine_models = {"target": self.target.model}
        if self.draft is not None:
            engine_models["draft"] = self.draft.model
        try:
            self.engine = BatchEngine(engine_models, B, rows, capacity, margin, cuda_graphs=cuda_graphs)
        except RuntimeError as exc:  # torch.OutOfMemoryError among them
            if "out of memory" not in str(exc).lower():
                raise
            raise ValueError(f"the KV caches of {rows} rows x {max_model_len} positions "
                             f"({self.kv_cache_bytes / 2**30:.1f} GiB) do not fit: lower batch_size or "
                             f"max_model_len, or set kv_cache_memory") from None
        self.scheduler = Scheduler(self.engine, max_waiting)
        self.tokenizer = self.target.tokenizer
        self.default_params = default_params if default_params is not None else SamplingParams()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._started = False
        self.totals = {"requests": {"stop": 0, "length": 0, "cancelled": 0, "error": 0}, "prompt_tokens": 0,
                       "generation_tokens": 0, "target_forwards": 0, "draft_forwards": 0, "proposed": 0,
                       "accepted": 0}

    @staticmethod
    def _load(spec, dtype, device, backend) -> Checkpoint:
        if isinstance(spec, Checkpoint):
            return spec
        ckpt = load_checkpoint(Path(spec), dtype=dtype, device=device)
        ckpt.model.attention_backend = backend
        return ckpt

    # -- properties ------------------------------------------------------------------------
    @property
    def block_length(self) -> int:
        return self.settings.block_length

    @property
    def started(self) -> bool:
        """The scheduling thread has been started (by the first request)."""
        return self._started

    @property
    def batch_size(self) -> int:
        """Engine rows (``batch_size``, or fewer when ``kv_cache_memory`` holds fewer)."""
        return len(self.engine.rows)

    # -- requests ------------------------------------------------------------------------------
    def prompt_ids(self, prompt) -> list:
        """Token ids of ``prompt``: a string (encoded as it is, no chat template), a list of chat
        messages (``[{"role": ..., "content": ...}, ...]``, the checkpoint's chat template with
        the generation prompt) or a list of token ids.

        Raises:
            ParamError: an empty prompt, no tokenizer (or chat template) for text, bad messages,
                ids outside the vocabulary or equal to the mask id (``param``: ``prompt`` or
                ``messages``).
        """
        tok, V = self.tokenizer, self.target.config.vocab_size
        if isinstance(prompt, str):
            if not prompt:
                raise ParamError("prompt", "the prompt is empty")
            if tok is None:
                raise ParamError("prompt", "this checkpoint has no tokenizer: give token ids")
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
        elif _is_messages(prompt):
            for m in prompt:
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ParamError("messages", f"each message needs a string 'role' and 'content', got {m!r}")
            if tok is None or not getattr(tok, "chat_template", None):
                raise ParamError("messages", "this checkpoint has no chat template: give a text prompt or ids")
            text = tok.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        elif _is_ids(prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ParamError("prompt", f"token id {bad[0]} is outside the vocabulary [0, {V})")
        else:
            raise ParamError("prompt", f"a prompt is a string, a list of chat messages or a list of token ids, "
                                       f"got {type(prompt).__name__}")
        if not ids:
            raise ParamError("prompt", "the prompt encodes to no tokens")
        if self.target.mask_token_id in ids:
            raise ParamError("prompt", f"the prompt holds the mask token (id {self.target.mask_token_id}), "
                                       f"which would be decoded as a position to fill")
        return ids

    def _capacity(self, ids: list, max_tokens: int) -> int:
        P, L = len(ids), self.max_model_len
        if P >= L:
            raise ParamError("prompt", f"prompt of {P} tokens is longer than max_model_len {L} - 1")
        if P + max_tokens > L:
            raise ParamError("max_tokens", f"prompt ({P} tokens) + max_tokens ({max_tokens}) exceeds "
                                           f"max_model_len {L}")
        cap = 0
        for m in self.models:
            try:
                cap = max(cap, check_prompt(ids, m.config, max_tokens, self.block_length))
            except ValueError as exc:
                raise ParamError("max_tokens", str(exc)) from None
        return cap

    def submit(self, prompt, params: SamplingParams | None = None, *, listener=None, block: bool = False,
               request_id: str | None = None) -> RequestHandle:
        """Queue one request; returns its :class:`RequestHandle` at once.

        ``listener(kind, payload)``: receives the events on the scheduling thread (see
        :class:`RequestHandle`); ``block``: wait for room in a full queue instead of refusing.

        Raises:
            ParamError: a bad prompt or parameter (``param`` names it).
            QueueFull: ``max_waiting`` requests wait already (and ``block`` is False).
            SchedulerClosed: :meth:`shutdown` was called.
        """
        ids = self.prompt_ids(prompt)
        params = self.default_params if params is None else params
        cfg, spec, seed = resolve(params, self.settings)
        capacity = self._capacity(ids, params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise ParamError("stop", "stop strings need a tokenizer (this checkpoint has none)")
        stop_ids = ([] if params.ignore_eos else list(self.target.stop_ids)) + list(params.stop_token_ids)
        stream = TextStream(self.tokenizer, stop_ids, params.stop, params.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(self, rid, prompt, ids, seed, stream, listener)
        mask_id = self.target.mask_token_id
        if spec is None:
            def program(row, tail):
                handle._row = row
                return vanilla_program(row, tail, cfg, mask_id, stop_ids, seed, handle._on_block)
            handle._stats = vanilla_stats
        else:
            dec = SpeculativeDecoder(self.target, self.draft, cfg, spec, check=False)

            def program(row, tail):
                handle._row = dec.new_row(row, seed, stop_ids)
                return handle._row.program(tail, handle._on_block)
            handle._stats = dec.row_stats
        handle._request = Request(ids, program, capacity, on_finish=handle._on_finish, request_id=rid)
        self._start()
        self.scheduler.submit(handle._request, block=block)
        return handle

    def _start(self) -> None:
        with self._lock:
            if not self._started:
                self.scheduler.start()
                self._started = True

    def _count(self, handle: RequestHandle, outcome: str, req: Request) -> None:
        with self._lock:
            t = self.totals
            t["requests"][outcome] += 1
            t["prompt_tokens"] += len(handle.prompt_token_ids)
            t["generation_tokens"] += len(handle.stream.token_ids)
            r = handle._row
            if r is not None:
                row = getattr(r, "row", r)
                t["target_forwards"] += row.forwards.get("target", 0)
                t["draft_forwards"] += row.forwards.get("draft", 0)
                if hasattr(r, "stats"):
                    t["proposed"] += r.stats.proposed
                    t["accepted"] += r.stats.accepted

    def generate(self, prompts, params=None, use_tqdm: bool = False) -> list:
        """Decode ``prompts`` (one prompt or a list of them; see :meth:`prompt_ids` for the
        forms) with ``params`` (one :class:`SamplingParams` for all, or a list, one per prompt;
        None: ``default_params``); returns one :class:`RequestOutput` per prompt, in order.
        The requests are batched continuously (at most ``batch_size`` at a time).

        Raises:
            ParamError: a bad prompt or parameter (the message names the prompt's index).
            RequestError: a request failed (the others are cancelled).
        """
        single = not isinstance(prompts, (list, tuple)) or _is_ids(prompts) or _is_messages(prompts)
        items = [prompts] if single else list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(items):
                raise ParamError("params", f"{len(params)} params for {len(items)} prompts")
            plist = list(params)
        else:
            plist = [params] * len(items)
        handles = []
        try:
            for i, (p, sp) in enumerate(zip(items, plist)):
                try:
                    handles.append(self.submit(p, sp, block=True))
                except ParamError as exc:
                    if single:
                        raise
                    raise ParamError(exc.param, f"prompt {i}: {exc}") from None
            bar = None
            if use_tqdm:
                from tqdm import tqdm
                bar = tqdm(total=len(handles), desc=f"simsd {self.mode}", unit="req")
            outs = []
            for h in handles:
                outs.append(h.result())
                if bar is not None:
                    bar.update()
            if bar is not None:
                bar.close()
            return outs
        finally:
            for h in handles:
                h.cancel()  # nothing for finished ones; the rest when one failed or on KeyboardInterrupt

    def stream(self, prompt, params: SamplingParams | None = None, timeout: float | None = None):
        """Yield the generated text of one request in increments as its blocks finish (committed
        tokens only; a multi-byte character is never split; nothing of a stop string or
        after it). Closing the iterator early cancels the request.

        Raises:
            ParamError: as :meth:`submit`; also when the checkpoint has no tokenizer.
            RequestError: the request failed.
        """
        if self.tokenizer is None:
            raise ParamError("prompt", "streaming text needs a tokenizer (this checkpoint has none)")
        handle = self.submit(prompt, params, block=True)
        try:
            for kind, payload in handle.events(timeout):
                if kind == "delta":
                    if payload[0]:
                        yield payload[0]
                elif kind == "error":
                    raise RequestError(f"request {handle.request_id} failed: {payload!r}") from payload
        finally:
            handle.cancel()

    # -- state ---------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """A snapshot: ``running``, ``waiting``, ``rows``, ``rounds``, ``round_seconds``,
        ``batched_forwards`` (per model) and the totals of finished requests
        (``requests`` by outcome, ``prompt_tokens``, ``generation_tokens``, ``target_forwards``,
        ``draft_forwards``, ``proposed``, ``accepted``)."""
        s = self.scheduler
        with self._lock:
            totals = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.totals.items()}
        return {"running": s.num_running, "waiting": s.num_waiting, "rows": self.batch_size, "rounds": s.rounds,
                "round_seconds": s.round_seconds, "batched_forwards": dict(self.engine.forwards), **totals}

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop taking requests; ``drain``: finish the running and waiting ones (else cancel
        them). Returns True when the scheduling thread has ended within ``timeout`` seconds."""
        return self.scheduler.stop(drain=drain, timeout=timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown(drain=exc[0] is None)
