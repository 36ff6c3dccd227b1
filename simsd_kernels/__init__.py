"""simsd_kernels: the attention op family of simsd (mask rule, references, backends: one door class each)."""
from .api import append_kv, prepare_attention, temporal_attention, validate_attention_args
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
from .metadata import AttentionMetadata
from .reference import temporal_attention_naive

__all__ = [
    "prepare_attention", "AttentionMetadata", "temporal_attention", "append_kv", "validate_attention_args",
    "MaskMode", "allowed", "dense_new_token_mask", "parse_mask_mode", "KIND_KNOWN", "KIND_DRAFT", "KIND_MASK",
    "TAU_INF", "SHARED_GRP", "temporal_attention_naive",
]
