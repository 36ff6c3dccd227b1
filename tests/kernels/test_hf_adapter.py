"""Drop-in adapter: a tiny random Qwen3 gives the same logits through simsd as natively (sdpa)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from simsd_kernels.hf_adapter import register  # noqa: E402
from simsd_kernels.mask_rule import TAU_INF, MaskMode, dense_new_token_mask  # noqa: E402
from tests.kernels.helpers import available_backends  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _backends():
    return available_backends(DEVICE)


def _model(seed):
    cfg = transformers.Qwen3Config(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1e4,
        max_position_embeddings=256)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval().to(DEVICE)
    register()
    return model


@pytest.mark.parametrize("backend", _backends())
def test_causal_logits_equal_native(backend):
    model = _model(0)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        native = model(ids).logits
        model.set_attn_implementation("simsd")
        ours = model(ids, simsd_backend=backend).logits
    torch.testing.assert_close(ours, native, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends())
def test_paper_layout_over_cache_equals_native_with_dense_mask(backend):
    """Prefill 7 tokens, then a paper-layout verify forward ``[known | D1 D2 | M1 M2]`` with the
    RoPE copy (M_k at D_k's position): native sdpa gets the dense 4D mask from ``mask_rule``,
    the adapter gets only the labels."""
    model = _model(2)
    gen = torch.Generator().manual_seed(3)
    B, P = 2, 7
    prompt = torch.randint(0, 96, (B, P), generator=gen).to(DEVICE)
    new = torch.randint(0, 96, (B, 5), generator=gen).to(DEVICE)
    positions = torch.tensor([[7, 8, 9, 8, 9]] * B, device=DEVICE)
    labels = torch.tensor([[0, 0, 0], [1, 1, 0], [1, TAU_INF, 0], [2, 1, 0], [2, TAU_INF, 0]],
                          dtype=torch.int32)[None].repeat(B, 1, 1)
    labels[1, 2, 1] = 2  # row 1: both draft tokens revealed, at different steps
    labels[1, 4, 1] = 2
    labels = labels.to(DEVICE)
    allowed = torch.cat([torch.ones(B, 5, P, dtype=torch.bool, device=DEVICE),
                         dense_new_token_mask(labels, MaskMode.PAPER)], dim=-1)
    float_mask = torch.zeros(allowed.shape, device=DEVICE).masked_fill(~allowed, float("-inf"))[:, None]

    logits = {}
    with torch.no_grad():
        for impl in ("sdpa", "simsd"):
            model.set_attn_implementation(impl)
            cache = transformers.DynamicCache(config=model.config)
            model(prompt, cache=cache, use_cache=True)
            extra = dict(simsd_labels=labels, simsd_mask_mode="paper", simsd_backend=backend) if impl == "simsd" \
                else dict(attention_mask=float_mask)
            logits[impl] = model(new, position_ids=positions, cache=cache, use_cache=True, **extra).logits
    torch.testing.assert_close(logits["simsd"], logits["sdpa"], atol=2e-5, rtol=1e-5)
