"""The settings of the entry points, each declared once: an engine's (:class:`EngineArgs`, the
keywords of :class:`~simsd.entrypoints.api.LLM`) and a request's (:class:`SamplingParams`, of
the Python API and the server), and :func:`resolve`, which turns a request into the
configurations its row program takes.

Every field is declared with a :class:`~simsd.decoding.choices.Setting` (type, range, help,
the decoding modes that use it; the decoding settings are the ones of
:data:`simsd.decoding.choices.SETTINGS`) and checked when the object is built; the command
lines (:mod:`simsd.entrypoints.cli`) and the server's request bodies
(:mod:`simsd.entrypoints.protocol`) are generated from these fields, under the same names.
Every refusal is a :class:`~simsd.decoding.choices.ParamError` naming the field. Torch-free,
so that the command line checks its options before torch loads.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, fields
from pathlib import Path

from ..decoding.choices import (
    MODES,
    SETTINGS,
    SPECULATIVE,
    ParamError,
    Setting,
    check_fields,
    check_fold_commit,
    check_gamma,
    check_modes,
    check_release,
    check_threshold,
    draft_settings,
    opt,
    settings_of,
)
from ..decoding.choices import SamplingParams as StepSampling

#: the largest seed (a signed 64-bit value; :mod:`simsd.decoding.noise` keys the noise with it)
SEED_MAX = SETTINGS["seed"].high
DTYPES = ("float32", "bfloat16", "float16", "float64")
#: the server's default request body limit (``simsd serve --max-request-bytes``): far above any
#: prompt a context holds (a 128k-token prompt as JSON ids is under 1 MiB), far below the memory
#: a body costs
MAX_REQUEST_BYTES = 8 * 2 ** 20
#: seconds the requests in flight may take to finish after SIGTERM/SIGINT before the server
#: cancels them (``simsd serve --shutdown-timeout``; Kubernetes' default grace period is 30 s)
SHUTDOWN_TIMEOUT = 30.0
BACKENDS = ("auto", "cuda", "triton", "torch")


@dataclass(frozen=True)
class EngineArgs:
    """The settings of an :class:`~simsd.entrypoints.api.LLM`, fixed when its engine is built
    (each field's help is the command line's ``--help``).

    Raises:
        ParamError: a field of the wrong type or out of range, a setting the mode does not use
            (``draft`` ... in vanilla mode, ``rope_copy=False`` outside paper mode),
            ``scheduler_thread`` with ``tp > 1``, ``invariant`` with ``cuda_graphs``,
            ``fold_commit`` with optimistic drafting.
    """
    target: object = Setting(Path, "target SDAR checkpoint directory (HF format; the Python API also takes a read "
                                   "CheckpointInfo or a loaded Checkpoint); default: the bundled tiny "
                                   "target").field(None)
    draft: object = Setting(Path, "draft SDAR checkpoint, as the target (paper/exact modes); default: the bundled "
                                  "tiny draft",
                            modes=SPECULATIVE).field(None)
    mode: str = SETTINGS["mode"].field("exact")
    device: object = Setting(object, "device of the target: cpu, cuda, cuda:1 ... (default: cuda if available, "
                                     "else cpu; ignored for a loaded checkpoint)").field(None)
    draft_device: object = Setting(object, "device of the draft (default: the target's)",
                                   modes=SPECULATIVE).field(None)
    dtype: str | None = Setting(str, "weights and activations dtype (default: bfloat16 on cuda, float32 on cpu)",
                                choices=DTYPES).field(None)
    batch_size: int = Setting(int, "the most requests decoded together (engine rows)", low=1).field(8)
    max_model_len: int | None = Setting(int, "positions per request, prompt + max_tokens (default: the models' "
                                             "maximum); each row's KV cache holds this many", low=1).field(None)
    kv_cache_memory: float | None = Setting(float, "memory the KV caches (target and draft) may take; fewer rows "
                                                   "than batch_size if they do not fit (default: batch_size rows)",
                                            low=0, open_low=True, unit="bytes").field(None)
    max_waiting: int = Setting(int, "requests that may wait for a row; beyond it submit raises QueueFull (the "
                                    "server answers 503)", low=0).field(64)
    block_length: int | None = SETTINGS["block_length"].field(None)
    mask_token_id: int | None = Setting(int, "the mask token's id, for checkpoints that name none (default: "
                                             "mask_token_id in config.json or the tokenizer's mask_token)",
                                        low=0).field(None)
    fold_commit: bool = SETTINGS["fold_commit"].field(False)
    on_reject: str = SETTINGS["on_reject"].field("redraft")
    rope_copy: bool = SETTINGS["rope_copy"].field(True)
    paper_variant: str = SETTINGS["paper_variant"].field("described")
    optimistic: bool | None = SETTINGS["optimistic"].field(None)
    max_gamma: int | None = Setting(int, "the most draft steps a request verifies per round, and the gamma of "
                                         "requests that give none (default: the block length); the caches hold "
                                         "its verify forwards", low=1, modes=SPECULATIVE).field(None)
    attention_backend: str | None = Setting(str, "attention kernels: auto picks cuda > triton > torch on a GPU, "
                                                 "torch on the CPU (SIMSD_ATTENTION_BACKEND overrides auto; "
                                                 "default: auto, a loaded checkpoint keeps its own)",
                                            choices=BACKENDS).field(None)
    cuda_graphs: bool = Setting(bool, "replay the per-shape forwards as CUDA graphs (CUDA devices only)").field(False)
    invariant: bool | None = Setting(bool, "shape-invariant numerics for the target (norms, projections and MLP "
                                           "per block-sized unit): exact mode then equals vanilla bit for bit in "
                                           "every dtype on the torch backend; slower verify forwards (default: "
                                           "off, a loaded checkpoint keeps its own)").field(None)
    tp: int = Setting(int, "shard the target tensor-parallel over N ranks (torch.distributed; the command line "
                           "spawns them or runs under torchrun)", low=1).field(1)
    threads: int | None = Setting(int, "CPU threads for torch's intra-op work (default: OMP_NUM_THREADS if set, "
                                       "else chosen from the model size: 1 for models as small as the bundled "
                                       "pair)", low=1).field(None)
    scheduler_thread: bool | None = Setting(bool, "run the scheduler on its own thread (default, unless tp > 1); "
                                                  "off: on the thread that waits for a result").field(None)

    def __post_init__(self):
        check_fields(self)
        defaults = {f.name: f.default for f in fields(self)}
        check_modes({n: s for n, s in settings_of(self).items() if getattr(self, n) != defaults[n]}, [self.mode])
        check_release(self.paper_variant, self.max_gamma, self.on_reject, "max_gamma")
        if self.scheduler_thread and self.tp > 1:
            raise ParamError("scheduler_thread", f"{opt('tp')} > 1 needs {opt('scheduler_thread', False)} (the "
                                                 f"ranks must run the same rounds)")
        if self.invariant and self.cuda_graphs:
            raise ParamError("invariant", f"{opt('invariant')} is not available with {opt('cuda_graphs')} (the "
                                          f"graph runner does not run the per-unit path)")
        if self.mode != "vanilla" and self.fold_commit:
            apart = self.draft_device is not None and not same_device(self.draft_device, self.device)
            check_fold_commit(True, self.optimistic,
                              f"{self.draft_device} != {self.device or 'the default device'}" if apart else None)


def same_device(a, b) -> bool:
    """Whether two device settings name the same device (None: the default, cuda if available)."""
    import torch
    dev = lambda d: torch.device(d or ("cuda" if torch.cuda.is_available() else "cpu"))  # noqa: E731
    try:
        x, y = dev(a), dev(b)
    except (RuntimeError, TypeError):
        return a == b  # a bad name is refused by the device check
    return x.type == y.type and (x.type == "cpu" or (x.index or 0) == (y.index or 0))


ENGINE_SETTINGS = tuple(f.name for f in fields(EngineArgs))


@dataclass(frozen=True)
class SamplingParams(StepSampling):
    """What one request asks for (vLLM's ``SamplingParams`` in shape; defaults: greedy, 128
    tokens). A step's sampling (``temperature``, ``top_k``, ``top_p``; it *is* a
    :class:`simsd.decoding.sampling.SamplingParams`, so it also fits
    ``DecodeConfig(sampling=...)``), the OpenAI-style request fields, and the SDAR decoding
    settings of the request (docs/design.md §3-4); see each field's help. ``seed`` None: a
    fresh one, reported in the output so the request can be replayed.

    The engine's settings (:class:`EngineArgs`) belong to the :class:`~simsd.entrypoints.api.LLM`:
    ``SamplingParams(block_length=8)`` is refused with a ``ParamError`` that says so.

    Raises:
        ParamError: a field of the wrong type or out of range, ``n`` other than 1, a threshold
            outside its strategy's range, an LLM setting (``param`` names it).
    """
    max_tokens: int = SETTINGS["max_tokens"].field(128)
    seed: int | None = SETTINGS["seed"].field(None)
    stop: tuple = Setting(str, "strings that end the generation (the text ends before the first one)", low=1,
                          many=True).field(())
    stop_token_ids: tuple = Setting(int, "ids that end the generation besides the checkpoint's own (kept in the "
                                         "output)", low=0, many=True).field(())
    ignore_eos: bool = Setting(bool, "do not stop at the checkpoint's stop ids (benchmarks)").field(False)
    steps: int | None = SETTINGS["steps"].field(None)
    strategy: str = SETTINGS["strategy"].field("static")
    threshold: float | None = SETTINGS["threshold"].field(None)
    gamma: int | None = SETTINGS["gamma"].field(None)
    draft_strategy: str | None = SETTINGS["draft_strategy"].field(None)
    draft_threshold: float | None = SETTINGS["draft_threshold"].field(None)
    n: int | None = Setting(int, "completions per request: simsd returns one (n=1; None = 1)", low=1).field(None)

    def __new__(cls, *args, **kwargs):
        # runs before the dataclass's __init__, which would refuse these with a bare TypeError
        for name in kwargs:
            if name in ENGINE_SETTINGS:
                raise ParamError(name, f"{name} is an LLM(...) setting, fixed when the engine is built, not a "
                                       f"request's: pass it to simsd.LLM(..., {name}=...)")
        return super().__new__(cls)

    def __post_init__(self):
        check_fields(self)
        if self.n not in (None, 1):
            raise ParamError("n", f"n={self.n}: simsd returns one completion per request (n=1); submit the prompt "
                                  f"{self.n} times with different seeds for more")
        object.__setattr__(self, "n", 1)
        check_threshold(self.strategy, self.threshold)
        draft_settings(self.strategy, self.threshold, self.draft_strategy, self.draft_threshold)


def resolve(params: SamplingParams, config: EngineArgs, vocab_size: int) -> tuple:
    """``(DecodeConfig, SpecConfig or None, seed)`` of a request to an engine of ``config`` (its
    ``block_length`` set) and a vocabulary of ``vocab_size``: the checks that need the mode and
    the model, then the configurations the row programs take. A request without ``gamma``
    verifies ``max_gamma`` (else the block length) draft steps per round.

    Raises:
        ParamError: ``steps`` or ``gamma`` above the block length, ``gamma`` above the LLM's
            ``max_gamma``, ``gamma`` / ``draft_strategy`` / ``draft_threshold`` in vanilla mode,
            a stop id outside the vocabulary.
    """
    from ..decoding.config import DecodeConfig
    from ..speculative.decoder import SpecConfig
    if not isinstance(params, SamplingParams):
        raise ParamError("params", f"params must be simsd.SamplingParams, got {type(params).__name__}")
    check_modes({n: s for n, s in settings_of(params).items() if s.modes != MODES and getattr(params, n) is not None},
                [config.mode])
    check_gamma(params.gamma, config.block_length)
    check_release(config.paper_variant, params.gamma, "redraft")
    if params.gamma is not None and config.max_gamma is not None and params.gamma > config.max_gamma:
        raise ParamError("gamma", f"{opt('gamma')} {params.gamma} exceeds this LLM's {opt('max_gamma')} "
                                  f"{config.max_gamma} (its caches hold the verify forwards of at most that many "
                                  f"draft steps)")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ParamError("stop_token_ids", f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    seed = secrets.randbelow(2 ** 62) if params.seed is None else params.seed  # a fresh one is reported back
    cfg = DecodeConfig(block_length=config.block_length, steps=params.steps, strategy=params.strategy,
                       threshold=params.threshold,
                       sampling=StepSampling(params.temperature, params.top_k, params.top_p),
                       max_new_tokens=params.max_tokens, seed=seed, fold_commit=config.fold_commit)
    spec = None
    if config.mode != "vanilla":
        spec = SpecConfig(mode=config.mode, gamma=params.gamma or config.max_gamma, on_reject=config.on_reject,
                          rope_copy=config.rope_copy, draft_strategy=params.draft_strategy,
                          optimistic=config.optimistic, draft_threshold=params.draft_threshold,
                          paper_variant=config.paper_variant)
    return cfg, spec, seed
