"""Load an HF-format SDAR checkpoint directory: config, safetensors weights, tokenizer,
generation config. Only files are read; nothing is downloaded and no remote code runs.

Two stages, so that a caller can check everything before the weights take memory:
:func:`read_checkpoint` reads and checks every small file (config, generation config,
tokenizer, index) and the ids they define; :func:`load_checkpoint` then loads the weights.
Every problem is a :class:`CheckpointError` with one line naming the file: a file that is not
valid JSON or not of the expected shape, a config field simsd does not implement
(:mod:`simsd.models.validation`), a mask id that the tokenizer or the stop ids contradict,
tensors that are missing, unexpected, of the wrong shape or not where the index says.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .config import CheckpointError, ModelConfig, read_json
from .model import SDARForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
#: tokenizer files that are JSON (checked before transformers reads them, so errors name the file)
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "vocab.json")
INDEX = "model.safetensors.index.json"


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def read_index(path: Path) -> dict | None:
    """``{tensor name: shard file name}`` from ``model.safetensors.index.json``, or None without one.

    Raises:
        CheckpointError: invalid JSON, no ``weight_map`` object of string -> string, a shard
            name outside the directory; names the index file.
    """
    index = path / INDEX
    if not index.is_file():
        return None
    raw = read_json(index, "weight index")
    wmap = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or "weight_map" not in raw:
        raise CheckpointError(f"{index}: no 'weight_map' (tensor name -> shard file) in the weight index")
    if not isinstance(wmap, dict) or not wmap:
        raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file")
    for name, shard in wmap.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index}: weight_map[{name!r}] = {shard!r} is not a file name")
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise CheckpointError(f"{index}: weight_map[{name!r}] = {shard!r} points outside the checkpoint")
    return wmap


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    wmap = read_index(path)
    if wmap is not None:
        shards = sorted(set(wmap.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{path / INDEX} names missing shard(s): {', '.join(missing)}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(f"no model.safetensors (or index) in {path}")


def _cite(files: list) -> str:
    return ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _shape_of(model_config: ModelConfig) -> dict:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in SDARForCausalLM(model_config).state_dict().items()}


def scan_weights(path, config: ModelConfig) -> dict:
    """Check the tensors of a checkpoint from the safetensors headers alone (nothing is loaded)
    against what ``config`` implies; returns ``{tensor name: file}``.

    ``lm_head.weight`` is used when present; without it the head is tied to the embedding only
    when ``tie_word_embeddings`` is true (as transformers does; false and no head is an error).

    Raises:
        CheckpointError: a damaged file, a tensor of the wrong shape or not floating point
            (named), missing or unexpected tensors, a tensor the index places in another shard
            or that two shards hold, a head that contradicts ``tie_word_embeddings``.
    """
    path = Path(path)
    expected = _shape_of(config)
    wmap = read_index(path)
    where: dict = {}
    for f in weight_files(path):
        try:
            handle_cm = safe_open(str(f), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error type for damaged files
            raise CheckpointError(f"{f}: not a readable safetensors file ({' '.join(str(exc).split())})") from exc
        with handle_cm as handle:
            for name in handle.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name not in expected:
                    raise CheckpointError(f"{f}: unexpected tensor {name!r}")
                if name in where:
                    raise CheckpointError(f"{f}: tensor {name!r} is also in {where[name]}")
                if wmap is not None and wmap.get(name, f.name) != f.name:
                    raise CheckpointError(f"{path / INDEX}: places {name!r} in {wmap[name]}, but it is in {f.name}")
                sl = handle.get_slice(name)
                shape, dt = tuple(sl.get_shape()), sl.get_dtype()
                if shape != expected[name]:
                    raise CheckpointError(f"{f}: tensor {name!r} has shape {shape}, expected {expected[name]}")
                if not (dt.startswith("F") or dt.startswith("BF")):
                    raise CheckpointError(f"{f}: tensor {name!r} has dtype {dt}, expected a floating point type")
                where[name] = f
    if wmap is not None:
        absent = sorted(n for n in wmap if n not in where and not n.endswith("rotary_emb.inv_freq"))
        if absent:
            raise CheckpointError(f"{path / INDEX}: names tensor(s) no shard holds: {', '.join(absent[:3])}")
    cfg_file = path / "config.json"
    if "lm_head.weight" not in where and not config.tie_word_embeddings:
        raise CheckpointError(f"{cfg_file}: tie_word_embeddings is false (or absent) but no weight file holds "
                              f"'lm_head.weight' ({_cite(sorted(set(where.values())))})")
    missing = sorted(set(expected) - set(where) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return where


def load_model(path, dtype="float32", device="cpu", config: ModelConfig | None = None) -> SDARForCausalLM:
    """Build :class:`SDARForCausalLM` from ``path`` with weights in ``dtype`` on ``device``
    (tensors checked first by :func:`scan_weights`).

    Raises:
        CheckpointError: see :func:`scan_weights`; also a tied head that differs from the embedding.
    """
    path = Path(path)
    config = config or ModelConfig.from_dir(path)
    dtype = parse_dtype(dtype)
    where = scan_weights(path, config)
    with torch.device("meta"):
        model = SDARForCausalLM(config)
    state = {}
    for f in sorted(set(where.values())):
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if name in where:
                    state[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
    tied = config.tie_word_embeddings
    if tied:
        if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise CheckpointError(f"{path / 'config.json'}: tie_word_embeddings is true but 'lm_head.weight' "
                                  f"differs from 'model.embed_tokens.weight'")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


@dataclass
class CheckpointInfo:
    """What a checkpoint directory defines besides its weights (:func:`read_checkpoint`)."""
    path: Path
    config: ModelConfig
    tokenizer: object
    mask_token_id: int
    stop_ids: list = field(default_factory=list)
    #: the sampling fields of generation_config.json (:data:`GENERATION_SAMPLING_FIELDS`) that
    #: it sets, with their values (the target's temperature, top_k, top_p and repetition_penalty
    #: are the defaults of requests: :func:`simsd.entrypoints.builder.generation_defaults`)
    generation_sampling: dict = field(default_factory=dict)


@dataclass
class Checkpoint:
    """A loaded checkpoint: model, tokenizer (or None), mask id and stop ids."""
    path: Path
    model: SDARForCausalLM
    tokenizer: object
    mask_token_id: int
    stop_ids: list = field(default_factory=list)
    generation_sampling: dict = field(default_factory=dict)  # as CheckpointInfo's

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def _check_tokenizer_files(path: Path) -> list:
    present = [path / n for n in TOKENIZER_JSON if (path / n).is_file()]
    for f in present:
        raw = read_json(f, "tokenizer file")
        if not isinstance(raw, dict):
            raise CheckpointError(f"{f}: expected a JSON object, got {type(raw).__name__}")
    return present


def load_tokenizer(path):
    """transformers' AutoTokenizer from the checkpoint directory (never trust_remote_code).

    Raises:
        CheckpointError: a tokenizer file that is not valid JSON (named), a tokenizer that
            transformers cannot build, or a chat template that does not compile.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    files = _check_tokenizer_files(path) + [f for f in (path / "chat_template.jinja",) if f.is_file()]
    try:
        with warnings.catch_warnings():  # it parses config.json to find the tokenizer class: a supported
            # "rope_scaling": null (SDAR's configs, checked by ModelConfig) is named deprecated by transformers 5
            warnings.filterwarnings("ignore", message="`rope_scaling` is deprecated", category=FutureWarning)
            tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:  # tokenizers, transformers and jinja raise many types
        msg = " ".join(str(exc).split()) or type(exc).__name__
        if not (path / "tokenizer.json").is_file():
            names = ", ".join(f.name for f in sorted(path.iterdir()) if f.is_file())
            raise CheckpointError(f"{path}: cannot load the tokenizer: there is no tokenizer.json (the tokenizers "
                                  f"library's file, which SDAR checkpoints ship) and transformers could not build "
                                  f"one from the files there ({names}): {msg}") from exc
        raise CheckpointError(f"{_cite(files) or path}: cannot load the tokenizer ({msg})") from exc
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str):
        import jinja2
        src = path / "chat_template.jinja"
        src = src if src.is_file() else path / "tokenizer_config.json"
        try:
            jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as exc:
            raise CheckpointError(f"{src}: the chat template does not compile ({exc.message}, line "
                                  f"{exc.lineno})") from exc
    return tok


def _ids(value, where: Path, field: str) -> list:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if value is None or ok:
        return [] if value is None else [value]
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise CheckpointError(f"{where}: {field} = {value!r} must be a token id or a list of token ids")


#: the sampling fields of ``generation_config.json`` a checkpoint reports
#: (:attr:`CheckpointInfo.generation_sampling`): the target's temperature, top_k, top_p and
#: repetition_penalty are the defaults of requests (:func:`simsd.entrypoints.builder.generation_defaults`);
#: the others are named once per run as not applied (:func:`simsd.entrypoints.builder.run_warnings`)
GENERATION_SAMPLING_FIELDS = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty")


def read_generation_config(path: Path) -> dict:
    """``path/generation_config.json`` as a dict (empty when the file is absent).

    Raises:
        CheckpointError: invalid JSON, or not a JSON object (naming the file).
    """
    gen = path / "generation_config.json"
    if not gen.is_file():
        return {}
    raw = read_json(gen, "generation config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{gen}: expected a JSON object, got {type(raw).__name__}")
    return raw


def stop_ids_of(path: Path, config_raw: dict, generation_raw: dict, tokenizer) -> dict:
    """The stop ids, each with the file that named it: the union of ``eos_token_id`` (an int or a
    list) in ``generation_config.json`` and in ``config.json`` (as vLLM does: a chat model whose
    generation config names only ``<|endoftext|>`` still stops at the ``<|im_end|>`` its config
    names); when neither names one, the tokenizer's eos token (its file None). Returns
    ``{id: Path | None}`` in ascending id order."""
    sources: dict = {}
    for raw, where in ((generation_raw, path / "generation_config.json"), (config_raw, path / "config.json")):
        for i in _ids(raw.get("eos_token_id"), where, "eos_token_id"):
            sources.setdefault(i, where)
    if not sources and tokenizer is not None and tokenizer.eos_token_id is not None:
        sources[int(tokenizer.eos_token_id)] = None
    return dict(sorted(sources.items()))


def check_block_diffusion(path, config: ModelConfig, has_mask: bool, block_length=None) -> None:
    """Refuse a checkpoint that does not say it is a block-diffusion (SDAR) model: a config with no
    ``block_size`` (model_type ``qwen3`` without it: a plain autoregressive Qwen3, as far as the
    files say) unless the caller gives ``block_length`` explicitly; no mask token (``has_mask``:
    one from the config, the tokenizer or the caller). The explicit options are the caller's
    statement that the model was trained for block diffusion with that block length and mask.

    Raises:
        CheckpointError: one line naming ``path/config.json``, what is missing and the options.
    """
    lacks = [("block_size", "--block-length N", "block_length=N")] \
        if config.block_size is None and block_length is None else []
    if not has_mask:
        lacks.append(("mask token (mask_token_id, or the tokenizer's mask_token)", "--mask-token-id ID",
                      "mask_token_id=ID"))
    if lacks:
        missing, flags, params = zip(*lacks)
        raise CheckpointError(f"{Path(path) / 'config.json'}: no {' and no '.join(missing)}: simsd decodes "
                              f"block-diffusion (SDAR) models; to decode this {config.model_type} checkpoint as one, "
                              f"pass {' and '.join(flags)} (simsd.LLM: {', '.join(params)})")


def read_checkpoint(path, with_tokenizer: bool = True, *, block_length=None,
                    mask_token_id: int | None = None) -> CheckpointInfo:
    """Read and check everything of an SDAR directory without loading the weights: config,
    generation config, tokenizer, the weight index and the tensors' names, shapes and dtypes
    (:func:`scan_weights`, from the file headers), the mask id and the stop ids.

    The mask id comes from ``mask_token_id`` in ``config.json`` or the tokenizer's ``mask_token``;
    when both are given they must agree, and it must not be a stop id. ``mask_token_id`` (the
    caller's) must agree with them, or stands alone for a checkpoint that names none.
    ``block_length``: the block length the caller will decode with, when given explicitly
    (:func:`check_block_diffusion`). Stop ids and the tokenizer's ids must lie inside the model's
    vocabulary.

    Raises:
        CheckpointError: one line naming the file and the field or value at fault.
    """
    path = Path(path)
    config = ModelConfig.from_dir(path)
    cfg_file = path / "config.json"
    raw = read_json(cfg_file, "model config")
    has_tok = any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = load_tokenizer(path) if (with_tokenizer and has_tok) else None
    V = config.vocab_size
    if tokenizer is not None and len(tokenizer) > V:
        raise CheckpointError(f"{path}: the tokenizer has {len(tokenizer)} tokens but {cfg_file} has vocab_size {V} "
                              f"(ids >= {V} have no embedding)")
    mask_id = config.mask_token_id
    tok_mask = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if mask_id is not None and tok_mask is not None and tok_mask != mask_id:
        raise CheckpointError(f"{cfg_file}: mask_token_id = {mask_id} but the tokenizer's mask token "
                              f"{tokenizer.mask_token!r} is id {tok_mask}")
    source = cfg_file if mask_id is not None else f"{path} (the tokenizer's mask token)"
    if mask_id is None:
        mask_id = tok_mask
    if mask_token_id is not None:
        if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < V:
            raise CheckpointError(f"{cfg_file}: the mask token id given, {mask_token_id!r}, is not a token id of "
                                  f"the vocabulary [0, {V})")
        if mask_id is not None and mask_id != mask_token_id:
            raise CheckpointError(f"{source}: mask_token_id = {mask_id}, but the mask token id given is "
                                  f"{mask_token_id}")
        if mask_id is None:
            mask_id, source = mask_token_id, f"{path} (the mask token id given)"
    check_block_diffusion(path, config, mask_id is not None, block_length)
    generation = read_generation_config(path)
    stops = stop_ids_of(path, raw, generation, tokenizer)

    def where(i):
        return stops[i] or f"{path} (the tokenizer's eos token)"
    bad = [s for s in stops if not 0 <= s < V]
    if bad:
        raise CheckpointError(f"{where(bad[0])}: eos_token_id {bad[0]} is outside the vocabulary [0, {V})")
    if mask_id in stops:
        raise CheckpointError(f"{source}: mask_token_id = {mask_id} is also a stop id (eos_token_id in "
                              f"{where(mask_id)}); the mask token cannot end generation")
    scan_weights(path, config)
    sampling = {k: generation[k] for k in GENERATION_SAMPLING_FIELDS if generation.get(k) is not None}
    return CheckpointInfo(path, config, tokenizer, int(mask_id), list(stops), sampling)


def load_checkpoint(path, dtype="float32", device="cpu", with_tokenizer=True,
                    info: CheckpointInfo | None = None, *, block_length=None,
                    mask_token_id: int | None = None) -> Checkpoint:
    """Load model, tokenizer, mask id and stop ids from an SDAR directory (``info``: the
    :func:`read_checkpoint` result, when the caller read it already; ``block_length`` and
    ``mask_token_id``: the caller's explicit options, see :func:`read_checkpoint`).

    Raises:
        CheckpointError: see :func:`read_checkpoint` and :func:`load_model`.
    """
    info = info or read_checkpoint(path, with_tokenizer, block_length=block_length, mask_token_id=mask_token_id)
    model = load_model(info.path, dtype, device, config=info.config)
    return Checkpoint(info.path, model, info.tokenizer, info.mask_token_id, info.stop_ids, info.generation_sampling)
