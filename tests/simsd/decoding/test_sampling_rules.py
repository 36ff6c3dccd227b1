"""The sampling and confidence rules under sampling, with values computed by hand.

docs/design.md §3.6: tokens are drawn from the temperature-scaled distribution filtered by
top-k then top-p (the token that crosses p is kept); a position's confidence is the drawn
token's probability under the temperature-scaled distribution *before* filtering (temperature 1
when greedy); entropy is that distribution's entropy. A denoising step's outcome (which
positions are revealed, with which tokens) is checked against its exact distribution,
enumerated by the independent reference (tests/reference_decoder.py), with a chi-square test.

These tests check rules, not a random stream: any correct source of noise passes them.
"""
import math

import pytest
import torch
from scipy.stats import chisquare

from simsd.decoding.config import DecodeConfig
from simsd.decoding.noise import NoiseKey, step_noise
from simsd.decoding.sampling import StepSampling, filtered_probs, sample
from simsd.decoding.step import denoise_step
from tests.helpers import exp_noise
from tests.reference_decoder import filtered, step_outcomes

P4 = [0.5, 0.25, 0.15, 0.1]
LOGITS4 = torch.tensor([[math.log(p) for p in P4]])


def powered(p, t):
    """The distribution ``p`` at temperature ``t``: proportional to ``p ** (1 / t)``."""
    w = [x ** (1 / t) for x in p]
    return [x / sum(w) for x in w]


def close(got, want, tol=1e-6):
    assert len(got) == len(want)
    assert all(abs(float(a) - b) < tol for a, b in zip(got, want)), (list(map(float, got)), want)


def test_filtered_distribution_by_hand():
    f = lambda **kw: filtered_probs(LOGITS4, StepSampling(**kw))[0].tolist()  # noqa: E731
    close(f(temperature=1.0), P4)
    close(f(temperature=1.0, top_k=2), [2 / 3, 1 / 3, 0, 0])
    close(f(temperature=1.0, top_k=3), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    close(f(temperature=1.0, top_p=0.7), [2 / 3, 1 / 3, 0, 0])        # 0.5 + 0.25 crosses 0.7: kept
    close(f(temperature=1.0, top_p=0.5), [1, 0, 0, 0])                # 0.5 reaches 0.5 exactly
    close(f(temperature=1.0, top_p=0.76), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    # top-p on the top-k distribution: [5/9, 5/18, 1/6] reaches 0.8 at the second token
    close(f(temperature=1.0, top_k=3, top_p=0.8), [2 / 3, 1 / 3, 0, 0])
    q = powered(P4, 2.0)  # ~ [0.3704, 0.2619, 0.2028, 0.1656]
    close(f(temperature=2.0), q)
    close(f(temperature=2.0, top_k=2), [q[0] / (q[0] + q[1]), q[1] / (q[0] + q[1]), 0, 0])
    close(f(temperature=2.0, top_p=0.6), [q[0] / (q[0] + q[1]), q[1] / (q[0] + q[1]), 0, 0])
    close(f(temperature=0.5), powered(P4, 0.5))
    close(f(temperature=0.0, top_p=0.3), [1, 0, 0, 0])  # greedy: a one-hot at the argmax
    close(f(temperature=1.5, top_k=1), [1, 0, 0, 0])


@pytest.mark.parametrize("params", [dict(temperature=2.0), dict(temperature=2.0, top_k=2),
                                    dict(temperature=0.5, top_p=0.8), dict(temperature=1.0, top_k=3, top_p=0.8)],
                         ids=str)
def test_confidence_and_entropy_by_hand(params):
    """Whatever token is drawn, its confidence is its probability at the temperature before
    top-k/top-p, and the entropy is that distribution's."""
    sp = StepSampling(**params)
    q = powered(P4, sp.temperature)
    n = 4000
    tokens, conf, ent, probs = sample(LOGITS4.expand(n, 4), sp, exp_noise((n, 4), torch.Generator().manual_seed(0)))
    drawn = set(tokens.tolist())
    assert len(drawn) >= 2  # several tokens drawn: the confidence of each is checked
    for t in drawn:
        close(conf[tokens == t].unique().tolist(), [q[t]])
    close(ent.unique().tolist(), [-sum(x * math.log(x) for x in q)], tol=1e-5)
    torch.testing.assert_close(probs[0], filtered_probs(LOGITS4, sp)[0])


def test_greedy_confidence_uses_temperature_one():
    tokens, conf, ent, _ = sample(LOGITS4, StepSampling(temperature=0.0))
    assert tokens.tolist() == [0]
    close(conf.tolist(), [0.5])
    close(ent.tolist(), [-sum(x * math.log(x) for x in P4)], tol=1e-5)
    # top-k 1 is greedy at any temperature (issue 15): the whole step, confidences included, is
    # the greedy one, so the confidence is taken at temperature 1
    tokens, conf, _, _ = sample(LOGITS4 * 3, StepSampling(temperature=0.7, top_k=1))
    assert tokens.tolist() == [0]
    close(conf.tolist(), [powered(P4, 1 / 3)[0]])


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.6, top_k=3),
                                    dict(temperature=1.7, top_p=0.8), dict(temperature=1.3, top_k=4, top_p=0.75)],
                         ids=str)
def test_draws_follow_the_filtered_distribution(params):
    """Chi-square of 40000 draws against the exact filtered distribution (expected counts are
    exactly ``N * p``; a token of probability 0 is never drawn)."""
    logits = torch.tensor([[1.2, 0.9, 0.4, 0.0, -0.3, -1.0, -2.5]])
    sp = StepSampling(**params)
    want = torch.tensor(filtered(logits[0], **params), dtype=torch.float64)
    N = 40000
    tokens, _, _, _ = sample(logits.expand(N, 7), sp, exp_noise((N, 7), torch.Generator().manual_seed(1)))
    counts = torch.bincount(tokens, minlength=7).double()
    assert counts[want == 0].sum() == 0
    keep = want > 0
    assert chisquare(counts[keep].numpy(), (want[keep] * N).numpy()).pvalue > 1e-4


# -- one denoising step under sampling: the exact outcome distribution ---------------------------

MASK = 7


def step_logits(seed: int) -> torch.Tensor:
    """Logits ``(4, 8)`` of a block with different spreads per position (so that normalisers,
    temperatures and entropies change the choice between positions); MASK logit removed."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5, 0.9, 1.4, 0.3], dtype=torch.float64)[:, None]
    out = torch.randn(4, 8, generator=g, dtype=torch.float64) * scale
    out[:, MASK] = -math.inf
    return out


def sampled_outcomes(logits, block, cfg, step, n, seed):
    """``n`` independent samples of one denoising step of ``block`` as outcome keys
    ``((pos, token), ...)`` (the only place these tests touch simsd's noise): sample ``i`` draws
    the keyed noise of row seed ``seed + i``, as row ``i`` of a prompt set would."""
    keys = [NoiseKey(seed + i, start=0) for i in range(n)]
    noise = step_noise(keys, step, block.shape[-1], logits.shape[-1], logits.device)
    new, revealed, _ = denoise_step(logits.float().repeat(n, 1, 1), block.expand(n, -1), MASK, cfg, step, noise)
    outs = []
    for row_new, row_rev in zip(new.tolist(), revealed.tolist()):
        outs.append(tuple((i, row_new[i]) for i in range(len(row_new)) if row_rev[i]))
    return outs


def chi_square_outcomes(observed: list, expected: dict) -> float:
    """p-value of the observed outcome counts against exact probabilities (cells with an
    expected count under 5 pooled); an outcome of probability 0 fails at once."""
    n = len(observed)
    counts: dict = {}
    for o in observed:
        counts[o] = counts.get(o, 0) + 1
    impossible = [o for o in counts if expected.get(o, 0.0) == 0.0]
    assert not impossible, f"outcomes of probability 0: {impossible[:3]}"
    big = [o for o, p in expected.items() if p * n >= 5]
    obs = [counts.get(o, 0) for o in big]
    exp = [expected[o] * n for o in big]
    rest_o, rest_e = n - sum(obs), n - sum(exp)
    if rest_e > 1e-9:
        obs.append(rest_o)
        exp.append(rest_e)
    assert len(obs) >= 3
    return chisquare(obs, exp).pvalue


CASES = [
    ("static", 1, None, dict(temperature=1.0)),
    ("static", 2, None, dict(temperature=2.0, top_k=3)),
    ("static", 1, None, dict(temperature=0.5, top_p=0.8)),
    ("dynamic", 1, 0.5, dict(temperature=1.0, top_k=3)),
    ("dynamic", 2, 0.3, dict(temperature=1.5, top_p=0.9)),
    ("entropy", 1, 2.0, dict(temperature=1.5, top_k=4)),
    ("entropy", 1, 1.0, dict(temperature=0.7)),
    ("sequential", 2, None, dict(temperature=1.2, top_k=3)),
]


@pytest.mark.parametrize("strategy,k,threshold,params", CASES, ids=lambda x: str(x))
def test_step_outcomes_follow_the_exact_distribution(strategy, k, threshold, params):
    """One sampled step of a block with a known token and three MASKs (step index 0 of a
    schedule whose first entry is ``k``): the revealed positions and their tokens follow the
    distribution that the rules give, enumerated exactly."""
    logits = step_logits(seed=len(strategy) + k)
    block = torch.tensor([3, MASK, MASK, MASK])
    masked = [False, True, True, True]
    cfg = DecodeConfig(block_length=4, steps=4 // k, strategy=strategy, threshold=threshold,
                       sampling=StepSampling(**params))
    assert cfg.tokens_for_step(0) == k
    expected = step_outcomes(logits, masked, strategy, k, threshold, **params)
    assert abs(sum(expected.values()) - 1) < 1e-9
    assert sum(1 for p in expected.values() if p > 0.015) >= 3  # a distribution with room to be wrong
    observed = sampled_outcomes(logits, block, cfg, 0, 30000, seed=5)
    assert chi_square_outcomes(observed, expected) > 1e-4
