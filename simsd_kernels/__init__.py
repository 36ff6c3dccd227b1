"""simsd_kernels: the attention op family of simsd (mask rule, references, backends)."""
from .api import append_kv, temporal_attention, validate_attention_args
from .mask_rule import (
    KIND_DRAFT,
    KIND_KNOWN,
    KIND_MASK,
    SHARED_GRP,
    TAU_INF,
    MaskMode,
    allowed,
    dense_new_token_mask,
    parse_mask_mode,
)
from .reference import temporal_attention_naive, temporal_attention_torch

__all__ = [
    "temporal_attention", "append_kv", "validate_attention_args", "MaskMode", "allowed",
    "dense_new_token_mask", "parse_mask_mode", "KIND_KNOWN", "KIND_DRAFT", "KIND_MASK", "TAU_INF", "SHARED_GRP",
    "temporal_attention_naive", "temporal_attention_torch",
]
