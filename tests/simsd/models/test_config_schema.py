"""The Qwen3/SDAR config schema: every accepted value of a field that changes the forward has
parity with transformers' Qwen3ForCausalLM; every other value is refused in one line naming
the file, the field and the value (simsd.models.validation)."""
import json
import math

import pytest
import torch

from simsd.models.config import CheckpointError, ModelConfig
from simsd.models.model import SDARForCausalLM, labels_for
from simsd.testing import config_dict, random_state_dict

SDAR_ONLY = ("model_type", "architectures", "block_size", "mask_token_id")


def base(**over) -> dict:
    cfg = config_dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, mask_token_id=96)
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not _DROP}


_DROP = object()


def logits_pair(raw: dict):
    """simsd's and transformers' logits for the same config dict and random weights (causal, 13 tokens)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    mc = ModelConfig.from_dict(raw)
    dims = {**raw, "head_dim": mc.head_dim, "num_key_value_heads": mc.num_key_value_heads,
            "hidden_size": mc.hidden_size, "vocab_size": mc.vocab_size, "num_attention_heads": mc.num_attention_heads,
            "intermediate_size": mc.intermediate_size, "num_hidden_layers": mc.num_hidden_layers}
    sd = random_state_dict(dims, seed=5)
    if mc.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    ours = SDARForCausalLM(mc)
    ours.load_state_dict(sd)
    hf_fields = {k: v for k, v in raw.items() if k not in SDAR_ONLY}
    if raw.get("head_dim", 0) is None:  # null is SDAR's "hidden_size / heads"; Qwen3Config wants the number
        hf_fields["head_dim"] = mc.head_dim
    hf = Qwen3ForCausalLM(Qwen3Config(**hf_fields, attn_implementation="eager")).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if mc.tie_word_embeddings:
        hf.tie_weights()
    ids = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(13)[None]
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    got = ours.eval()(ids, pos, labels_for(13, "cpu", grp=pos), "block_causal", ours.new_cache(1, 0))
    return got, ref


SUPPORTED = {
    "rope_theta_absent (transformers' default 10000)": dict(rope_theta=_DROP),
    "rope_theta 5e5": dict(rope_theta=5e5),
    "rope_theta int": dict(rope_theta=20000),
    "rope_scaling null": dict(rope_scaling=None),
    "rope_scaling default": dict(rope_scaling={"rope_type": "default"}),
    "rope_parameters default with theta": dict(rope_theta=_DROP, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 3e4}),
    "head_dim absent (Qwen3's default 128)": dict(head_dim=_DROP),
    "head_dim null (hidden / heads)": dict(head_dim=None),
    "head_dim 64": dict(head_dim=64),
    "hidden_act swish": dict(hidden_act="swish"),
    "num_key_value_heads null": dict(num_key_value_heads=None),
    "num_key_value_heads 1": dict(num_key_value_heads=1),
    "rms_norm_eps 1e-5": dict(rms_norm_eps=1e-5),
    "rms_norm_eps absent": dict(rms_norm_eps=_DROP),
    "attention_dropout 0.1 (inactive in eval)": dict(attention_dropout=0.1),
    "attention_bias false": dict(attention_bias=False),
    "tie_word_embeddings true": dict(tie_word_embeddings=True),
    "tie_word_embeddings absent (false)": dict(tie_word_embeddings=_DROP),
    "use_sliding_window false with a short window": dict(use_sliding_window=False, sliding_window=4),
    "sliding window as long as the positions": dict(use_sliding_window=True, sliding_window=2048,
                                                    max_window_layers=0),
    "sliding window on no layer (max_window_layers)": dict(use_sliding_window=True, sliding_window=4,
                                                           max_window_layers=2),
    "layer_types all full": dict(use_sliding_window=True, sliding_window=4,
                                 layer_types=["full_attention", "full_attention"]),
    "unknown training-only fields": dict(initializer_range=0.5, use_cache=False, fuse_cross_entropy=True),
}


@pytest.mark.parametrize("over", SUPPORTED.values(), ids=SUPPORTED.keys())
def test_supported_values_match_transformers(over):
    got, ref = logits_pair(base(**over))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_the_parity_check_sees_a_wrong_theta():
    """The parity harness can fail: the same weights with another rope_theta give other logits."""
    raw = base(rope_theta=5e5)
    got, _ = logits_pair(raw)
    _, ref = logits_pair({**raw, "rope_theta": 10.0})
    assert (got - ref).abs().max() > 1e-2


REFUSED = [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}},
     "rope_scaling", "'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling", "'linear'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling", "'dynamic'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_parameters", "'llama3'"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "rope_parameters", "'longrope'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope_parameters.full_attention", "'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor", "0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}, "rope_theta": 2.0}, "rope_theta", "contradicts"),
    ({"rope_scaling": "yarn"}, "rope_scaling", "object or null"),
    ({"rope_theta": 0}, "rope_theta", "> 0"),
    ({"rope_theta": "1e6"}, "rope_theta", "'1e6'"),
    ({"attention_bias": True}, "attention_bias", "bias"),
    ({"attention_bias": "no"}, "attention_bias", "true or false"),
    ({"hidden_act": "gelu"}, "hidden_act", "'gelu'"),
    ({"use_sliding_window": True, "sliding_window": 512, "max_window_layers": 1}, "use_sliding_window",
     "layer(s) 1..1"),
    ({"use_sliding_window": True, "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]},
     "use_sliding_window", "layer(s) 0..0"),
    ({"layer_types": ["full_attention"]}, "layer_types", "num_hidden_layers is 2"),
    ({"layer_types": ["full_attention", "chunked"]}, "layer_types", "must be a list"),
    ({"sliding_window": -1}, "sliding_window", "-1"),
    ({"use_sliding_window": 1}, "use_sliding_window", "true or false"),
    ({"attention_dropout": 2}, "attention_dropout", "[0, 1]"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "true or false"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config", "'gptq'"),
    ({"vocab_size": "x"}, "vocab_size", "'x'"),
    ({"vocab_size": 97.0}, "vocab_size", "97.0"),
    ({"hidden_size": 0}, "hidden_size", ">= 1"),
    ({"num_hidden_layers": True}, "num_hidden_layers", "True"),
    ({"intermediate_size": None}, "intermediate_size", "None"),
    ({"max_position_embeddings": -5}, "max_position_embeddings", "-5"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "dividing num_attention_heads (4)"),
    ({"head_dim": 33}, "head_dim", "even"),
    ({"head_dim": None, "hidden_size": 66}, "head_dim", "not a multiple"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps", "> 0"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps", "nan"),
    ({"block_size": 0}, "block_size", ">= 1"),
    ({"mask_token_id": 97}, "mask_token_id", "[0, 97)"),
    ({"mask_token_id": "3"}, "mask_token_id", "'3'"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id", "list of ids"),
    ({"bos_token_id": 1.5}, "bos_token_id", "1.5"),
]


@pytest.mark.parametrize("over,field,needle", REFUSED, ids=[f"{r[1]}-{i}" for i, r in enumerate(REFUSED)])
def test_unsupported_values_are_refused_in_one_line(tmp_path, over, field, needle):
    (tmp_path / "config.json").write_text(json.dumps(base(**over)))
    with pytest.raises(CheckpointError) as exc:
        ModelConfig.from_dir(tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg and str(tmp_path / "config.json") in msg
    assert field in msg and needle in msg, msg


@pytest.mark.parametrize("content,needle", [("{", "invalid JSON"), ("[1, 2]", "expected a JSON object"),
                                            ("\ufeff{\"model_type\": \"sdar\", \"vocab_size\": 97}", None)])
def test_config_file_shapes(tmp_path, content, needle):
    (tmp_path / "config.json").write_text(content, encoding="utf-8")
    if needle is None:  # a byte-order mark is fine
        assert ModelConfig.from_dir(tmp_path).vocab_size == 97
        return
    with pytest.raises(CheckpointError, match=needle) as exc:
        ModelConfig.from_dir(tmp_path)
    assert str(tmp_path / "config.json") in str(exc.value)


def test_yarn_would_change_the_logits():
    """Why the refusal: transformers' Qwen3 with the yarn config differs from the unscaled model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    raw = base()
    fields = {k: v for k, v in raw.items() if k not in SDAR_ONLY}
    sd = random_state_dict(raw, seed=5)
    ids = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(0))
    outs = []
    for extra in ({}, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}}):
        hf = Qwen3ForCausalLM(Qwen3Config(**fields, **extra, attn_implementation="eager")).eval()
        hf.load_state_dict(sd, strict=False)
        with torch.no_grad():
            outs.append(hf(input_ids=ids).logits)
    assert (outs[0] - outs[1]).abs().max() > 1e-2
