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
:class:`~simsd.engine.scheduler.Scheduler` that admits requests into free rows between
rounds. The scheduler runs on its own thread (the default: requests from any thread,
streaming while others decode; the server's way), or with ``scheduler_thread=False`` on the
thread that waits for a result: a :meth:`LLM.generate` call then queues all its requests
before the first round, so the rounds, and which rows share each forward, are the same in
every run (``simsd generate`` and ``simsd bench`` run this way, as do tensor-parallel ranks,
which must run the same forwards). Every request runs its row program (vanilla decoding, or
SimSD's rounds) with the keyed noise of its own seed, so its output does not depend on what
else is in flight (float32/float64; docs/exactness.md "Batch invariance").
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import warnings
from pathlib import Path

import torch

from ..decoding.choices import at_most, opt
from ..decoding.config import DecodeConfig, check_prompt, check_prompt_ids
from ..decoding.vanilla import VanillaRow
from ..engine.batching import BatchEngine
from ..engine.memory import fmt_bytes, parameter_count
from ..engine.scheduler import QueueFull, Request, Scheduler, SchedulerClosed  # noqa: F401  (QueueFull re-exported)
from ..models.loading import Checkpoint, CheckpointInfo, check_block_diffusion, load_checkpoint, read_checkpoint
from ..speculative.decoder import SpecConfig, SpeculativeDecoder, check_pair
from .detokenize import TextStream
from .encoding import bytes_per_token, encode_prompt, is_ids, is_messages, template_stop_ids
from .errors import ParamError, SimsdWarning
from .outputs import RequestCancelled, RequestError, RequestHandle, RequestOutput, request_failure  # noqa: F401  (re-exported)
from .resources import check_llm_memory, engine_size
from .settings import EngineArgs, SamplingParams, resolve


def check_device(name: str, value) -> torch.device:
    """``torch.device`` of the device setting ``name``; :class:`ParamError` if ``value`` is not a
    device name, or names a device this machine does not have."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ParamError(name, f"{opt(name)} {value!r} is not a device name (cpu, cuda, cuda:1, ...)") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ParamError(name, f"{opt(name)} {value}: no CUDA device is available (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ParamError(name, f"{opt(name)} {value}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ParamError(name, f"{opt(name)} {value}: only cpu and cuda devices are supported")
    return dev


def _read(spec, config: EngineArgs):
    """A checkpoint spec as it is (loaded, or read) or read from its directory (no weights), with
    the caller's explicit ``block_length`` and ``mask_token_id`` (:func:`read_checkpoint`)."""
    if not isinstance(spec, (Checkpoint, CheckpointInfo)):
        return read_checkpoint(Path(spec), block_length=config.block_length, mask_token_id=config.mask_token_id)
    if config.mask_token_id is not None and config.mask_token_id != spec.mask_token_id:
        raise ParamError("mask_token_id", f"{opt('mask_token_id')} {config.mask_token_id!r} differs from the mask "
                                          f"token id {spec.mask_token_id} of {spec.path}")
    check_block_diffusion(spec.path, spec.config, True, config.block_length)
    return spec


def check_engine(config: EngineArgs, default_params: SamplingParams | None = None) -> tuple:
    """The checks of an engine's settings that need torch and the checkpoints' small files, before
    any weight loads: the devices, CUDA graphs, the process group of ``tp``, the attention
    backend on each device, the checkpoints (read: config, tokenizer, tensor headers), the
    block length, ``max_model_len`` and ``max_gamma`` against the models' positions, and
    ``default_params`` against all of it (refused as a request would be; its ``max_tokens`` must
    leave a position for a prompt).

    Returns:
        ``(config, infos)``: ``config`` with the device, draft device, dtype, block length and
        ``max_model_len`` it resolves to; ``{"target": ..., "draft": ...}`` checkpoints as given
        or read (:class:`CheckpointInfo`).

    Raises:
        ParamError: naming the setting; :class:`~simsd.models.config.CheckpointError` for a bad
            checkpoint; ``ValueError`` for a pair that does not share the tokenizer.
    """
    from simsd_kernels.backends import resolve_backend

    from ..assets import DEFAULT_DRAFT, DEFAULT_TARGET
    from ..engine.tp import check_tp, rank_device, world
    spec = config.mode != "vanilla"
    device = check_device("device", config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if config.tp > 1:
        if world()[1] != config.tp:
            raise ParamError("tp", f"{opt('tp')} {config.tp}: this process group has {world()[1]} rank(s); start one "
                                   f"process per rank (torchrun --nproc-per-node {config.tp}; the command line "
                                   f"spawns them)")
        device = torch.device(rank_device(str(device)))
    draft_device = check_device("draft_device", config.draft_device) if config.draft_device is not None else device
    devices = sorted({str(device), str(draft_device) if spec else str(device)})
    if config.cuda_graphs and (not torch.cuda.is_available() or any(torch.device(d).type != "cuda" for d in devices)):
        raise ParamError("cuda_graphs", f"{opt('cuda_graphs')} needs CUDA devices, got {', '.join(devices)}")
    for d in devices:
        try:
            resolve_backend(config.attention_backend or "auto", torch.device(d))
        except ValueError as exc:
            raise ParamError("attention_backend", f"{opt('attention_backend')} {config.attention_backend}: "
                                                  f"{exc}") from exc
    infos = {"target": _read(config.target or DEFAULT_TARGET, config)}
    if spec:
        infos["draft"] = _read(config.draft or DEFAULT_DRAFT, config)
        check_pair(infos["target"], infos["draft"])
    limit = min(i.config.max_position_embeddings for i in infos.values())
    block_length = config.block_length if config.block_length is not None else infos["target"].config.block_size
    if block_length >= limit:
        raise ParamError("block_length", f"{opt('block_length')} {block_length} leaves no room in the model's maximum "
                                         f"length {limit} (valid: 1 to {limit - 1})")
    max_model_len = config.max_model_len if config.max_model_len is not None else limit
    if not block_length < max_model_len <= limit:
        raise ParamError("max_model_len", f"{opt('max_model_len')} must be an integer in ({block_length}, {limit}] "
                                          f"(the models' positions), got {max_model_len}")
    at_most("max_gamma", config.max_gamma, block_length, "the block length")
    if config.tp > 1:
        check_tp(infos["target"].config, config.tp)
    dtype = config.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config = dataclasses.replace(config, device=device, draft_device=draft_device if spec else None, dtype=dtype,
                                 block_length=block_length, max_model_len=max_model_len)
    if default_params is not None:
        resolve(default_params, config, infos["target"].config.vocab_size)
        if default_params.max_tokens >= max_model_len:
            raise ParamError("max_tokens", f"{opt('max_tokens')} {default_params.max_tokens} leaves no position for "
                                           f"a prompt in the {max_model_len} positions of a request "
                                           f"({opt('max_model_len')}; a request without max_tokens would be "
                                           f"refused)")
    return config, infos


def run_warnings(target, draft, block_length: int | None) -> list:
    """What a run is allowed to do but should say, one line each: a ``block_length`` (the caller's)
    other than the target's ``block_size``, a draft trained for another block length than the
    target, a draft with more parameters than the target, the sampling fields of a
    checkpoint's ``generation_config.json`` that are not applied (checkpoints or infos)."""
    notes, tb = [], target.config.block_size
    for ck in (target, draft):
        ignored = getattr(ck, "ignored_sampling", None)
        if ignored:
            notes.append(f"{ck.path / 'generation_config.json'}: {', '.join(f'{k}={v!r}' for k, v in ignored.items())} "
                         f"not applied: a request samples with its own settings (greedy unless it sets a "
                         f"temperature)")
    if block_length is not None and tb is not None and block_length != tb:
        notes.append(f"block length {block_length} differs from the target's block_size {tb} (SDAR checkpoints "
                     f"are trained for one block length)")
    if draft is None:
        return notes
    db = draft.config.block_size
    if db is not None and tb is not None and db != tb:
        notes.append(f"the draft's block_size {db} differs from the target's {tb}; the draft denoises blocks of "
                     f"the run's block length (SDAR checkpoints are trained for one block length)")
    dn, tn = parameter_count(draft.config), parameter_count(target.config)
    if dn > tn:
        notes.append(f"the draft {draft.path.name} ({dn / 1e6:.1f}M parameters) is larger than the target "
                     f"{target.path.name} ({tn / 1e6:.1f}M); a draft saves time only when it is cheaper than the "
                     f"target")
    return notes


class LLM:
    """SDAR decoding (vanilla, or SimSD paper/exact) behind a request API with continuous batching.

    Args:
        target, draft, mode, settings: the engine's settings, the fields of
            :class:`~simsd.entrypoints.settings.EngineArgs` (each with its help; ``simsd serve
            --help`` shows them as options): the checkpoints (directories, read
            :class:`~simsd.models.loading.CheckpointInfo` or loaded
            :class:`~simsd.models.loading.Checkpoint`; None: the bundled tiny pair), the mode
            (``vanilla`` | ``paper`` | ``exact``, see the README's "Decoding modes"), devices and
            dtype, the engine's size (``batch_size`` rows of ``max_model_len`` positions, whole
            blocks, within ``kv_cache_memory`` bytes), the block length and mask token of
            checkpoints that do not say them, the decoding options of ``simsd generate``,
            ``max_gamma`` (the caches' margin holds ``(max_gamma + 2) x block_length`` tokens per
            row), ``tp`` (every rank of the initialised ``torch.distributed`` group creates the
            LLM with the same settings and calls :meth:`generate` with the same requests; each
            rank uses ``cuda:<local rank>`` on CUDA; :mod:`simsd.engine.tp`) and
            ``scheduler_thread`` (see the module doc).
        default_params: the :class:`SamplingParams` of requests that give none (checked as a
            request before any weight loads).

    Attributes: ``config`` (the :class:`EngineArgs` the engine was built with, defaults
    resolved), ``verifier_class`` (None, or the verifier of paper/exact requests instead of the
    mode's, :mod:`simsd.speculative.verifiers`: ``simsd bench`` installs one that compares paper
    verification with exact mode's, with extra untimed target forwards).

    Warns (:class:`~simsd.entrypoints.errors.SimsdWarning`, once): a block length other than the
    target's ``block_size``, a draft trained for another block length, a draft larger than the
    target (:func:`run_warnings`).

    Raises:
        ParamError: a bad setting or combination (``param`` names it; :func:`check_engine`);
            :class:`~simsd.models.config.CheckpointError` for a bad checkpoint or one that is not
            block-diffusion without the explicit settings; ``ValueError`` for a draft whose
            tokenizer differs from the target's; ``TypeError`` for an unknown keyword.
    """

    def __init__(self, target=None, draft=None, mode: str = "exact", *, default_params: SamplingParams | None = None,
                 **settings):
        from ..engine.threads import apply_threads
        from ..engine.tp import shard_model, world
        config = EngineArgs(target=target, draft=draft, mode=mode, **settings)
        if config.scheduler_thread is None:
            config = dataclasses.replace(config, scheduler_thread=config.tp == 1)
        self.config, infos = check_engine(config, default_params)
        config, block_length = self.config, self.config.block_length
        for note in run_warnings(infos["target"], infos.get("draft"), settings.get("block_length")):
            warnings.warn(note, SimsdWarning, stacklevel=2)
        apply_threads([i.config for i in infos.values()], config.threads)
        self.mode, self.scheduler_thread, self.tp = mode, config.scheduler_thread, config.tp
        self.max_model_len = config.max_model_len
        size = engine_size(config, infos)
        check_llm_memory(config, infos, size)  # before any weight loads (a CPU's OOM killer gives no message)
        self.target = self._load(infos["target"], config.dtype, config.device, config.attention_backend)
        if config.invariant is not None or not isinstance(infos["target"], Checkpoint):
            self.target.model.invariant = bool(config.invariant)
        if config.tp > 1 and self.target.model.tp != (world()[0], config.tp):
            shard_model(self.target.model, world()[0], config.tp)
        self.draft = self.decoder = None
        if mode != "vanilla":
            self.draft = self._load(infos["draft"], config.dtype, config.draft_device, config.attention_backend)
            # one decoder for every request (it refuses the combinations the rows cannot run, with
            # the devices of the loaded checkpoints); each request brings its own plan
            self.decoder = SpeculativeDecoder(
                self.target, self.draft, DecodeConfig(block_length=block_length, fold_commit=config.fold_commit),
                SpecConfig(mode, on_reject=config.on_reject, rope_copy=config.rope_copy, optimistic=config.optimistic,
                           paper_variant=config.paper_variant), check=False)
        self.models = [m for m in (self.target, self.draft) if m is not None]
        self.vocab_size = infos["target"].config.vocab_size
        self._make_engine(size, config.cuda_graphs)
        self.scheduler = Scheduler(self.engine, config.max_waiting)
        self.tokenizer = self.target.tokenizer
        self._bytes_per_token = bytes_per_token(self.tokenizer)  # a text certainly too long is refused untokenized
        #: stop ids of prompts that went through the chat template (its role markers)
        self.template_stop_ids = template_stop_ids(self.tokenizer, self.target.mask_token_id)
        self.default_params = default_params if default_params is not None else SamplingParams()
        self.verifier_class = None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._drive_lock = threading.Lock()
        self._started = False
        self.totals = {"requests": {"stop": 0, "length": 0, "cancelled": 0, "error": 0}, "prompt_tokens": 0,
                       "generation_tokens": 0, "target_forwards": 0, "draft_forwards": 0, "proposed": 0,
                       "accepted": 0}

    @classmethod
    def from_config(cls, config: EngineArgs, default_params: SamplingParams | None = None) -> "LLM":
        """The LLM of an :class:`EngineArgs` (the command line's way)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                   default_params=default_params)

    @staticmethod
    def _load(info, dtype, device, backend) -> Checkpoint:
        if isinstance(info, Checkpoint):
            if backend is not None:
                info.model.attention_backend = backend
            return info
        ckpt = load_checkpoint(info.path, dtype=dtype, device=device, info=info)
        ckpt.model.attention_backend = backend or "auto"
        return ckpt

    def _make_engine(self, size, cuda_graphs: bool) -> None:
        self.kv_cache_bytes = size.kv_cache_bytes
        engine_models = {"target": self.target.model}
        if self.draft is not None:
            engine_models["draft"] = self.draft.model
        try:
            self.engine = BatchEngine(engine_models, self.block_length, size.rows, size.capacity, size.margin,
                                      cuda_graphs=cuda_graphs)
        except RuntimeError as exc:  # torch.OutOfMemoryError among them
            if "out of memory" not in str(exc).lower():
                raise
            raise ParamError("batch_size", f"the KV caches of {size.rows} rows x {self.max_model_len} positions "
                                           f"({fmt_bytes(self.kv_cache_bytes)}) do not fit: lower {opt('batch_size')} "
                                           f"or {opt('max_model_len')}, or set {opt('kv_cache_memory')}") from None

    # -- properties ------------------------------------------------------------------------
    @property
    def block_length(self) -> int:
        return self.config.block_length

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
        the generation prompt) or a list of token ids (:mod:`simsd.entrypoints.encoding`).

        Raises:
            ParamError: an empty prompt, no tokenizer (or chat template) for text, bad messages,
                a text that spells the mask token, ids outside the vocabulary or equal to the
                mask id (``param``: ``prompt`` or ``messages``).
        """
        return self._encode(prompt)[0]

    def _encode(self, prompt) -> tuple:
        ids, templated = encode_prompt(prompt, self.tokenizer, self.target.mask_token_id, self.max_model_len,
                                       self._bytes_per_token)
        try:
            check_prompt_ids(ids, self.target.config, self.target.mask_token_id)
        except ValueError as exc:
            raise ParamError("prompt", str(exc)) from None
        return ids, templated

    def _capacity(self, ids: list, max_tokens: int) -> int:
        P, L = len(ids), self.max_model_len
        if P >= L:
            raise ParamError("prompt", f"prompt of {P} tokens is longer than {opt('max_model_len')} {L} - 1")
        if P + max_tokens > L:
            raise ParamError("max_tokens", f"prompt ({P} tokens) + {opt('max_tokens')} ({max_tokens}) exceeds "
                                           f"{opt('max_model_len')} {L}")
        return max(check_prompt(ids, m.config, max_tokens, self.block_length) for m in self.models)

    def submit(self, prompt, params: SamplingParams | None = None, *, listener=None, block: bool = False,
               request_id: str | None = None, fit_max_tokens: bool = False) -> RequestHandle:
        """Queue one request; returns its :class:`RequestHandle` at once.

        ``listener(kind, payload)``: receives the events on the scheduling thread (see
        :class:`RequestHandle`); ``block``: wait for room in a full queue instead of refusing
        (with a scheduling thread only); ``fit_max_tokens``: ``params.max_tokens`` is a default,
        not the caller's: cut it to the positions the prompt leaves (``max_model_len - prompt``;
        OpenAI's and vLLM's rule for an omitted ``max_tokens``) instead of refusing it.

        Raises:
            ParamError: a bad prompt or parameter (``param`` names it).
            QueueFull: ``max_waiting`` requests wait already (and ``block`` is False).
            SchedulerClosed: :meth:`shutdown` was called (a ``RuntimeError``; also from
                :meth:`generate`, :meth:`generate_iter` and :meth:`stream`).
        """
        handle = self._request(prompt, params, listener, request_id, fit_max_tokens)
        self._start()
        self.scheduler.submit(handle._request, block=block and self.scheduler_thread)
        return handle

    def _request(self, prompt, params, listener, request_id, fit_max_tokens: bool = False) -> RequestHandle:
        """A checked request, not queued yet (``SchedulerClosed`` after :meth:`shutdown`)."""
        if self.scheduler.closed:
            raise SchedulerClosed("this LLM was shut down (LLM.shutdown(), or the end of its with block) and takes "
                                  "no new requests: create a new LLM")
        ids, templated = self._encode(prompt)
        params = self.default_params if params is None else params
        if fit_max_tokens and 0 < self.max_model_len - len(ids) < params.max_tokens:
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(ids))
        cfg, spec, seed = resolve(params, self.config, self.vocab_size)
        capacity = self._capacity(ids, params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise ParamError("stop", "stop strings need a tokenizer (this checkpoint has none)")
        stop_ids = [] if params.ignore_eos else list(self.target.stop_ids)
        if templated and not params.ignore_eos:  # a new turn ends the answer
            stop_ids += self.template_stop_ids
        stop_ids += list(params.stop_token_ids)
        stream = TextStream(self.tokenizer, stop_ids, params.stop, params.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(self, rid, prompt, ids, seed, stream, listener)
        if spec is None:
            def new_program(row):
                return VanillaRow(row, cfg, self.target.mask_token_id, stop_ids, seed)
        else:
            plan = self.decoder.plan_for(cfg, spec)

            def new_program(row):
                return self.decoder.new_row(row, seed, stop_ids, plan, self.verifier_class)

        def program(row, tail):
            handle._program = new_program(row)
            return handle._program.program(tail, handle._on_block)
        handle._request = Request(ids, program, capacity, on_finish=handle._on_finish, request_id=rid)
        return handle

    def _enqueue(self, handle: RequestHandle) -> None:
        """Queue a request, waiting for room: on the scheduling thread, or by running rounds here."""
        self._start()
        while True:
            try:
                self.scheduler.submit(handle._request, block=self.scheduler_thread)
                return
            except QueueFull:
                if self.scheduler_thread:
                    raise
                self._drive(lambda: self.scheduler.has_room)

    def _start(self) -> None:
        with self._lock:
            if self.scheduler_thread and not self._started:
                self.scheduler.start()
                self._started = True

    def _drive(self, until) -> None:
        """Without a scheduling thread: run rounds on this thread until ``until()`` holds."""
        if self.scheduler_thread:
            return
        with self._drive_lock:
            while not until():
                if not self.scheduler.step() and not until():
                    raise RuntimeError("the scheduler ran out of requests before the awaited event")

    def _count(self, handle: RequestHandle, outcome: str) -> None:
        with self._lock:
            t = self.totals
            t["requests"][outcome] += 1
            t["prompt_tokens"] += len(handle.prompt_token_ids)
            t["generation_tokens"] += len(handle.stream.token_ids)
            prog = handle._program
            if prog is not None:
                t["target_forwards"] += prog.row.forwards.get("target", 0)
                t["draft_forwards"] += prog.row.forwards.get("draft", 0)
                counters = getattr(prog, "stats", None)  # SimSD rows count proposals
                if counters is not None:
                    t["proposed"] += counters.proposed
                    t["accepted"] += counters.accepted

    def generate(self, prompts, params=None, use_tqdm: bool = False) -> list:
        """Decode ``prompts`` (one prompt or a list of them; see :meth:`prompt_ids` for the
        forms) with ``params`` (one :class:`SamplingParams` for all, or a list, one per prompt;
        None: ``default_params``); returns one :class:`RequestOutput` per prompt, in order.
        The requests are batched continuously (at most ``batch_size`` at a time);
        :func:`~simsd.engine.scheduler.decode_span` of the outputs is the run's
        decode time.

        Raises:
            ParamError: a bad prompt or parameter (the message names the prompt's index; the
                requests queued before it are cancelled, and none has run without a scheduling
                thread).
            RequestError: a request failed (the others are cancelled).
            SchedulerClosed: :meth:`shutdown` was called (a ``RuntimeError``).
        """
        return list(self.generate_iter(prompts, params, use_tqdm))

    def generate_iter(self, prompts, params=None, use_tqdm: bool = False):
        """:meth:`generate`, yielding each output as soon as it and those before it have
        finished (the requests are all checked and queued at the first ``next``). Closing the
        iterator early cancels the requests not yet yielded."""
        single = not isinstance(prompts, (list, tuple)) or is_ids(prompts) or is_messages(prompts)
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
                    handle = self._request(p, sp, None, None)
                except ParamError as exc:
                    if single:
                        raise
                    raise ParamError(exc.param, f"prompt {i}: {exc.template}") from None
                self._enqueue(handle)
                handles.append(handle)
            bar = None
            if use_tqdm:
                import sys

                from tqdm import tqdm
                bar = tqdm(total=len(handles), desc=f"simsd {self.mode}", unit="req", file=sys.stderr)
            for h in handles:
                out = h.result()
                if bar is not None:
                    bar.update()
                yield out
            if bar is not None:
                bar.close()
        finally:
            for h in handles:
                h.cancel()  # nothing for finished ones; the rest when one failed, on close or KeyboardInterrupt

    def stream(self, prompt, params: SamplingParams | None = None, timeout: float | None = None):
        """Yield the generated text of one request in increments as its blocks finish (committed
        tokens only; a multi-byte character is never split; nothing of a stop string or
        after it). Closing the iterator early cancels the request.

        Raises:
            ParamError: as :meth:`submit`; also when the checkpoint has no tokenizer.
            RequestError: the request failed.
            SchedulerClosed: :meth:`shutdown` was called (a ``RuntimeError``).
        """
        if self.tokenizer is None:
            raise ParamError("prompt", "streaming text needs a tokenizer (this checkpoint has none)")
        handle = self._request(prompt, params, None, None)
        self._enqueue(handle)
        try:
            for kind, payload in handle.events(timeout):
                if kind == "delta":
                    if payload[0]:
                        yield payload[0]
                elif kind == "error":
                    raise request_failure(handle.request_id, payload)
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
        them). Returns True when the scheduling thread has ended within ``timeout`` seconds
        (without one: when the rounds left have run here)."""
        ended = self.scheduler.stop(drain=drain, timeout=timeout)
        if not self.scheduler_thread:
            with self._drive_lock:
                while self.scheduler.step():
                    pass
        return ended

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown(drain=exc[0] is None)
