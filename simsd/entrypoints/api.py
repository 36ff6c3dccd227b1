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
which must run the same forwards; ``simsd serve --tp``'s rank 0 instead leads the others' rounds
from its scheduling thread: :meth:`LLM.lead`). Every request runs its row program (vanilla decoding, or
SimSD's rounds) with the keyed noise of its own seed, so its output does not depend on what
else is in flight (float32/float64; docs/exactness.md "Batch invariance").
"""
from __future__ import annotations

import dataclasses
import sys

from tqdm import tqdm

from ..config.engine import EngineArgs
from ..config.request import SamplingParams, split_choices
from ..config.vllm_names import CHAT, ENGINE, translate
from ..engine.scheduler import QueueFull, Scheduler, SchedulerClosed  # noqa: F401  (re-exported)
from .builder import build_engine, default_params_of
from .driver import Driver, Totals
from .encoding import ChatPrompt, is_ids, is_messages
from .errors import ParamError
from .outputs import CompletionOutput, RequestCancelled, RequestError, RequestHandle, RequestOutput, request_failure  # noqa: F401
from .request_builder import RequestBuilder


def pair_params(prompts, params) -> tuple:
    """``(single, prompts, params)``: whether ``prompts`` is one prompt, the prompts as a list and
    one params (or None) per prompt (:class:`ParamError` for a list of another length)."""
    single = not isinstance(prompts, (list, tuple)) or is_ids(prompts) or is_messages(prompts)
    items = [prompts] if single else list(prompts)
    if not isinstance(params, (list, tuple)):
        return single, items, [params] * len(items)
    if len(params) != len(items):
        raise ParamError("params", f"{len(params)} params for {len(items)} prompts")
    return single, items, list(params)


class LLM:
    """SDAR decoding (vanilla, or SimSD paper/exact) behind a request API with continuous batching.

    Args:
        target, draft, mode, settings: the engine's settings, the fields of
            :class:`~simsd.config.engine.EngineArgs` (each documented there; ``simsd serve
            --help`` shows them as options). ``target`` / ``draft``: checkpoint directories, read
            :class:`~simsd.models.loading.CheckpointInfo` or loaded
            :class:`~simsd.models.loading.Checkpoint` (None: the bundled tiny pair). With ``tp``,
            every rank of the ``torch.distributed`` group creates the LLM with the same settings
            and submits the same requests (:mod:`simsd.engine.tp`).
        default_params: the :class:`SamplingParams` of requests that give none (checked as a
            request before any weight loads); default: simsd's (greedy, 128 tokens) with the
            temperature, top_k, top_p and repetition_penalty of the target's ``generation_config.json`` under
            ``generation_config="auto"``, vLLM's ``--generation-config auto``
            (:func:`~simsd.entrypoints.builder.default_params_of`).

    vLLM's (and SGLang's) keywords are taken where simsd does the same thing
    (:data:`simsd.config.vllm_names.ENGINE`, docs/vllm.md): ``model`` for ``target``,
    ``speculative_model`` for ``draft``, ``tensor_parallel_size`` for ``tp``, ``max_num_seqs``
    for ``batch_size``, ``dtype="auto"``; ``trust_remote_code`` is accepted and ignored (simsd runs
    SDAR with its own model code and never runs a checkpoint's Python); ``seed`` (simsd's seed is
    a request's, ``SamplingParams(seed=...)``) is refused with a :class:`ParamError` saying so, as
    are both spellings of one setting (``model`` and ``target``).

    Attributes: ``config`` (the :class:`EngineArgs` the engine was built with, defaults
    resolved), ``verifier_class`` (None, or the verifier of paper/exact requests instead of the
    mode's, :mod:`simsd.speculative.verifiers`: ``simsd bench`` installs one that compares paper
    verification with exact mode's, with extra untimed target forwards).

    Warns and raises as :func:`~simsd.entrypoints.builder.build_engine` (a
    :class:`~simsd.entrypoints.errors.SimsdWarning` per note of
    :func:`~simsd.entrypoints.builder.run_warnings`; :class:`ParamError` naming the setting,
    also for an engine that does not fit the memory; ``CheckpointError``; ``ValueError`` for a
    draft whose tokenizer differs from the target's); ``TypeError`` for an unknown keyword.
    """

    def __init__(self, target=None, draft=None, mode: str = "exact", *, default_params: SamplingParams | None = None,
                 **settings):
        given = {name: v for name, v in (("target", target), ("draft", draft)) if v is not None}
        config = EngineArgs(mode=mode, **translate(ENGINE, {**given, **settings}, "LLM(...)"))
        if config.scheduler_thread is None:
            config = dataclasses.replace(config, scheduler_thread=config.tp == 1)
        built = build_engine(config, default_params)
        self.config, self.target, self.draft, self.decoder = built.config, built.target, built.draft, built.decoder
        self.engine, self.kv_cache_bytes = built.engine, built.kv_cache_bytes
        self.mode, self.scheduler_thread, self.tp = mode, config.scheduler_thread, config.tp
        self.max_model_len = self.config.max_model_len
        self.tokenizer = self.target.tokenizer
        self.default_params = default_params if default_params is not None else \
            default_params_of(self.config, self.target)
        self.verifier_class = None
        self.scheduler = Scheduler(self.engine, config.max_waiting)
        self.driver = Driver(self.scheduler, self.scheduler_thread)
        self.totals = Totals()
        self.requests = RequestBuilder(built)

    @classmethod
    def from_config(cls, config: EngineArgs, default_params: SamplingParams | None = None,
                    given=None) -> "LLM":
        """The LLM of an :class:`EngineArgs` (the command line's way). ``given``: the fields of
        ``default_params`` the caller set (the typed options); the others take the target's
        generation config as when no ``default_params`` are given (None: all were set)."""
        llm = cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                  default_params=default_params)
        if default_params is not None and given is not None:
            llm.default_params = default_params_of(llm.config, llm.target, default_params, given)
        return llm

    @property
    def block_length(self) -> int:
        return self.config.block_length

    @property
    def started(self) -> bool:
        """The scheduling thread has been started (by the first request)."""
        return self.driver.started

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
        return self.requests.encode(prompt)[0]

    def submit(self, prompt, params: SamplingParams | None = None, *, listener=None, block: bool = False,
               request_id: str | None = None, fit_max_tokens: bool = False) -> RequestHandle:
        """Queue one request; returns its :class:`RequestHandle` at once.

        ``listener(kind, payload)``: receives the events on the scheduling thread (see
        :class:`RequestHandle`); ``block``: wait for room in a full queue instead of refusing
        (with a scheduling thread only); ``fit_max_tokens``: ``params.max_tokens`` is a default,
        not the caller's: cut it to the positions the prompt leaves (``max_model_len - prompt``;
        OpenAI's and vLLM's rule for an omitted ``max_tokens``) instead of refusing it.

        Raises:
            ParamError: a bad prompt or parameter (``param`` names it), ``n`` other than 1
                (:meth:`generate` runs several choices).
            QueueFull: ``max_waiting`` requests wait already (and ``block`` is False).
            SchedulerClosed: :meth:`shutdown` was called (a ``RuntimeError``; also from
                :meth:`generate`, :meth:`generate_iter` and :meth:`stream`).
        """
        handle = self.requests.build(self, prompt, params, listener, request_id, fit_max_tokens, self.verifier_class)
        self.driver.start()
        self.scheduler.submit(handle.request, block=block and self.scheduler_thread)  # no hop between
        return handle

    def lead(self, publish) -> None:
        """Make this LLM a tensor-parallel leader (``simsd serve --tp``'s rank 0,
        :mod:`simsd.engine.tp_rounds`): its rounds run on a scheduling thread, each round's
        inputs handed to ``publish(cancels, admits)`` first, so that the other ranks run the
        same rounds. Call it before the first request, on an LLM with ``tp > 1``."""
        if self.tp == 1 or self.driver.started:
            raise RuntimeError("LLM.lead: for an LLM with tp > 1, before its first request")
        self.scheduler.publish = publish
        self.scheduler_thread = True
        self.driver = Driver(self.scheduler, True)

    def generate(self, prompts, params=None, use_tqdm: bool = False, *, sampling_params=None) -> list:
        """Decode ``prompts`` (one prompt or a list of them; see :meth:`prompt_ids` for the
        forms) with ``params`` (one :class:`SamplingParams` for all, or a list, one per prompt;
        None: ``default_params``; ``sampling_params``: vLLM's name of it); returns one
        :class:`RequestOutput` per prompt, in order. A prompt with ``n > 1`` runs ``n``
        independent requests, choice ``i`` with :func:`~simsd.config.request.choice_seed` of its
        seed (one drawn if none is given); its output's ``outputs`` holds every choice.
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
        if sampling_params is not None:
            if params is not None:
                raise ParamError("sampling_params", "params and sampling_params (vLLM's name of params) both given: "
                                                    "give one of them")
            params = sampling_params
        return list(self.generate_iter(prompts, params, use_tqdm))

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False, **options) -> list:
        """vLLM's ``LLM.chat``: :meth:`generate` of chat prompts. ``messages``: one conversation
        (a list of ``{"role": ..., "content": ...}`` dicts) or a list of them; returns one
        :class:`RequestOutput` per conversation, a list of one for one conversation (as vLLM).
        ``sampling_params``: as :meth:`generate`'s ``params``; ``add_generation_prompt``,
        ``continue_final_message``: how the checkpoint's chat template renders each conversation
        (:class:`~simsd.entrypoints.encoding.ChatPrompt`). vLLM's other options
        (``chat_template``, ``tools`` ...) are accepted at their defaults only
        (:data:`simsd.config.vllm_names.CHAT`). ``llm.chat(m, p)`` equals ``llm.generate([m], p)``.

        Raises:
            ParamError: a conversation that is not a non-empty list of message dicts (``param``:
                ``messages``), vLLM's option at another value, and as :meth:`generate`.
            TypeError: an unknown keyword.
        """
        if translate(CHAT, options, "LLM.chat(...)"):
            raise TypeError(f"LLM.chat() got an unexpected keyword argument {next(iter(options))!r}")
        convs = [messages] if is_messages(messages) else messages
        if not isinstance(convs, (list, tuple)) or not convs or not all(is_messages(c) for c in convs):
            raise ParamError("messages", "chat() takes a conversation (a non-empty list of {'role': ..., 'content': "
                                         "...} dicts) or a list of conversations")
        plain = add_generation_prompt and not continue_final_message  # a list of messages, as generate takes it
        prompts = [c if plain else ChatPrompt(list(c), add_generation_prompt, continue_final_message) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_tokenizer(self):
        """The target checkpoint's tokenizer (transformers'; the draft's equals it), as vLLM's
        ``LLM.get_tokenizer``.

        Raises:
            ParamError: the checkpoint has no tokenizer (``param``: ``target``; vLLM raises a
                ``ValueError`` too when it has none); simsd then takes token id prompts only.
        """
        if self.tokenizer is None:
            raise ParamError("target", f"the checkpoint {self.target.path} has no tokenizer: give prompts as token ids")
        return self.tokenizer

    def generate_iter(self, prompts, params=None, use_tqdm: bool = False):
        """:meth:`generate`, yielding each output as soon as it and those before it have
        finished (the requests are all checked and queued at the first ``next``). Closing the
        iterator early cancels the requests not yet yielded."""
        single, items, plist = pair_params(prompts, params)
        groups = []  # the handles of each prompt's choices
        try:
            for i, (p, sp) in enumerate(zip(items, plist)):
                group = []
                groups.append(group)
                sp = self.default_params if sp is None else sp
                for j, choice in enumerate(split_choices(sp) if isinstance(sp, SamplingParams) else [sp]):
                    try:
                        rid = None if j == 0 else f"{group[0].request_id}-{j}"
                        handle = self.requests.build(self, p, choice, request_id=rid,
                                                     verifier_class=self.verifier_class)
                    except ParamError as exc:
                        if single:
                            raise
                        raise exc.of(f"prompt {i}") from None
                    self.driver.enqueue(handle.request)
                    group.append(handle)
            with tqdm(total=len(groups), desc=f"simsd {self.mode}", unit="req", file=sys.stderr,
                      disable=not use_tqdm) as bar:
                for group in groups:
                    outs = [h.result() for h in group]
                    bar.update()
                    yield dataclasses.replace(outs[0], other_choices=tuple(outs[1:])) if len(outs) > 1 else outs[0]
        finally:
            for h in (h for group in groups for h in group):
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
        handle = self.requests.build(self, prompt, params, verifier_class=self.verifier_class)
        self.driver.enqueue(handle.request)
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
        ``draft_forwards``, ``proposed``, ``accepted``); ``prefill_tokens`` (per model: prompt
        tokens the prefill forwards computed); ``preemptions`` (requests stopped for want
        of KV pages and started over) and ``kv_pages``: with ``page_size``, the pools' pages per
        model (``pages_total``, ``pages_used``, ``pages_free``, ``pages_cached``, ``evictions``),
        ``page_size`` and the prefix cache's ``prefix_queried_tokens`` and ``prefix_hit_tokens``
        (:meth:`simsd.engine.pages.EnginePages.stats`); None without pages."""
        s = self.scheduler
        pages = self.engine.pages
        return {"running": s.num_running, "waiting": s.num_waiting, "rows": self.batch_size, "rounds": s.rounds,
                "round_seconds": s.round_seconds, "batched_forwards": dict(self.engine.forwards),
                "prefill_tokens": dict(self.engine.prefill_tokens), "preemptions": s.preemptions,
                "kv_pages": None if pages is None else pages.stats(),
                **self.totals.snapshot()}

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop taking requests; ``drain``: finish the running and waiting ones (else cancel
        them). Returns True when the scheduling thread has ended within ``timeout`` seconds
        (without one: when the rounds left have run here)."""
        return self.driver.shutdown(drain, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown(drain=exc[0] is None)
