"""Drop-in adapter: a tiny random Qwen3 gives the same logits (and greedy tokens) through simsd as
through transformers' own SDPA attention, for padded batches, 4-D masks, causal and bidirectional
attention, GQA and the KV cache of ``generate``; what it cannot apply it refuses."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from simsd_kernels import hf_adapter  # noqa: E402
from simsd_kernels.hf_adapter import register, simsd_attention_forward  # noqa: E402
from simsd_kernels.mask_rule import TAU_INF, MaskMode, dense_new_token_mask  # noqa: E402
from tests.kernels.helpers import available_backends  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: the forward's KV-cache keyword: ``cache`` in recent transformers, ``past_key_values`` before (the
#: H200 image's 5.17 takes ``past_key_values`` and would pass ``cache=`` on to the attention unused)
CACHE_KW = "cache" if "cache" in inspect.signature(transformers.Qwen3ForCausalLM.forward).parameters \
    else "past_key_values"
PAD = 0
#: max |logit error| vs float64 of the adapter's run; bf16: relative to SDPA's own bf16 error
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _backends():
    return available_backends(DEVICE)


def _model(seed, kv_heads=2, dtype=torch.float32, **extra):
    cfg = transformers.Qwen3Config(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=64, rope_theta=1e4,
        max_position_embeddings=256, pad_token_id=PAD, **extra)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval().to(DEVICE, dtype)
    register()
    return model


def _padded_batch(seed, side, B=3, L=9):
    """Token ids ``(B, L)`` and the 2-D attention mask: row 0 unpadded, row 1 three pads, row 2 five."""
    ids = torch.randint(1, 96, (B, L), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :5] = 0
    if side == "right":
        mask = mask.flip(1)
    return ids.masked_fill(mask == 0, PAD).to(DEVICE), mask.to(DEVICE)


def _logits(model, impl, *args, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(*args, **kwargs).logits


def _assert_like_sdpa(model, backend, *args, **kwargs):
    """simsd's logits equal SDPA's in float32/float64; in bf16 their error against float64 SDPA is
    within twice SDPA's own bf16 error plus one bf16 step (2**-8) of the logits' scale."""
    ours = _logits(model, "simsd", *args, simsd_backend=backend, **kwargs)
    dtype = next(model.parameters()).dtype
    if dtype in TOL:
        native = _logits(model, "sdpa", *args, **kwargs)
        torch.testing.assert_close(ours, native, atol=TOL[dtype], rtol=TOL[dtype])
        return
    native = _logits(model, "sdpa", *args, **kwargs).double()
    exact = _logits(model.double(), "sdpa", *args, **kwargs)
    model.to(dtype)
    err, native_err = (ours.double() - exact).abs().max().item(), (native - exact).abs().max().item()
    assert err <= 2 * native_err + 2 ** -8 * exact.abs().max().item(), (err, native_err)


def _assert_over_the_cache_like_sdpa(model, backend, prefill: dict, step: dict, sdpa_step=None, simsd_step=None):
    """Forward ``prefill`` (model kwargs) into a DynamicCache, then ``step`` over it (plus each
    implementation's own kwargs): simsd's step logits equal SDPA's (float32)."""
    logits = {}
    for impl in ("sdpa", "simsd"):
        model.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config)
        own = {"simsd_backend": backend} if impl == "simsd" else {}
        with torch.no_grad():
            model(**prefill, **{CACHE_KW: cache}, use_cache=True, **own)
            extra = {**own, **(simsd_step or {})} if impl == "simsd" else (sdpa_step or {})
            logits[impl] = model(**step, **{CACHE_KW: cache}, use_cache=True, **extra).logits
    torch.testing.assert_close(logits["simsd"], logits["sdpa"], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends())
def test_causal_logits_equal_native(backend):
    model = _model(0)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _assert_like_sdpa(model, backend, ids)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("backend", _backends())
def test_padded_batch_logits_equal_sdpa(backend, side, dtype):
    """Every position, padding included: left padding leaves the pad rows seeing nothing (zeros, as
    SDPA), right padding lets them see the tokens before them (computed row by row)."""
    if dtype == torch.float64 and backend != "torch":
        pytest.skip("float64 runs on the torch backend only")
    model = _model(4, dtype=dtype)
    ids, mask = _padded_batch(5, side)
    _assert_like_sdpa(model, backend, ids, attention_mask=mask)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("backend", _backends())
def test_padded_batch_over_the_cache_with_gqa(backend, kv_heads):
    """Left-padded prefill, then two more tokens per row over the DynamicCache: the padded cache
    entries stay invisible (GQA group 4, 2 and 1)."""
    model = _model(6, kv_heads=kv_heads)
    ids, mask = _padded_batch(7, "left")
    more = torch.randint(1, 96, (3, 2), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    full_mask = torch.cat([mask, torch.ones_like(more)], 1)
    positions = (full_mask.cumsum(1) - 1).clamp_min(0)
    _assert_over_the_cache_like_sdpa(model, backend, dict(input_ids=ids, attention_mask=mask,
                                                          position_ids=positions[:, :9]),
                                     dict(input_ids=more, attention_mask=full_mask, position_ids=positions[:, 9:]))


@pytest.mark.parametrize("backend", _backends())
def test_bidirectional_attention_equals_sdpa(backend):
    """``is_causal=False`` with no mask (every key), and a bidirectional config with padding (the
    4-D bidirectional mask transformers builds)."""
    model = _model(9)
    ids = torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(10)).to(DEVICE)
    _assert_like_sdpa(model, backend, ids, is_causal=False)
    model = _model(9, is_causal=False)
    ids, mask = _padded_batch(11, "left")
    _assert_like_sdpa(model, backend, ids, attention_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("backend", _backends())
def test_custom_4d_mask_over_the_cache_equals_sdpa(backend, kind, monkeypatch):
    """A 4-D mask given by the caller reaches the attention function as it is: an arbitrary pattern
    over a 7-token cache (some rows see nothing, some rows fit no one-call form; those are
    computed two at a time here)."""
    monkeypatch.setattr(hf_adapter, "_ROW_GATHER_SLOTS", 2 * 12)
    model = _model(12)
    gen = torch.Generator().manual_seed(13)
    prompt = torch.randint(1, 96, (2, 7), generator=gen).to(DEVICE)
    new = torch.randint(1, 96, (2, 5), generator=gen).to(DEVICE)
    allowed = torch.rand(2, 1, 5, 12, generator=gen) < 0.6
    allowed[0, 0, 1] = False  # a row that sees nothing
    allowed[1, 0, :, 7:] = torch.tril(torch.ones(5, 5, dtype=torch.bool))  # one row of the batch: causal new part
    allowed = allowed.to(DEVICE)
    mask = allowed if kind == "bool" else \
        torch.zeros(allowed.shape, device=DEVICE).masked_fill(~allowed, float("-inf"))
    positions = torch.arange(7, 12, device=DEVICE)[None].expand(2, 5)
    _assert_over_the_cache_like_sdpa(model, backend, dict(input_ids=prompt),
                                     dict(input_ids=new, attention_mask=mask, position_ids=positions))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_on_a_left_padded_batch_equals_sdpa(cache):
    """Greedy ``generate`` with its KV cache: the same tokens as SDPA (GQA model; a static cache
    puts the new tokens inside the key buffer, which the row-by-row path computes)."""
    model = _model(14, dtype=torch.float64)
    ids, mask = _padded_batch(15, "left")
    out = {}
    for impl in ("sdpa", "simsd"):
        model.set_attn_implementation(impl)
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        out[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD,
                                   **extra)
    assert out["simsd"].shape == (3, 19)
    assert torch.equal(out["simsd"], out["sdpa"])


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
    _assert_over_the_cache_like_sdpa(model, backend, dict(input_ids=prompt),
                                     dict(input_ids=new, position_ids=positions),
                                     sdpa_step=dict(attention_mask=float_mask),
                                     simsd_step=dict(simsd_labels=labels, simsd_mask_mode="paper"))


@pytest.mark.parametrize("backend", _backends())
def test_labels_over_a_left_padded_cache(backend):
    """With simsd labels the mask still removes padded cache entries: a left-padded prompt, then a
    bidirectional block by labels equals SDPA given the same visibility as a 4-D mask."""
    model = _model(16)
    ids, mask = _padded_batch(17, "left")
    new = torch.randint(1, 96, (3, 4), generator=torch.Generator().manual_seed(18)).to(DEVICE)
    positions = mask.sum(1, keepdim=True) + torch.arange(4, device=DEVICE)
    allowed = torch.cat([mask.bool()[:, None, None, :].expand(3, 1, 4, 9),
                         torch.ones(3, 1, 4, 4, dtype=torch.bool, device=DEVICE)], -1)
    labels = torch.zeros(3, 4, 3, dtype=torch.int32, device=DEVICE)
    _assert_over_the_cache_like_sdpa(model, backend, dict(input_ids=ids, attention_mask=mask,
                                                          position_ids=(mask.cumsum(1) - 1).clamp_min(0)),
                                     dict(input_ids=new, attention_mask=allowed, position_ids=positions),
                                     simsd_step=dict(simsd_labels=labels, simsd_mask_mode="bidirectional"))


class _Module:
    is_causal = True


def _qkv(B=2, Lq=3, Lk=5):
    gen = torch.Generator().manual_seed(19)
    return (torch.randn(B, 4, Lq, 64, generator=gen), torch.randn(B, 2, Lk, 64, generator=gen),
            torch.randn(B, 2, Lk, 64, generator=gen))


@pytest.mark.parametrize("mask,kwargs,needle", [
    (torch.full((2, 1, 3, 5), 0.5), {}, "additive bias"),
    (torch.ones(2, 4, 3, 5, dtype=torch.bool).index_fill(1, torch.tensor([2]), False), {}, "differs between heads"),
    (torch.ones(2, 1, 3, 4, dtype=torch.bool), {}, "does not fit"),
    (torch.ones(2, 5, dtype=torch.bool), {}, "4-D"),
    (torch.ones(2, 1, 3, 5, dtype=torch.int64), {}, "bool or floating point"),
    (None, {"sliding_window": 4}, "sliding-window"),
    (None, {"softcap": 30.0}, "softcap"),
    (None, {"dropout": 0.1}, "dropout"),
    (torch.ones(2, 1, 3, 5, dtype=torch.bool).index_fill(3, torch.tensor([3]), False),
     {"simsd_labels": torch.zeros(2, 3, 3, dtype=torch.int32), "simsd_mask_mode": "bidirectional"},
     "padding among the new tokens"),
])
def test_refuses_what_it_cannot_apply(mask, kwargs, needle):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=needle):
        simsd_attention_forward(_Module(), q, k, v, mask, scaling=0.125, simsd_backend="torch", **kwargs)
