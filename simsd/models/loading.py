"""Load an HF-format SDAR checkpoint directory: config, safetensors weights, tokenizer,
generation config. Only files are read; nothing is downloaded and no remote code runs."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .config import CheckpointError, ModelConfig
from .model import SDARForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} names missing shard(s): {', '.join(missing)}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(f"no model.safetensors (or index) in {path}")


def load_model(path, dtype="float32", device="cpu") -> SDARForCausalLM:
    """Build :class:`SDARForCausalLM` from ``path`` with weights in ``dtype`` on ``device``.

    Raises:
        CheckpointError: missing files, a tensor of the wrong shape (named), missing or
            unexpected tensors.
    """
    path = Path(path)
    config = ModelConfig.from_dir(path)
    dtype = parse_dtype(dtype)
    with torch.device("meta"):
        model = SDARForCausalLM(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = {}
    for f in weight_files(path):
        try:
            handle_cm = safe_open(str(f), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error type for damaged files
            raise CheckpointError(f"{f}: not a readable safetensors file ({exc})") from exc
        with handle_cm as handle:
            for name in handle.keys():
                if name not in expected:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    raise CheckpointError(f"{f}: unexpected tensor {name!r}")
                t = handle.get_tensor(name)
                if tuple(t.shape) != tuple(expected[name]):
                    raise CheckpointError(
                        f"{f}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(expected[name])}"
                    )
                state[name] = t.to(device=device, dtype=dtype)
    tied = "lm_head.weight" not in state
    if tied:
        if "model.embed_tokens.weight" not in state:
            raise CheckpointError(f"{path}: missing tensor 'model.embed_tokens.weight'")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


@dataclass
class Checkpoint:
    """A loaded checkpoint: model, tokenizer (or None), mask id and stop ids."""
    path: Path
    model: SDARForCausalLM
    tokenizer: object
    mask_token_id: int
    stop_ids: list = field(default_factory=list)

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def load_tokenizer(path):
    """transformers' AutoTokenizer from the checkpoint directory (never trust_remote_code)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({exc})") from exc


def stop_ids_of(path: Path, config_raw: dict, tokenizer) -> list[int]:
    """Stop ids from ``generation_config.json`` (``eos_token_id``, int or list), else config/tokenizer."""
    ids = None
    gen = path / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = config_raw.get("eos_token_id")
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return sorted({int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])})


def load_checkpoint(path, dtype="float32", device="cpu", with_tokenizer=True) -> Checkpoint:
    """Load model, tokenizer, mask id and stop ids from an SDAR directory.

    Raises:
        CheckpointError: see :func:`load_model`; also when neither the config's
            ``mask_token_id`` nor the tokenizer's ``mask_token`` gives the mask id.
    """
    path = Path(path)
    model = load_model(path, dtype, device)
    raw = json.loads((path / "config.json").read_text())
    has_tok = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(path) if (with_tokenizer and has_tok) else None
    mask_id = model.config.mask_token_id
    if mask_id is None and tokenizer is not None:
        mask_id = tokenizer.mask_token_id
    if mask_id is None:
        raise CheckpointError(
            f"{path}: no mask token: set mask_token_id in config.json or mask_token in the tokenizer"
        )
    if not 0 <= int(mask_id) < model.config.vocab_size:
        raise CheckpointError(f"{path}: mask_token_id {mask_id} outside the vocabulary ({model.config.vocab_size})")
    return Checkpoint(path, model, tokenizer, int(mask_id), stop_ids_of(path, raw, tokenizer))
