"""Model configuration read from an HF-format SDAR (or Qwen3) checkpoint directory.

``config.json`` is checked field by field (:mod:`simsd.models.validation`: what simsd cannot
compute exactly as transformers' Qwen3 would is refused), then parsed by transformers'
``Qwen3Config`` for its defaults (SDAR uses Qwen3's field names); simsd adds the SDAR fields
``block_size`` and ``mask_token_id``. The checkpoint's own remote code is never executed.

The mixture-of-experts models (model_type ``sdar_moe``, architecture ``SDARMoeForCausalLM``, as
lmdeploy's SDAR support names them; ``qwen3_moe``) use the field names of transformers'
``Qwen3MoeConfig``: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``; a dense config has
``num_experts == 0``.

``block_size`` says that a checkpoint is a block-diffusion model and for which block length it
was trained: model_type ``sdar`` without it means SDAR's default, 4; a ``qwen3`` config without
it (a plain autoregressive Qwen3, as far as the file says) has none, and
:func:`simsd.models.loading.check_block_diffusion` refuses it unless the caller gives a block
length explicitly.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .validation import MOE_MODEL_TYPES, check_config

SUPPORTED_MODEL_TYPES = ("sdar", "qwen3") + MOE_MODEL_TYPES
#: the block length of a model_type ``sdar`` checkpoint whose config.json gives none (SDAR's default)
SDAR_BLOCK_SIZE = 4
__all__ = ["CheckpointError", "ModelConfig", "SUPPORTED_MODEL_TYPES", "read_json"]


def read_json(path: Path, what: str = "file"):
    """The JSON content of ``path``; ``CheckpointError`` naming the file when it cannot be read
    or parsed (``what``: how the error names the file's role)."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: the {what} is not UTF-8 text (byte {exc.start})") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON in the {what} ({exc.msg} at line {exc.lineno})") from exc


def _block_size(raw: dict, model_type: str) -> int | None:
    """``block_size`` (or ``block_length``) of a config dict; absent: 4 for model_type sdar and
    sdar_moe, None for qwen3 and qwen3_moe (the module doc)."""
    block = raw.get("block_size", raw.get("block_length"))
    if block is not None:
        return int(block)
    return SDAR_BLOCK_SIZE if model_type.startswith("sdar") else None


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
    #: the block length the checkpoint was trained for; None: a qwen3 config that gives none
    block_size: int | None = SDAR_BLOCK_SIZE
    mask_token_id: int | None = None
    model_type: str = "sdar"
    #: routed experts per MoE layer; 0: a dense model (every layer a SwiGLU MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    #: the intermediate size of one expert (the dense layers use ``intermediate_size``)
    moe_intermediate_size: int = 0
    #: renormalise the top-k router probabilities to sum 1
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    #: layers that keep a dense MLP in a MoE model
    mlp_only_layers: tuple = ()

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` holds a sparse MoE block (transformers' Qwen3-MoE rule: experts
        exist, the layer is not in ``mlp_only_layers`` and ``(layer_idx + 1) % decoder_sparse_step == 0``)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dir(cls, path) -> "ModelConfig":
        """Read ``path/config.json``.

        Raises:
            CheckpointError: missing directory or file, unreadable JSON, unknown model_type, a
                field with a wrong type or range or a value simsd does not implement
                (:func:`simsd.models.validation.check_config`); one line naming the file.
        """
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"{path} is a file, not a checkpoint directory (give the directory that holds "
                                  f"config.json and the weights)")
        if not path.is_dir():
            hub = len(path.parts) == 2 and not path.is_absolute() and not str(path).startswith((".", "~"))
            raise CheckpointError(f"checkpoint directory not found: {path}" + (
                f" (simsd loads local checkpoint directories only, and {path} looks like a Hugging Face Hub id: "
                f"download it first with `huggingface-cli download {path} --local-dir {path.name}` and give that "
                f"directory)" if hub else ""))
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"config.json not found in {path}")
        return cls.from_dict(read_json(cfg_file, "model config"), source=str(cfg_file))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        """Parse a ``config.json`` dict (``source`` names it in errors); see :meth:`from_dir`."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: unknown model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        check_config(raw, source)
        from transformers import Qwen3Config, Qwen3MoeConfig

        moe = model_type in MOE_MODEL_TYPES

        fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "auto_map")}
        if fields.get("head_dim", 0) is None:  # null: hidden_size / heads (checked above)
            fields.pop("head_dim")
            fields["head_dim"] = raw.get("hidden_size", 4096) // raw.get("num_attention_heads", 32)
        if fields.get("rope_scaling", 0) is None:  # null: default RoPE, as absent (transformers 5 warns on the name)
            fields.pop("rope_scaling")
        # Qwen3Config only reads the fields it knows; the SDAR extras are read from `raw`.
        logging.getLogger("transformers.configuration_utils").setLevel(logging.ERROR)
        try:
            hf = (Qwen3MoeConfig if moe else Qwen3Config)(**fields)
        except Exception as exc:  # transformers' own validation (a field check_config does not know)
            raise CheckpointError(f"{source}: not a valid {'Qwen3-MoE' if moe else 'Qwen3'} config "
                                  f"({' '.join(str(exc).split())})") from exc
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        rope_theta = raw.get("rope_theta")
        if rope_theta is None:
            params = getattr(hf, "rope_parameters", None) or {}
            if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
                params = next(iter(params.values()))
            rope_theta = params.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0
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
            block_size=_block_size(raw, model_type),
            mask_token_id=raw.get("mask_token_id"),
            model_type=model_type,
            **(dict(num_experts=int(hf.num_experts), num_experts_per_tok=int(hf.num_experts_per_tok),
                    moe_intermediate_size=int(hf.moe_intermediate_size), norm_topk_prob=bool(hf.norm_topk_prob),
                    decoder_sparse_step=int(hf.decoder_sparse_step),
                    mlp_only_layers=tuple(int(i) for i in hf.mlp_only_layers)) if moe else {}),
        )
