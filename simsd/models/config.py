"""Model configuration read from an HF-format SDAR (or Qwen3) checkpoint directory.

``config.json`` is parsed by transformers' ``Qwen3Config`` (SDAR uses Qwen3's field names);
simsd adds the SDAR fields ``block_size`` and ``mask_token_id``. The checkpoint's own remote
code is never executed.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("sdar", "qwen3")


class CheckpointError(ValueError):
    """A checkpoint directory, file or tensor does not fit what simsd expects."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    block_size: int = 4
    mask_token_id: int | None = None
    model_type: str = "sdar"

    @classmethod
    def from_dir(cls, path) -> "ModelConfig":
        """Read ``path/config.json``.

        Raises:
            CheckpointError: missing directory or file, unreadable JSON, unknown model_type.
        """
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {path}")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"config.json not found in {path}")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{cfg_file}: invalid JSON ({exc})") from exc
        return cls.from_dict(raw, source=str(cfg_file))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: unknown model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        from transformers import Qwen3Config

        fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "auto_map")}
        # Qwen3Config only reads the fields it knows; the SDAR extras are read from `raw`.
        logging.getLogger("transformers.configuration_utils").setLevel(logging.ERROR)
        hf = Qwen3Config(**fields)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        rope_theta = raw.get("rope_theta")
        if rope_theta is None:
            params = getattr(hf, "rope_parameters", None) or {}
            rope_theta = params.get("rope_theta", getattr(hf, "rope_theta", 1e6))
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            block_size=int(raw.get("block_size", raw.get("block_length", 4)) or 4),
            mask_token_id=raw.get("mask_token_id"),
            model_type=model_type,
        )
