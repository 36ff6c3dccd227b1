"""Sampling parameters at their edges: every accepted value gives finite distributions, the
greedy equivalences hold (top-k 1 at any temperature, temperatures too small to divide by, the
limit of a tiny temperature or top-p), in every mode and in the draft's sampling too."""
import dataclasses
import itertools

import pytest
import torch

import simsd.decoding.sampling as sampling_mod
import simsd.speculative.verification as verification_mod
from simsd import DecodeConfig, SamplingParams, load_checkpoint, vanilla_generate
from simsd.decoding.sampling import MIN_TEMPERATURE, filtered_probs, sample, scaled_probs
from simsd.speculative import SpecConfig, speculative_generate
from tests.helpers import exp_noise, random_checkpoint

TEMPERATURES = [0.0, 1e-46, 1e-39, 1e-37, 1e-30, 1e-6, 0.5, 1.0, 100.0, 1e30, 1e300]
TOP_K = [0, 1, 2, 50, 10 ** 9]
TOP_P = [1e-300, 1e-9, 0.5, 1.0]
SWEEP = list(itertools.product(TEMPERATURES, TOP_K, TOP_P))


def logits_batch(V=50):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, V, generator=g) * torch.tensor([1.0, 10.0, 100.0, 1e4, 0.01, 1.0])[:, None]
    x[5, :3] = x[5].max() + 1.0  # a three-way tie at the top
    x[:, V - 1] = float("-inf")  # the mask token
    return x


@pytest.mark.parametrize("t,k,p", SWEEP)
def test_distributions_are_finite(t, k, p):
    params = SamplingParams(t, k, p)
    x = logits_batch()
    for probs in (scaled_probs(x, params), filtered_probs(x, params)):
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(6), rtol=0, atol=1e-5)
        assert (probs[:, -1] == 0).all()  # the -inf token keeps probability 0
    tokens, conf, ent, probs = sample(x, params, exp_noise(x.shape, torch.Generator().manual_seed(1)))
    assert ((0 <= tokens) & (tokens < 49)).all()
    assert torch.isfinite(conf).all() and torch.isfinite(ent).all() and (conf > 0).all()
    if k and k < 49:  # never outside the top k
        top = torch.topk(x, k, dim=-1).values[:, -1]
        assert (x.gather(-1, tokens[:, None])[:, 0] >= top).all()


@pytest.mark.parametrize("t", TEMPERATURES)
def test_top_k_one_is_greedy_at_any_temperature(t):
    x = logits_batch()
    greedy = sample(x, SamplingParams())
    got = sample(x, SamplingParams(t, 1, 0.5), exp_noise(x.shape, torch.Generator().manual_seed(2)))
    assert torch.equal(got[0], greedy[0]) and torch.equal(got[1], greedy[1]) and torch.equal(got[2], greedy[2])


def test_tiny_temperatures():
    x = logits_batch()
    assert SamplingParams(1e-39).greedy and SamplingParams(1e-46).greedy and not SamplingParams(1e-37).greedy
    assert MIN_TEMPERATURE == torch.finfo(torch.float32).tiny
    # just above the floor: the limit distribution, uniform over the top ties
    probs = filtered_probs(x, SamplingParams(1e-37))
    want = torch.zeros_like(probs).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    want[5] = 0
    want[5, :3] = 1 / 3
    torch.testing.assert_close(probs, want)


def test_huge_temperature_is_uniform():
    x = logits_batch()
    for t in (1e30, 1e300):
        probs = filtered_probs(x, SamplingParams(t))
        torch.testing.assert_close(probs[:, :-1], torch.full((6, 49), 1 / 49))


def test_tiny_top_p_keeps_the_top_token():
    x = logits_batch()[:5]  # no ties
    for p in (1e-300, 1e-9):
        probs = filtered_probs(x, SamplingParams(1.0, 0, p))
        assert torch.equal(probs.argmax(-1), x.argmax(-1)) and (probs.max(-1).values == 1).all()


@pytest.mark.parametrize("bad,needle", [
    (dict(temperature=-1e-9), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_p=float("nan")), "top_p"),
])
def test_out_of_range_values_are_refused(bad, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**bad)


# -- every mode, the draft's sampling included -------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    t = load_checkpoint(random_checkpoint("edges-t", tokenizer=False, vocab_size=64, seed=5, std=0.4),
                        dtype="float32", with_tokenizer=False)
    d = load_checkpoint(random_checkpoint("edges-d", tokenizer=False, vocab_size=64, seed=6, num_hidden_layers=1,
                                          std=0.4), dtype="float32", with_tokenizer=False)
    return t, d


def decode(mode, pair, params, strategy="sequential"):
    t, d = pair
    cfg = DecodeConfig(block_length=4, strategy=strategy, sampling=params, max_new_tokens=12, seed=3)
    if mode == "vanilla":
        return vanilla_generate(t.model, [5, 6, 7, 8, 9], cfg, t.mask_token_id, []).token_ids
    t, d = (dataclasses.replace(c, stop_ids=[]) for c in (t, d))  # every row runs to max_new_tokens
    return speculative_generate(t, d, [5, 6, 7, 8, 9], cfg, SpecConfig(mode=mode)).token_ids


@pytest.fixture()
def finite_everywhere(monkeypatch):
    """Every distribution computed during a decode (target, draft, verification) is checked."""
    seen = []

    def checked(fn):
        def wrapper(logits, params):
            out = fn(logits, params)
            assert torch.isfinite(out).all(), (fn.__name__, params)
            seen.append(fn.__name__)
            return out
        return wrapper

    monkeypatch.setattr(sampling_mod, "filtered_probs", checked(sampling_mod.filtered_probs))
    monkeypatch.setattr(sampling_mod, "scaled_probs", checked(sampling_mod.scaled_probs))
    monkeypatch.setattr(verification_mod, "filtered_probs", checked(verification_mod.filtered_probs))
    return seen


EDGE_SETTINGS = [(t, k, p) for t in (1e-37, 1.0, 1e30) for k in (0, 2, 10 ** 9) for p in (1e-300, 0.5, 1.0)]


@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_every_mode_samples_finite_distributions(mode, pair, finite_everywhere):
    """Sequential steps draw from the filtered distributions; static steps read the confidences
    (the temperature-scaled distributions) as well."""
    for strategy in ("sequential", "static"):
        for t, k, p in EDGE_SETTINGS:
            ids = decode(mode, pair, SamplingParams(t, k, p), strategy)
            assert len(ids) == 12 and all(0 <= i < 64 and i != pair[0].mask_token_id for i in ids)
    assert "scaled_probs" in finite_everywhere and "filtered_probs" in finite_everywhere


@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_greedy_equivalences_in_every_mode(mode, pair):
    """top-k 1 at any temperature and temperatures under the floor are greedy, with any
    strategy; the limits of a tiny temperature or a tiny top-p give the greedy tokens under the
    sequential strategy (where confidences do not choose the positions)."""
    greedy = {s: decode(mode, pair, SamplingParams(), s) for s in ("sequential", "static")}
    for s in ("sequential", "static"):
        for params in (SamplingParams(0.7, 1), SamplingParams(1e30, 1, 0.3), SamplingParams(1e-39)):
            assert decode(mode, pair, params, s) == greedy[s], (s, params)
    for params in (SamplingParams(1e-37), SamplingParams(1e-30), SamplingParams(1.0, 0, 1e-9),
                   SamplingParams(5.0, 0, 1e-300)):
        assert decode(mode, pair, params) == greedy["sequential"], params
