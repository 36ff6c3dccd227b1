"""Building an :class:`~simsd.entrypoints.api.LLM`'s engine: the checks of its settings against
the devices and the checkpoints (:func:`check_engine`, before any weight loads), the memory it
will take (:mod:`simsd.entrypoints.resources`), then the checkpoints loaded (and sharded for
tensor parallelism), the speculative decoder and the batch engine (:func:`build_engine`).

The command line runs :func:`check_engine` on its own first (``simsd generate`` checks its
prompts and memory against the read checkpoints before loading), and every LLM runs all of it.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.engine import EngineArgs
from ..config.request import SamplingParams
from ..config.speculative import SELF_DRAFT, is_self_draft
from ..config.vocabulary import at_most, opt
from ..decoding.config import DecodeConfig, resolve
from ..engine.batching import BatchEngine
from ..engine.memory import fmt_bytes, parameter_count
from ..models.loading import Checkpoint, CheckpointInfo, check_block_diffusion, load_checkpoint, read_checkpoint
from ..speculative.decoder import SpecConfig, SpeculativeDecoder, check_pair
from .errors import ParamError, SimsdWarning
from .resources import check_llm_memory, engine_size


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


def read_info(spec, config: EngineArgs):
    """A checkpoint spec as it is (loaded, or read) or read from its directory (no weights), with
    the caller's explicit ``block_length`` and ``mask_token_id`` (:func:`read_checkpoint`)."""
    if not isinstance(spec, (Checkpoint, CheckpointInfo)):
        return read_checkpoint(Path(spec), block_length=config.block_length, mask_token_id=config.mask_token_id)
    if config.mask_token_id is not None and config.mask_token_id != spec.mask_token_id:
        raise ParamError("mask_token_id", f"{opt('mask_token_id')} {config.mask_token_id!r} differs from the mask "
                                          f"token id {spec.mask_token_id} of {spec.path}")
    check_block_diffusion(spec.path, spec.config, True, config.block_length)
    return spec


def draft_of(config: EngineArgs):
    """The draft of an engine: ``config.draft`` when given; else the bundled tiny draft for the
    bundled target (the pair it was distilled for) and ``"self"`` for any other target
    (self-speculation: the target proposes its own steps, no draft model; exact mode still gives
    vanilla decoding's tokens). The one rule of the default draft, so that exact mode, the
    default mode of every surface, runs on any target without a draft model."""
    from ..assets import DEFAULT_DRAFT, DEFAULT_TARGET
    if config.draft is not None:
        return config.draft
    target = config.target if config.target is not None else DEFAULT_TARGET
    if isinstance(target, Checkpoint):
        target = target.path
    return DEFAULT_DRAFT if Path(target).resolve() == DEFAULT_TARGET.resolve() else SELF_DRAFT


def check_engine(config: EngineArgs, default_params: SamplingParams | None = None) -> tuple:
    """The checks of an engine's settings that need torch and the checkpoints' small files, before
    any weight loads: the devices, CUDA graphs, the process group of ``tp``, the attention
    backend on each device, the checkpoints (read: config, tokenizer, tensor headers), the
    block length, ``max_model_len`` and ``max_gamma`` against the models' positions,
    ``max_prefill_tokens`` and ``page_size`` against the block length, the KV settings that go
    together (``enable_prefix_caching`` needs ``page_size``; ``gpu_memory_utilization`` or
    ``kv_cache_memory``), and
    ``default_params`` against all of it (refused as a request would be; its ``max_tokens`` must
    leave a position for a prompt).

    Returns:
        ``(config, infos)``: ``config`` with the draft (:func:`draft_of`), device, draft device,
        dtype, block length and ``max_model_len`` it resolves to; ``{"target": ..., "draft": ...}`` checkpoints as given
        or read (:class:`CheckpointInfo`).

    Raises:
        ParamError: naming the setting; :class:`~simsd.models.config.CheckpointError` for a bad
            checkpoint; ``ValueError`` for a pair that does not share the tokenizer.
    """
    from simsd_kernels.backends import resolve_backend

    from ..assets import DEFAULT_TARGET
    from ..engine.tp import check_tp, rank_device, world
    if config.mode != "vanilla":
        config = dataclasses.replace(config, draft=draft_of(config))
    spec = config.mode != "vanilla" and not is_self_draft(config.draft)  # a draft model to read and load
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
    infos = {"target": read_info(config.target or DEFAULT_TARGET, config)}
    if spec:
        infos["draft"] = read_info(config.draft, config)
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
    if config.page_size is not None and config.page_size % block_length:
        raise ParamError("page_size", f"{opt('page_size')} must be a whole number of blocks (a multiple of the block "
                                      f"length {block_length}: a committed block never straddles a page's end), got "
                                      f"{config.page_size}")
    if config.enable_prefix_caching and config.page_size is None:
        raise ParamError("enable_prefix_caching", f"{opt('enable_prefix_caching')} shares KV pages: give "
                                                  f"{opt('page_size')} too")
    if config.gpu_memory_utilization is not None and config.kv_cache_memory is not None:
        raise ParamError("gpu_memory_utilization", f"{opt('gpu_memory_utilization')} and {opt('kv_cache_memory')} "
                                                   f"both size the KV caches: give one of them")
    if config.max_prefill_tokens is not None and config.max_prefill_tokens % block_length:
        raise ParamError("max_prefill_tokens", f"{opt('max_prefill_tokens')} must be a whole number of blocks (a "
                                               f"multiple of the block length {block_length}), got "
                                               f"{config.max_prefill_tokens}")
    if config.tp > 1:
        check_tp(infos["target"].config, config.tp)
    dtype = config.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config = dataclasses.replace(config, device=device, draft_device=draft_device if spec else None, dtype=dtype,
                                 block_length=block_length, max_model_len=max_model_len)
    generation_defaults(config, infos["target"])  # a value a request could not give: refused before weights load
    if default_params is not None:
        resolve(default_params, config, infos["target"].config.vocab_size)  # check_request, then the configs
        if default_params.max_tokens >= max_model_len:
            raise ParamError("max_tokens", f"{opt('max_tokens')} {default_params.max_tokens} leaves no position for "
                                           f"a prompt in the {max_model_len} positions of a request "
                                           f"({opt('max_model_len')}; a request without max_tokens would be "
                                           f"refused)")
    return config, infos


#: the sampling fields of the target's ``generation_config.json`` that are the defaults of
#: requests under ``generation_config="auto"`` (vLLM's ``--generation-config auto``,
#: ``ModelConfig.get_diff_sampling_param``, applies these and min_p and max_new_tokens, which simsd
#: does not have or keeps its own of)
GENERATION_DEFAULTS = ("temperature", "top_k", "top_p", "repetition_penalty")


def generation_defaults(config: EngineArgs, target) -> dict:
    """``{field: value}``: the :data:`GENERATION_DEFAULTS` the target's ``generation_config.json``
    sets, as :class:`SamplingParams` fields (vLLM's ``top_k`` -1, off, is 0), when
    ``config.generation_config`` is ``auto``; ``{}`` under ``none``. ``target``: a
    :class:`CheckpointInfo` or :class:`Checkpoint`.

    Raises:
        CheckpointError: a value a request could not give (naming the file and the field).
    """
    from ..models.config import CheckpointError
    if config.generation_config == "none":
        return {}
    given = {k: v for k, v in getattr(target, "generation_sampling", {}).items() if k in GENERATION_DEFAULTS}
    try:
        params = SamplingParams(**given)
    except ParamError as exc:
        raise CheckpointError(f"{target.path / 'generation_config.json'}: {exc}") from None
    return {k: getattr(params, k) for k in given}


def default_params_of(config: EngineArgs, target, params: SamplingParams | None = None, given=()) -> SamplingParams:
    """The :class:`SamplingParams` of requests that give none: ``params`` (None: simsd's defaults)
    with the target's :func:`generation_defaults` in the fields not named in ``given`` (the
    command line's typed options). The one place the checkpoint's sampling defaults apply: the
    Python API's ``default_params`` when the caller gives none, ``simsd serve``'s request
    defaults and ``simsd generate``'s options not typed."""
    params = SamplingParams() if params is None else params
    return dataclasses.replace(params, **{k: v for k, v in generation_defaults(config, target).items()
                                          if k not in given})


def run_warnings(target, draft, block_length: int | None, generation_config: str = "auto") -> list:
    """What a run is allowed to do but should say, one line each: a ``block_length`` (the caller's)
    other than the target's ``block_size``, a draft trained for another block length than the
    target, a draft with more parameters than the target, the sampling fields of a
    checkpoint's ``generation_config.json`` that are not applied (checkpoints or infos): under
    ``generation_config`` ``auto`` the target's ``do_sample`` (as vLLM, which reads the
    temperature) and the draft's fields; none under ``none`` (the caller's choice)."""
    notes, tb = [], target.config.block_size
    for ck in (target, draft) if generation_config == "auto" else ():
        sampling = getattr(ck, "generation_sampling", None) or {}
        ignored = {k: v for k, v in sampling.items() if ck is draft or k not in GENERATION_DEFAULTS}
        if ignored:
            why = ("the target's generation_config.json gives the defaults of requests" if ck is draft else
                   "requests sample at its temperature, top_k, top_p and repetition_penalty unless they give "
                   "their own, as vLLM "
                   "does; greedy without a temperature")
            notes.append(f"{ck.path / 'generation_config.json'}: {', '.join(f'{k}={v!r}' for k, v in ignored.items())} "
                         f"not applied: {why}")
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


@dataclass
class BuiltEngine:
    """What :func:`build_engine` returns: ``config`` (the :class:`EngineArgs` with the devices,
    dtype, block length and ``max_model_len`` resolved), the loaded ``target`` and ``draft``
    (None in vanilla mode) :class:`~simsd.models.loading.Checkpoint`, ``decoder`` (the one
    :class:`~simsd.speculative.decoder.SpeculativeDecoder` of every request; None in vanilla
    mode), the :class:`~simsd.engine.batching.BatchEngine` and ``kv_cache_bytes`` (its caches,
    every model)."""
    config: EngineArgs
    target: Checkpoint
    draft: Checkpoint | None
    decoder: SpeculativeDecoder | None
    engine: BatchEngine
    kv_cache_bytes: int


def load(info, dtype, device, backend) -> Checkpoint:
    """``info`` loaded (a :class:`CheckpointInfo`, with ``dtype`` on ``device``) or as it is (a
    loaded :class:`Checkpoint`); ``backend``: its attention backend (None: ``auto``, or a
    loaded checkpoint's own)."""
    if isinstance(info, Checkpoint):
        if backend is not None:
            info.model.attention_backend = backend
        return info
    ckpt = load_checkpoint(info.path, dtype=dtype, device=device, info=info)
    ckpt.model.attention_backend = backend or "auto"
    return ckpt


def build_engine(config: EngineArgs, default_params: SamplingParams | None = None, stacklevel: int = 2) -> BuiltEngine:
    """Check ``config`` (:func:`check_engine`; ``default_params`` as a request), warn what it is
    allowed but should say (:func:`run_warnings`, :class:`SimsdWarning` at ``stacklevel``), set
    the CPU threads, check that weights, caches and workspace fit (before any weight loads:
    a CPU's OOM killer gives no message), load the checkpoints, shard a tensor-parallel
    target, build the speculative decoder and the engine.

    Raises:
        ParamError: a bad setting or combination, or a run that does not fit the memory (the
            message names what would fit); :class:`~simsd.models.config.CheckpointError`;
            ``ValueError`` for a pair that does not share the tokenizer.
    """
    from ..engine.threads import apply_threads
    from ..engine.tp import shard_model, world
    given_block_length = config.block_length
    config, infos = check_engine(config, default_params)
    for note in run_warnings(infos["target"], infos.get("draft"), given_block_length, config.generation_config):
        warnings.warn(note, SimsdWarning, stacklevel=stacklevel + 1)
    apply_threads([i.config for i in infos.values()], config.threads)
    size = engine_size(config, infos)
    check_llm_memory(config, infos, size)
    target = load(infos["target"], config.dtype, config.device, config.attention_backend)
    if config.invariant is not None or not isinstance(infos["target"], Checkpoint):
        target.model.invariant = bool(config.invariant)
    if config.tp > 1 and target.model.tp != (world()[0], config.tp):
        shard_model(target.model, world()[0], config.tp)
    draft = decoder = None
    models = {"target": target.model}
    if config.mode != "vanilla":
        if is_self_draft(config.draft):
            draft_arg = SELF_DRAFT
        else:
            draft = draft_arg = load(infos["draft"], config.dtype, config.draft_device, config.attention_backend)
            models["draft"] = draft.model
        # refuses the combinations the rows cannot run, with the devices of the loaded checkpoints
        decoder = SpeculativeDecoder(
            target, draft_arg, DecodeConfig(block_length=config.block_length, fold_commit=config.fold_commit),
            SpecConfig(config.mode, on_reject=config.on_reject, rope_copy=config.rope_copy,
                       optimistic=config.optimistic, paper_variant=config.paper_variant,
                       speculation_width=config.speculation_width), check=False)
    try:
        engine = BatchEngine(models, config.block_length, size.rows, size.capacity, size.margin,
                             cuda_graphs=config.cuda_graphs, max_prefill_tokens=config.max_prefill_tokens,
                             page_size=size.page_size, num_pages=size.num_pages,
                             prefix_caching=config.enable_prefix_caching)
    except RuntimeError as exc:  # torch.OutOfMemoryError among them
        if "out of memory" not in str(exc).lower():
            raise
        raise ParamError("batch_size", f"the KV caches of {size.rows} rows x {config.max_model_len} positions "
                                       f"({fmt_bytes(size.kv_cache_bytes)}) do not fit: lower {opt('batch_size')} or "
                                       f"{opt('max_model_len')}, or set {opt('kv_cache_memory')}") from None
    return BuiltEngine(config, target, draft, decoder, engine, size.kv_cache_bytes)
