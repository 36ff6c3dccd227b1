"""vLLM's (and SGLang's) spellings of simsd's settings, in one table per surface: the keywords of
:class:`simsd.LLM` (:data:`ENGINE`), the fields of :class:`~simsd.config.request.SamplingParams`
(:data:`REQUEST`) and the options of :meth:`simsd.LLM.chat` (:data:`CHAT`), so that vLLM's offline
example runs unchanged::

    llm = LLM(model="/ckpt/SDAR-1.7B-Chat")
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95))

A name of another engine is either simsd's setting under another spelling (:class:`Same`: mapped
to it, with the values spelt otherwise mapped too: vLLM's ``top_k=-1`` is simsd's ``top_k=0``) or
something simsd does not do (:class:`Lacks`: refused with a :class:`ParamError` naming it and what
simsd offers, except at the values that ask for what simsd does anyway, vLLM's defaults, which
are accepted and ignored). Names that are the same in simsd (``max_model_len``, ``temperature``,
``seed`` of a request, ``presence_penalty`` ...) are not listed. docs/vllm.md shows the tables; the command line takes
vLLM's spellings of its options as aliases (:func:`cli_aliases`). Torch-free.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from .vocabulary import ParamError

#: a :attr:`Lacks.noop` that accepts every value
ANY = "any value"


@dataclass(frozen=True)
class Same:
    """Another engine's name for simsd's setting ``name`` (same meaning); ``values``: ``((theirs,
    simsd's), ...)``, the values that simsd spells otherwise; ``source``: whose name it is."""
    name: str
    values: tuple = ()
    source: str = "vLLM"


@dataclass(frozen=True)
class Lacks:
    """A setting of another engine that simsd does not have: ``why`` says what simsd does and
    offers instead; ``noop``: the values that ask for what simsd does anyway (accepted and
    ignored; :data:`ANY`: every value); ``source``: whose name it is."""
    why: str
    noop: object = ()
    source: str = "vLLM"


_LOCAL = ("simsd loads local checkpoint directories only: download one first (huggingface-cli download "
          "JetLM/SDAR-1.7B-Chat --local-dir DIR) and pass the directory")
_SEED = ("simsd has no engine seed: each request samples with its own SamplingParams(seed=...) (None: a fresh one, "
         "reported in RequestOutput.seed), its noise a function of that seed alone; a default for requests that "
         "give none: default_params=SamplingParams(seed=N), simsd serve --seed N")
_CHUNKS = ("simsd has no token budget per step: each forward is one model's, a prompt's prefill chunks run as "
           "forwards of their own between the other rows' (max_prefill_tokens=N: at most N prompt tokens, whole "
           "blocks, per prefill forward; default: no limit)")

#: :class:`simsd.LLM`'s keywords as vLLM's ``LLM`` (and SGLang's ``Engine``) spell them
ENGINE = {
    "model": Same("target"),
    "speculative_model": Same("draft"),
    "tensor_parallel_size": Same("tp"),
    "max_num_seqs": Same("batch_size"),
    "dtype": Same("dtype", (("auto", None), ("float", "float32"), ("half", "float16"))),
    "seed": Lacks(_SEED, (None,)),
    "trust_remote_code": Lacks("simsd runs SDAR with its own model code and loads the tokenizer with "
                               "trust_remote_code=False: it never runs a checkpoint's Python", ANY),
    "tokenizer": Lacks("simsd uses the target checkpoint's own tokenizer (a draft's must equal it)", (None,)),
    "quantization": Lacks("simsd loads the checkpoint's weights in dtype, unquantized", (None,)),
    "enforce_eager": Lacks("simsd runs eagerly unless cuda_graphs=True", (True,)),
    "num_speculative_tokens": Lacks("a SimSD draft proposes denoising steps of a block, not single tokens: "
                                    "SamplingParams(gamma=...) and LLM(max_gamma=...) bound the draft steps verified "
                                    "per round", (None,)),
    "speculative_config": Lacks("give the draft as draft= (or speculative_model=) and the draft steps per round as "
                                "max_gamma= or SamplingParams(gamma=...)", (None,)),
    "enable_chunked_prefill": Lacks(_CHUNKS, (None, False)),
    "max_num_batched_tokens": Lacks(_CHUNKS, (None,)),
    "revision": Lacks(_LOCAL, (None,)),
    "download_dir": Lacks(_LOCAL, (None,)),
    "model_path": Same("target", source="SGLang"),
    "speculative_draft_model_path": Same("draft", source="SGLang"),
    "tp_size": Same("tp", source="SGLang"),
    "max_running_requests": Same("batch_size", source="SGLang"),
    "chunked_prefill_size": Same("max_prefill_tokens", ((-1, None),), source="SGLang"),
    "context_length": Same("max_model_len", source="SGLang"),
    "random_seed": Lacks(_SEED, (None,), "SGLang"),
    "mem_fraction_static": Same("gpu_memory_utilization", source="SGLang"),
}

_NO_MIN_P = ("simsd shapes the model's distribution by its penalties, temperature, top_k and top_p (min_p: use "
             "top_p or top_k)")
#: why structured output (a JSON ``response_format``, vLLM's guided decoding, SGLang's regex) is refused
STRUCTURED = ("simsd has no structured output (constrained decoding) in any mode: vanilla, paper and exact decoding "
              "sample every step from the model's distribution, with no grammar or JSON schema masking tokens; ask "
              "for JSON in the prompt")
_STOP = ("simsd's text ends before a stop string (token_ids keep the tokens up to and including the one that "
         "completed it)")
_NONE = (None,)
#: OpenAI's ``response_format`` that asks for plain text (what simsd returns)
TEXT = {"type": "text"}
#: :class:`~simsd.config.request.SamplingParams`' fields as vLLM's (and SGLang's) spell them
REQUEST = {
    "top_k": Same("top_k", ((-1, 0),)),
    "min_p": Lacks(_NO_MIN_P, (0.0,)),
    "best_of": Lacks("simsd returns all n completions, ranking none (give n and rank them by their "
                     "cumulative_logprob with logprobs=0)", (None, 1)),
    "min_tokens": Lacks("simsd stops at the first stop id or string (ignore_eos=True with max_tokens gives a fixed "
                        "length)", (0,)),
    "include_stop_str_in_output": Lacks(_STOP, (False,)),
    "skip_special_tokens": Lacks("simsd's text keeps special tokens, as skip_special_tokens=False (decode token_ids "
                                 "with LLM.get_tokenizer() to drop them)", (False,)),
    "spaces_between_special_tokens": Lacks("simsd decodes with the tokenizer's default "
                                           "(spaces_between_special_tokens=True)", (True,)),
    "detokenize": Lacks("simsd always decodes the text (None only for a checkpoint without a tokenizer)", (True,)),
    "logits_processors": Lacks("simsd runs no logits processors (the sampling noise is keyed by seed, position, "
                               "step and token; docs/exactness.md)", _NONE),
    "logit_bias": Lacks("simsd changes no logits besides its penalties, temperature, top_k and top_p", _NONE),
    "allowed_token_ids": Lacks("simsd changes no logits besides its penalties, temperature, top_k and top_p", _NONE),
    "bad_words": Lacks("simsd changes no logits besides its penalties, temperature, top_k and top_p", _NONE),
    "guided_decoding": Lacks(STRUCTURED, _NONE),
    "structured_outputs": Lacks(STRUCTURED, _NONE),
    "response_format": Lacks(STRUCTURED, (TEXT, None), "OpenAI"),
    "truncate_prompt_tokens": Lacks("simsd never changes a prompt: a prompt longer than max_model_len is refused",
                                    _NONE),
    "max_new_tokens": Same("max_tokens", source="SGLang"),
    "min_new_tokens": Lacks("simsd stops at the first stop id or string (ignore_eos=True with max_tokens gives a "
                            "fixed length)", (0,), "SGLang"),
    "no_stop_trim": Lacks(_STOP, (False,), "SGLang"),
    "regex": Lacks(STRUCTURED, _NONE, "SGLang"),
    "json_schema": Lacks(STRUCTURED, _NONE, "SGLang"),
}

#: :meth:`simsd.LLM.chat`'s options as vLLM's ``LLM.chat`` spells them (``add_generation_prompt``
#: and ``continue_final_message`` are simsd's too)
CHAT = {
    "chat_template": Lacks("simsd renders chat messages with the checkpoint's own chat template", _NONE),
    "chat_template_kwargs": Lacks("simsd renders chat messages with the checkpoint's own chat template", _NONE),
    "tools": Lacks("simsd renders no tools into the chat template", _NONE),
    "lora_request": Lacks("simsd has no LoRA adapters", _NONE),
}


def _same(value, v) -> bool:
    """``value`` is ``v``: None and booleans by identity, numbers by value (``0`` is ``0.0``)."""
    if v is None or isinstance(v, bool) or isinstance(value, bool):
        return value is v
    return (type(value) is type(v) or {type(value), type(v)} <= {int, float}) and value == v


def translate(table: dict, kwargs: dict, where: str) -> dict:
    """``kwargs`` with ``table``'s names (:data:`ENGINE`, :data:`REQUEST`, :data:`CHAT`) as
    simsd spells them: a :class:`Same` renamed and its value mapped, a :class:`Lacks` at a no-op
    value dropped; every other name passes as it is. ``where``: the surface, for the messages
    (``LLM(...)``, ``SamplingParams(...)``).

    Raises:
        ParamError: a :class:`Lacks` at a value simsd does not do (``param`` its name; the
            message says what simsd offers), or two spellings of one setting (naming both).
    """
    if not any(k in table for k in kwargs):
        return kwargs
    out, spelt = {}, {}
    for name, value in kwargs.items():
        entry = table.get(name)
        if isinstance(entry, Lacks):
            if not (entry.noop == ANY or any(_same(value, v) for v in entry.noop)):
                keep = "" if entry.noop == () else f" (only {name}={entry.noop[0]!r}, what simsd does, is accepted)"
                raise ParamError(name, f"{where}: {name}={value!r} ({entry.source}'s) has no simsd equivalent: "
                                       f"{entry.why}{keep}")
            continue
        ours = name
        if isinstance(entry, Same):
            ours = entry.name
            value = next((b for a, b in entry.values if _same(value, a)), value)
        if ours in spelt:
            first, alias = (spelt[ours], name) if isinstance(entry, Same) else (name, spelt[ours])
            other = table[alias]
            raise ParamError(alias, f"{where}: {first} and {alias} both give {ours} ({alias} is {other.source}'s "
                                    f"spelling of {ours}): give one of them")
        spelt[ours] = name
        out[ours] = value
    return out


def request_names(cls):
    """Class decorator of :class:`~simsd.config.request.SamplingParams` (after ``@dataclass``):
    its ``__init__`` takes :data:`REQUEST`'s names (:func:`translate`) and refuses
    :data:`ENGINE`'s names that are not its fields with a :class:`ParamError` (an ``LLM(...)``
    setting) instead of a bare ``TypeError``."""
    init, own = cls.__init__, {f.name for f in dataclasses.fields(cls)}

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name in kwargs:
            entry = ENGINE.get(name)
            if entry is not None and name not in own and name not in REQUEST:
                what = (f"{entry.source}'s spelling of LLM(..., {entry.name}=...), not a request's setting"
                        if isinstance(entry, Same) else
                        f"a setting of {entry.source}'s LLM, not a request's: {entry.why}")
                raise ParamError(name, f"SamplingParams(...): {name} is {what}")
        init(self, *args, **translate(REQUEST, kwargs, "SamplingParams(...)"))

    cls.__init__ = __init__
    return cls


@functools.cache
def cli_aliases() -> dict:
    """``{simsd's setting: (option, ...)}``: vLLM's spellings of :data:`ENGINE`'s settings as
    command-line options (``--tensor-parallel-size`` for ``--tp``), for the commands that take
    the setting."""
    out = {}
    for name, entry in ENGINE.items():
        if isinstance(entry, Same) and entry.source == "vLLM" and entry.name != name:
            out[entry.name] = out.get(entry.name, ()) + ("--" + name.replace("_", "-"),)
    return out
