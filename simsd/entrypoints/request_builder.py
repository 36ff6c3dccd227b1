"""A request of the Python API, checked and built before it is queued: the prompt encoded
(:mod:`simsd.entrypoints.encoding`) and checked against every model, the parameters resolved
against the engine (:func:`~simsd.decoding.config.resolve`), the stop ids and the text
stream, and the row program the scheduler will run once the request has a row
(:class:`~simsd.decoding.vanilla.VanillaRow`, or the speculative decoder's row).
"""
from __future__ import annotations

import dataclasses
import itertools

from ..decoding.config import check_prompt, check_prompt_ids, resolve
from ..decoding.prompt_logprobs import prompt_logprobs
from ..decoding.vanilla import VanillaRow
from ..engine.scheduler import Request, SchedulerClosed
from .builder import BuiltEngine
from .detokenize import TextStream
from .encoding import bytes_per_token, encode_prompt, template_stop_ids
from .errors import ParamError
from .outputs import RequestHandle


class RequestBuilder:
    """Builds the requests of one LLM's engine (``built``, :func:`~simsd.entrypoints.builder.build_engine`)."""

    def __init__(self, built: BuiltEngine):
        self.config, self.target, self.decoder = built.config, built.target, built.decoder
        self.models = [m for m in (built.target, built.draft) if m is not None]
        self.tokenizer = self.target.tokenizer
        self.bytes_per_token = bytes_per_token(self.tokenizer)  # a text certainly too long is refused untokenized
        #: stop ids of prompts that went through the chat template (its role markers)
        self.template_stop_ids = template_stop_ids(self.tokenizer, self.target.mask_token_id)
        self._ids = itertools.count()

    def encode(self, prompt) -> tuple:
        """``(ids, templated)`` of ``prompt`` (see :meth:`simsd.LLM.prompt_ids`); ``templated``: it
        went through the chat template. Raises :class:`ParamError`."""
        ids, templated = encode_prompt(prompt, self.tokenizer, self.target.mask_token_id, self.config.max_model_len,
                                       self.bytes_per_token)
        check_prompt_ids(ids, self.target.config, self.target.mask_token_id)
        return ids, templated

    def capacity(self, ids: list, max_tokens: int) -> int:
        """Cache tokens the request needs in every model; :class:`ParamError` when the prompt and
        ``max_tokens`` do not fit ``max_model_len`` or a model's positions."""
        return max(check_prompt(ids, m.config, max_tokens, self.config.block_length,
                                max_model_len=self.config.max_model_len) for m in self.models)

    def build(self, llm, prompt, params, listener=None, request_id: str | None = None, fit_max_tokens: bool = False,
              verifier_class=None) -> RequestHandle:
        """The :class:`RequestHandle` of a checked request of ``llm``, not queued yet (its
        ``request`` is what the scheduler takes); ``fit_max_tokens`` as :meth:`simsd.LLM.submit`;
        ``verifier_class``: paper/exact rows verify with it instead of the mode's.

        Raises:
            SchedulerClosed: the LLM was shut down.
            ParamError: a bad prompt or parameter (``param`` names it), ``n`` other than 1 (the
                callers split a request into its choices first, :func:`~simsd.config.request.split_choices`).
        """
        if llm.scheduler.closed:
            raise SchedulerClosed("this LLM was shut down (LLM.shutdown(), or the end of its with block) and takes "
                                  "no new requests: create a new LLM")
        ids, templated = self.encode(prompt)
        params = llm.default_params if params is None else params
        if params.n != 1:
            raise ParamError("n", f"n={params.n}: LLM.submit and LLM.stream run one completion (n=1); LLM.generate, "
                                  f"LLM.chat and the server run n > 1")
        room = self.config.max_model_len - len(ids)
        if fit_max_tokens and 0 < room < params.max_tokens:
            params = dataclasses.replace(params, max_tokens=room)
        cfg, spec, seed = resolve(params, self.config, self.target.config.vocab_size)
        capacity = self.capacity(ids, params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise ParamError("stop", "stop strings need a tokenizer (this checkpoint has none)")
        stop_ids = [] if params.ignore_eos else list(self.target.stop_ids)
        if templated and not params.ignore_eos:  # a new turn ends the answer
            stop_ids += self.template_stop_ids
        stop_ids += list(params.stop_token_ids)
        stream = TextStream(self.tokenizer, stop_ids, params.stop, params.max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(llm, rid, prompt, ids, seed, stream, listener)
        if spec is None:
            def new_program(row):
                return VanillaRow(row, cfg, self.target.mask_token_id, stop_ids, seed)
        else:
            plan, decoder = self.decoder.plan_for(cfg, spec), self.decoder

            def new_program(row):
                return decoder.new_row(row, seed, stop_ids, plan, verifier_class)

        def program(row, tail):
            if params.prompt_logprobs is not None:  # at admission, on a scratch cache (the row's is untouched)
                handle.prompt_entries = prompt_logprobs(self.target.model, ids, self.config.block_length,
                                                        self.target.mask_token_id, params.prompt_logprobs)
            handle.start(new_program(row))
            return handle.program.program(tail, handle.on_block)
        # tensor-parallel: what another rank rebuilds the request from (the seed drawn here included)
        source = (prompt, params, seed, rid) if self.config.tp > 1 else None
        handle.request = Request(ids, program, capacity, on_finish=handle.on_finish, request_id=rid, source=source)
        return handle

    def rebuild(self, llm, source):
        """The :class:`~simsd.engine.scheduler.Request` of another rank's ``Request.source``
        (:mod:`simsd.engine.tp_rounds`): the same prompt, parameters and seed, no listener."""
        prompt, params, seed, rid = source
        return self.build(llm, prompt, dataclasses.replace(params, seed=seed), request_id=rid).request
