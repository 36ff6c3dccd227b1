"""What simsd accepts in a checkpoint's ``config.json``: the Qwen3 schema (SDAR uses Qwen3's
field names, plus ``block_size`` and ``mask_token_id``), field by field.

Every field that changes the forward is either implemented with parity to transformers'
``Qwen3ForCausalLM`` (``tests/simsd/models/test_config_schema.py`` has one parity test per
accepted value) or refused with one line naming the file, the field and the value:

=========================================  ==================================================
field                                      accepted
=========================================  ==================================================
vocab_size, hidden_size, intermediate_size  int >= 1
num_hidden_layers, num_attention_heads,
max_position_embeddings
num_key_value_heads                        int >= 1 dividing num_attention_heads, or null
head_dim                                   even int >= 2, or null (hidden_size / heads)
hidden_act                                 ``silu`` (``swish`` is the same function)
rms_norm_eps                               number > 0
rope_theta                                 number > 0
rope_scaling / rope_parameters             null or rope_type ``default`` (no yarn, linear,
                                           dynamic, longrope, llama3; no partial rotary)
attention_bias                             false (q/k/v/o projections have no bias)
use_sliding_window, sliding_window,        no layer whose window is shorter than
max_window_layers, layer_types             max_position_embeddings (a longer window never
                                           cuts anything)
attention_dropout                          number in [0, 1] (inactive at inference)
tie_word_embeddings                        bool
quantization_config                        absent (quantized weights are not supported)
block_size (SDAR)                          int >= 1
mask_token_id (SDAR)                       int in [0, vocab_size), or null
bos/eos/pad_token_id                       int (eos: or a list of ints), or null
=========================================  ==================================================

Fields outside this schema are not read (as transformers' Qwen3 does not read them either).
"""
from __future__ import annotations

import math

from .errors import CheckpointError

POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings")
ACTIVATIONS = ("silu", "swish")
LAYER_TYPES = ("full_attention", "sliding_attention")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _bad(source: str, field: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"{source}: {field} = {value!r}: {why}")


def _check_rope(raw: dict, source: str) -> None:
    theta = raw.get("rope_theta")
    if theta is not None and not (_is_number(theta) and theta > 0):
        raise _bad(source, "rope_theta", theta, "must be a number > 0")
    for field in ("rope_scaling", "rope_parameters"):
        params = raw.get(field)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise _bad(source, field, params, "must be an object or null")
        # transformers >= 5 may nest one set of parameters per layer type
        nested = params and all(isinstance(v, dict) for v in params.values())
        for key, p in (params.items() if nested else [(None, params)]):
            name = field if key is None else f"{field}.{key}"
            kind = p.get("rope_type", p.get("type", "default"))
            if kind != "default":
                raise _bad(source, name, p, f"RoPE type {kind!r} is not supported (simsd implements the default "
                                            f"RoPE of SDAR/Qwen3 only)")
            prf = p.get("partial_rotary_factor", 1.0)
            if prf != 1.0:
                raise _bad(source, f"{name}.partial_rotary_factor", prf, "partial rotary embeddings are not supported")
            inner = p.get("rope_theta")
            if inner is not None:
                if not (_is_number(inner) and inner > 0):
                    raise _bad(source, f"{name}.rope_theta", inner, "must be a number > 0")
                if theta is not None and float(inner) != float(theta):
                    raise _bad(source, f"{name}.rope_theta", inner, f"contradicts rope_theta = {theta!r}")


def _check_sliding(raw: dict, source: str, layers: int, max_pos: int) -> None:
    use = raw.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise _bad(source, "use_sliding_window", use, "must be true or false")
    window = raw.get("sliding_window")
    if window is not None and not (_is_int(window) and window >= 1):
        raise _bad(source, "sliding_window", window, "must be an int >= 1 or null")
    mwl = raw.get("max_window_layers", 28)
    if not (_is_int(mwl) and mwl >= 0):
        raise _bad(source, "max_window_layers", mwl, "must be an int >= 0")
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
            raise _bad(source, "layer_types", types, f"must be a list of {' / '.join(LAYER_TYPES)}")
        if len(types) != layers:
            raise _bad(source, "layer_types", f"{len(types)} entries", f"num_hidden_layers is {layers}")
    if not use:  # transformers' Qwen3 then ignores the window (sliding_window becomes None)
        return
    if window is None:
        window = 4096  # Qwen3Config's default
    sliding = ([i for i, t in enumerate(types) if t == "sliding_attention"] if types is not None
               else list(range(mwl, layers)))
    if sliding and window < max_pos:
        raise _bad(source, "use_sliding_window", use,
                   f"sliding-window attention (sliding_window {window} on layer(s) {sliding[0]}..{sliding[-1]}) is "
                   f"not supported: simsd attends the whole context")


def check_config(raw, source: str = "config") -> None:
    """Refuse a ``config.json`` dict that simsd cannot run exactly as transformers' Qwen3 would.

    Raises:
        CheckpointError: one line ``SOURCE: FIELD = VALUE: why`` (see the module table).
    """
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    for field in POSITIVE_INTS:
        if field in raw and not (_is_int(raw[field]) and raw[field] >= 1):
            raise _bad(source, field, raw[field], "must be an int >= 1")
    heads = raw.get("num_attention_heads", 32)
    kv = raw.get("num_key_value_heads")
    if kv is not None and not (_is_int(kv) and kv >= 1 and heads % kv == 0):
        raise _bad(source, "num_key_value_heads", kv, f"must be an int >= 1 dividing num_attention_heads ({heads})")
    if "head_dim" in raw:
        hd = raw["head_dim"]
        if hd is None:
            if raw.get("hidden_size", 4096) % heads:
                raise _bad(source, "head_dim", hd, f"hidden_size {raw.get('hidden_size', 4096)} is not a multiple "
                                                   f"of num_attention_heads {heads}")
        elif not (_is_int(hd) and hd >= 2 and hd % 2 == 0):
            raise _bad(source, "head_dim", hd, "must be an even int >= 2 (rotate-half RoPE)")
    act = raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise _bad(source, "hidden_act", act, f"only {' / '.join(ACTIVATIONS)} (SwiGLU) is supported")
    eps = raw.get("rms_norm_eps", 1e-6)
    if not (_is_number(eps) and eps > 0):
        raise _bad(source, "rms_norm_eps", eps, "must be a number > 0")
    _check_rope(raw, source)
    bias = raw.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise _bad(source, "attention_bias", bias, "must be true or false")
    if bias:
        raise _bad(source, "attention_bias", bias, "attention projections with bias are not supported")
    _check_sliding(raw, source, raw.get("num_hidden_layers", 32), raw.get("max_position_embeddings", 32768))
    drop = raw.get("attention_dropout", 0.0)
    if not (_is_number(drop) and 0 <= drop <= 1):
        raise _bad(source, "attention_dropout", drop, "must be a number in [0, 1]")
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise _bad(source, "tie_word_embeddings", tie, "must be true or false")
    if raw.get("quantization_config") is not None:
        method = raw["quantization_config"]
        method = method.get("quant_method", method) if isinstance(method, dict) else method
        raise _bad(source, "quantization_config", method, "quantized checkpoints are not supported")
    block = raw.get("block_size", raw.get("block_length"))
    if block is not None and not (_is_int(block) and block >= 1):
        raise _bad(source, "block_size", block, "must be an int >= 1")
    vocab = raw.get("vocab_size", 151936)
    mask = raw.get("mask_token_id")
    if mask is not None and not (_is_int(mask) and 0 <= mask < vocab):
        raise _bad(source, "mask_token_id", mask, f"must be a token id in [0, {vocab})")
    for field in ("bos_token_id", "pad_token_id", "eos_token_id"):
        v = raw.get(field)
        ok = v is None or _is_int(v) or (field == "eos_token_id" and isinstance(v, list) and all(map(_is_int, v)))
        if not ok:
            ids = " or a list of ids" if field == "eos_token_id" else ""
            raise _bad(source, field, v, "must be a token id" + ids)
