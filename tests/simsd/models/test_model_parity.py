"""simsd's SDAR model against an independent implementation: transformers' Qwen3ForCausalLM."""
import pytest
import torch

from simsd.models.config import ModelConfig
from simsd.models.model import SDARForCausalLM, labels_for
from simsd.testing import config_dict, random_state_dict


def _pair(tie=False, num_kv_heads=2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = config_dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=64,
                      tie_word_embeddings=tie, mask_token_id=96)
    sd = random_state_dict(cfg, seed=3)
    ours = SDARForCausalLM(ModelConfig.from_dict(cfg))
    ours.load_state_dict(sd if not tie else {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]})
    ours_only = ("model_type", "architectures", "block_size", "mask_token_id")
    hf_fields = {k: v for k, v in cfg.items() if k not in ours_only}
    hf = Qwen3ForCausalLM(Qwen3Config(**hf_fields, attn_implementation="eager")).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if tie:
        hf.tie_weights()
    return ours.eval(), hf


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_logits_match_transformers_causal(tie, num_kv_heads):
    torch.manual_seed(0)
    ours, hf = _pair(tie, num_kv_heads)
    L = 13
    ids = torch.randint(0, 97, (1, L))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    pos = torch.arange(L)[None]
    # block-causal with one token per group == causal attention
    got = ours(ids, pos, labels_for(L, "cpu", grp=pos), "block_causal", ours.new_cache(1, 0))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_logits_match_transformers_with_cache_prefix():
    torch.manual_seed(1)
    ours, hf = _pair()
    L, P = 19, 8
    ids = torch.randint(0, 97, (1, L))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    cache = ours.new_cache(1, 32)
    pos = torch.arange(L)[None]
    ours(ids[:, :P], pos[:, :P], labels_for(P, "cpu", grp=pos[:, :P]), "block_causal", cache, num_write=P,
         logits_slice=None)
    assert int(cache.seqlens[0]) == P
    got = ours(ids[:, P:], pos[:, P:], labels_for(L - P, "cpu", grp=pos[:, P:]), "block_causal", cache)
    torch.testing.assert_close(got, ref[:, P:], rtol=1e-4, atol=1e-4)
    assert int(cache.seqlens[0]) == P  # read-only forward
