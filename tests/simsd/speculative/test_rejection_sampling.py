"""Speculative rejection sampling keeps the target's distribution (docs/design.md §4).

* :func:`token_verdicts` alone: draft and target distributions with overlapping but different
  supports; the committed token follows p_t exactly (chi-square against ``N * p_t``, no
  rescaling) and each draft token is accepted with probability ``min(1, p_t / p_d)``.
* End to end, several draft steps per round (gamma = B, and gamma = 1 where the bonus copy
  samples the target's own next step): the joint distribution of a whole block's tokens equals
  the target's own sequential sampling, computed exactly in float64 by the independent
  reference forward (tests/reference_decoder.py). Paper mode is checked on a one-layer target,
  where its mask is exact (§4.1); exact mode on two layers.

With the ``sequential`` strategy the reveal order does not depend on the sampled tokens, so a
per-token rejection test is the whole verification (for the confidence strategies exact
mode's reveal set is a separate matter, issue 14). These tests check the rule, not a random
stream.
"""
import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from simsd import DecodeConfig, SamplingParams, load_checkpoint
from simsd.speculative import SpecConfig
from simsd.speculative.decoder import speculative_generate_batch
from simsd.speculative.verification import token_verdicts
from tests.helpers import random_checkpoint, rejection_rng
from tests.reference_decoder import ReferenceModel, filtered


def assert_follows_law(counts: dict, want: dict, n: int, min_cells: int) -> None:
    """``counts`` of ``n`` outcomes follow the exact law ``want``: no outcome of probability 0,
    and a chi-square test (p > 1e-4) over the outcomes expected at least 5 times (at least
    ``min_cells`` of them; the rest pooled into one cell)."""
    impossible = [k for k in counts if want.get(k, 0.0) == 0.0]
    assert not impossible, impossible[:3]
    big = [k for k, p in want.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [want[k] * n for k in big]
    if n - sum(exp) > 1e-6:  # the outcomes of small probability, pooled
        obs.append(n - sum(obs))
        exp.append(n - sum(exp))
    assert len(big) >= min_cells
    assert chisquare(obs, exp).pvalue > 1e-4


def test_committed_token_follows_target_with_overlapping_supports():
    """p_t on {0, 1, 2, 3}, p_d on {2, 3, 4, 5}: tokens the target cannot emit are always
    rejected; tokens the draft never proposes come from the residual."""
    p_t = torch.tensor([0.3, 0.25, 0.25, 0.2, 0.0, 0.0])
    p_d = torch.tensor([0.0, 0.0, 0.1, 0.4, 0.3, 0.2])
    N = 40000
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(p_d, N, replacement=True, generator=g)
    logits = p_t.log().expand(N, 6)
    ok, repl = token_verdicts(logits, x, p_d.expand(N, 6), SamplingParams(temperature=1.0), rejection_rng(N, 6, g))
    committed = torch.where(ok, x, repl)
    counts = torch.bincount(committed, minlength=6).double()
    assert counts[4:].sum() == 0
    assert chisquare(counts[:4].numpy(), (p_t[:4].double() * N).numpy()).pvalue > 1e-4
    for t in range(2, 6):  # acceptance of each proposed token: min(1, p_t / p_d), binomial bounds
        rate = min(1.0, float(p_t[t] / p_d[t]))
        n = int((x == t).sum())
        got = float(ok[x == t].double().mean())
        assert abs(got - rate) <= 5 * (rate * (1 - rate) / n) ** 0.5 + 1e-12, (t, got, rate)


def test_verdicts_use_the_filtered_target():
    """The target side is filtered by the sampling parameters too (top-k 2 at temperature 2):
    the committed token follows the filtered target distribution."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=2.0, top_k=2)
    p_t = torch.tensor(filtered(logits, 2.0, top_k=2), dtype=torch.float64)
    p_d = torch.tensor([0.1, 0.2, 0.5, 0.2, 0.0])
    N = 40000
    g = torch.Generator().manual_seed(1)
    x = torch.multinomial(p_d, N, replacement=True, generator=g)
    ok, repl = token_verdicts(logits.expand(N, 5), x, p_d.expand(N, 5), params, rejection_rng(N, 5, g))
    counts = torch.bincount(torch.where(ok, x, repl), minlength=5).double()
    assert counts[2:].sum() == 0
    assert chisquare(counts[:2].numpy(), (p_t[:2] * N).numpy()).pvalue > 1e-4


# -- end to end: the joint distribution of a block ----------------------------------------------

V, MASK = 8, 7
PARAMS = dict(temperature=3.0, top_k=3)  # three tokens per position: draft and target supports differ
PROMPT = [1]  # no prefill: the first block holds the prompt token and three MASKs


def pair(target_layers: int):
    t = random_checkpoint(f"rs-target{target_layers}", tokenizer=False, vocab_size=V,
                          num_hidden_layers=target_layers, std=0.5, seed=2)
    d = random_checkpoint("rs-draft", tokenizer=False, vocab_size=V, num_hidden_layers=1, std=0.5, seed=3)
    return t, d


def target_joint(ref: ReferenceModel) -> dict:
    """``{(x1, x2, x3): p}``: the target's sequential sampling of the block's three positions."""
    out = {}

    def walk(block, prob):
        pos = block.index(MASK) if MASK in block else None
        if pos is None:
            out[tuple(block[1:])] = prob
            return
        p = filtered(ref.block_logits([], block, 4)[pos], **PARAMS)
        for tok, q in enumerate(p):
            if q > 0:
                walk(block[:pos] + [tok] + block[pos + 1:], prob * q)

    walk(PROMPT + [MASK] * 3, 1.0)
    return out


@pytest.mark.parametrize("mode,layers,gamma", [("exact", 2, 4), ("exact", 2, 1), ("paper", 1, 4)],
                         ids=["exact-gamma4", "exact-gamma1-bonus", "paper-1layer-gamma4"])
def test_block_joint_distribution_equals_target(mode, layers, gamma):
    tpath, dpath = pair(layers)
    ref = ReferenceModel(tpath)
    want = target_joint(ref)
    assert abs(sum(want.values()) - 1) < 1e-9
    target = dataclasses.replace(load_checkpoint(tpath, with_tokenizer=False), stop_ids=[])
    draft = dataclasses.replace(load_checkpoint(dpath, with_tokenizer=False), stop_ids=[])
    # the draft's first-position distribution overlaps the target's but differs from it
    d_first = filtered(ReferenceModel(dpath).block_logits([], PROMPT + [MASK] * 3, 4)[1], **PARAMS)
    t_first = filtered(ref.block_logits([], PROMPT + [MASK] * 3, 4)[1], **PARAMS)
    support = lambda p: {t for t, q in enumerate(p) if q > 0}  # noqa: E731
    assert support(d_first) & support(t_first) and support(d_first) != support(t_first)
    N = 700
    cfg = DecodeConfig(block_length=4, strategy="sequential", max_new_tokens=3, seed=11,
                       sampling=SamplingParams(**PARAMS))
    res = speculative_generate_batch(target, draft, [PROMPT] * N, cfg, SpecConfig(mode=mode, gamma=gamma))
    counts: dict = {}
    for r in res.results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert_follows_law(counts, want, N, min_cells=8)


# -- paper rounds end to end: the joint law of (token, accepted) at each position ----------------

# token 0: the draft's favourite, rarely the target's (rejected 9 times in 10); tokens 1 and 2: the
# target's residual mass, one the draft likes (0.4), one it does not (0.05)
CF_MASK = 4
P_T = [0.05, 0.60, 0.25, 0.10]
P_D = [0.50, 0.40, 0.05, 0.05]


def position_law(p_t, p_d) -> dict:
    """``{(token, accepted): probability}`` of one judged proposal: the draft proposes x ~ p_d,
    the target accepts with probability min(1, p_t(x) / p_d(x)), else draws from
    normalize(max(0, p_t - p_d)): P(x, accepted) = min(p_d(x), p_t(x)), P(x, corrected) =
    max(0, p_t(x) - p_d(x))."""
    law = {}
    for x, (t, d) in enumerate(zip(p_t, p_d)):
        law[(x, True)] = min(t, d)
        law[(x, False)] = max(0.0, t - d)
    return law


def test_paper_rounds_accept_and_correct_by_the_rule():
    """Context-free target and draft (tests/helpers.py ``context_free_checkpoint``): at every MASK
    position the target's distribution is P_T and the draft's P_D, whatever the context. A block
    of two MASK positions, gamma 2, ``sequential``: the first position is proposed at draft step 1,
    the second at step 2 (or, after a rejection of the first, in the next round); each is judged
    once, with its own keyed noise, so (token, accepted) of each position follows
    :func:`position_law`, independently. Observed per row: both tokens and the accepted count;
    4000 rows (one seed each) against the exact joint (chi-square, no rescaling).

    This holds the draft to its reveal-step distribution (the first position's distribution
    at the draft's last step differs: its own token is then in the input) and the acceptance
    uniforms and residual draws to streams of their own (sharing the draft's noise correlates
    the verdict with the proposal)."""
    import math

    from tests.helpers import context_free_checkpoint
    target = context_free_checkpoint([math.log(p) for p in P_T] + [0.0], CF_MASK, seed=0)
    draft = context_free_checkpoint([math.log(p) for p in P_D] + [0.0], CF_MASK, seed=1)
    law = position_law(P_T, P_D)
    want: dict = {}
    for (xa, fa), pa in law.items():
        for (xb, fb), pb in law.items():
            key = (xa, xb, int(fa) + int(fb))
            want[key] = want.get(key, 0.0) + pa * pb
    assert abs(sum(want.values()) - 1) < 1e-12
    N = 4000
    # block [1, MASK, MASK]: the prompt is the first block's tail (no prefill forward)
    cfg = DecodeConfig(block_length=3, strategy="sequential", max_new_tokens=2, seed=0,
                       sampling=SamplingParams(temperature=1.0))
    res = speculative_generate_batch(target, draft, [[1]] * N, cfg, SpecConfig(mode="paper", gamma=2))
    counts: dict = {}
    for r in res.results:
        key = (*r.token_ids, r.stats["accepted"])
        counts[key] = counts.get(key, 0) + 1
    assert_follows_law(counts, want, N, min_cells=15)
