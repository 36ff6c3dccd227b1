"""The keyed sampling noise (simsd.decoding.noise, docs/design.md §4.2): the words and uniforms equal
a pure-Python SplitMix64, every grid value of the uniform lies strictly inside (0, 1), the
uniforms are unbiased and independent across keys, a token of tiny probability is (almost)
never drawn, and vanilla sampling with them follows the target's exact step distribution
computed in float64 (chi-square)."""
import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from simsd import DecodeConfig, SamplingParams, load_checkpoint
from simsd.decoding import noise
from simsd.decoding.noise import ACCEPT, PAPER_DRAFT, SAMPLE, NoiseKey, mix64, step_noise
from simsd.decoding.sampling import draw, filtered_probs
from simsd.decoding.step import Step, without_mask_token_
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.models.model import labels_for
from tests.helpers import random_checkpoint

MASK64 = (1 << 64) - 1


def python_word(key: NoiseKey, step: int, position: int, token: int) -> int:
    g = noise.GOLDEN
    s = mix64(mix64(mix64(key.seed) + key.stream * g) + key.round * g)
    s = mix64(mix64(s + position * g) + step * g)
    w = mix64(s + (token + 1) * g)
    return w - (1 << 64) if w >> 63 else w


def python_uniform(word: int) -> float:
    """The uniform of a 64-bit word, in float64: its top 23 bits ``k`` give ``(k + 0.5) / 2**23``."""
    return (((word & MASK64) >> 41) + 0.5) / 2 ** 23


def test_words_match_python_reference():
    keys = [NoiseKey(0, 0), NoiseKey(7, 4096, ACCEPT, 3), NoiseKey((1 << 63) + 5, 12, PAPER_DRAFT, 1 << 40),
            NoiseKey(-3, 2040)]
    steps = [0, 5, 1, 7]
    w = noise.words(keys, steps, 5, 40, "cpu")
    u = noise.uniform(keys, steps, 5, 40, "cpu")
    assert u.dtype == torch.float32
    for r, key in enumerate(keys):
        for p in range(5):
            for t in (0, 1, 17, 39):
                word = python_word(key, steps[r], key.start + p, t)
                assert int(w[r, p, t]) == word, (r, p, t)
                assert float(u[r, p, t]) == python_uniform(word), (r, p, t)


def as_int64(word: int) -> int:
    return word - (1 << 64) if word >> 63 else word


#: (word, its uniform): the extreme words, the two around the middle, low bits that must not count
EXTREME_WORDS = [
    (0, 2 ** -24),                              # the smallest uniform: half a grid step above 0
    ((1 << 41) - 1, 2 ** -24),                  # the low 41 bits are not used
    (1 << 41, 3 * 2 ** -24),                    # the next grid point
    ((1 << 63) - 1, 0.5 - 2 ** -24),            # the largest int64: just below 1/2
    (1 << 63, 0.5 + 2 ** -24),                  # the sign bit alone: just above 1/2
    (MASK64 - (1 << 41), 1 - 3 * 2 ** -24),
    (MASK64, 1 - 2 ** -24),                     # the all-ones word: half a grid step below 1
]


@pytest.mark.parametrize("word, expected", EXTREME_WORDS)
def test_extreme_words_map_inside_the_unit_interval(word, expected):
    """The words at the ends of the range map to the ends of the grid ``(2k + 1) * 2**-24``, and
    ``-log(u)`` of the all-ones word is a positive Exp(1) draw (a uniform of exactly 1.0 would give
    the draw 0, which wins the exponential race for any token of nonzero probability)."""
    assert python_uniform(word) == expected
    u = noise.word_uniform(torch.tensor([as_int64(word)], dtype=torch.int64))
    assert u.dtype == torch.float32 and float(u[0]) == expected
    assert 0 < float(u[0]) < 1 and float(-u.log()[0]) > 0


def test_every_grid_value_lies_strictly_inside_the_unit_interval():
    """All 2**23 values of the uniform (one word per value of the top 23 bits, with arbitrary low
    bits): each equals ``(2k + 1) * 2**-24`` exactly in float32 (no rounding), so they are distinct,
    increasing in ``k``, and strictly inside (0, 1)."""
    k = torch.arange(1 << 23, dtype=torch.int64)
    low = torch.randint(0, 1 << 41, k.shape, generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    w = (k * (1 << 41)).bitwise_or_(low)  # wraps into the sign bit from k = 2**22 on, as int64 words do
    u = noise.word_uniform(w)
    assert u.dtype == torch.float32
    assert torch.equal(u.double(), (2 * k + 1).double() * 2.0 ** -24)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert bool((u[1:] > u[:-1]).all())


def test_a_token_of_tiny_probability_is_almost_never_drawn():
    """SDAR's vocabulary (151,936 tokens): every token but one has probability 1e-9, so over 1024
    keyed draws they are drawn ~0.15 times in all (at most 3 with probability 1 - 3e-5). A uniform
    that can be 1.0 (the top word of a 24-bit float32 grid) makes a token of any probability win the
    race at ~V / 2**24 = 0.9% of the draws, ~9 here."""
    V, L, R = 151936, 64, 4
    probs = torch.full((V,), 1e-9, dtype=torch.float32)
    probs[1234] = 1 - 1e-9 * (V - 1)
    others = 0
    for chunk in range(1024 // (L * R)):
        keys = [NoiseKey(seed, 4096 * chunk) for seed in range(R)]
        tokens = draw(probs, noise=noise.step_noise(keys, chunk, L, V, "cpu"))  # (R, L)
        others += int((tokens != 1234).sum())
    assert others <= 3, f"{others} of 1024 draws picked a token of probability 1e-9"


def test_noise_of_a_key_does_not_depend_on_the_batch():
    keys = [NoiseKey(s, 8 * s) for s in range(5)]
    together = noise.step_noise(keys, [0, 1, 2, 3, 4], 4, 33, "cpu")
    as_tensor = noise.step_noise(keys, torch.arange(5), 4, 33, "cpu")
    assert torch.equal(together, as_tensor)
    for r, key in enumerate(keys):
        assert torch.equal(noise.step_noise([key], r, 4, 33, "cpu")[0], together[r])


def test_uniforms_unbiased_and_independent():
    keys = [NoiseKey(seed, 100 * seed, stream) for seed in range(16) for stream in (SAMPLE, ACCEPT)]
    u = torch.stack([noise.uniform(keys, step, 8, 512, "cpu") for step in range(4)])  # (4, 32, 8, 512)
    assert float(u.min()) > 0 and float(u.max()) < 1
    n = u.numel()
    counts = torch.histc(u.double(), bins=64, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > 1e-3
    e = -u.double().log()
    assert abs(float(e.mean()) - 1) < 4 / n ** 0.5 and abs(float(e.var()) - 1) < 10 / n ** 0.5
    # neighbours along every key field are uncorrelated
    x = u.double() - 0.5
    for dim in range(4):  # step, (seed, stream), position, token
        a, b = x.narrow(dim, 0, x.shape[dim] - 1), x.narrow(dim, 1, x.shape[dim] - 1)
        r = float((a * b).mean() / (x * x).mean())
        assert abs(r) < 5 / a.numel() ** 0.5, (dim, r)
    # and so are the same cells under two seeds, two steps, two streams
    for a, b in ((u[:, 0], u[:, 2]), (u[0], u[1]), (u[:, 0::2], u[:, 1::2])):
        r = float(((a.double() - 0.5) * (b.double() - 0.5)).mean() * 12)
        assert abs(r) < 5 / a.numel() ** 0.5


# ---- vanilla sampling against the exact step distribution (float64) -------------------

VOCAB = 12  # mask id 11


@pytest.fixture(scope="module")
def target():
    path = random_checkpoint("noise-target", tokenizer=False, vocab_size=VOCAB, num_hidden_layers=2, seed=2, std=0.6)
    return dataclasses.replace(load_checkpoint(path, dtype="float64", with_tokenizer=False), stop_ids=[])


def block_logits(model, prompt, block):
    cache = model.new_cache(1, 32)
    P = len(prompt)
    pos = torch.arange(P)[None]
    model(torch.tensor([prompt]), pos, labels_for(P, "cpu", grp=pos // 4), "block_causal", cache, num_write=P,
          logits_slice=None)
    return model(torch.tensor([block]), torch.arange(P, P + 4)[None], labels_for(4, "cpu"), "bidirectional",
                 cache)[0]


def step_dists(logits, params, mask_id):
    """Per position: the sampling distribution (float64 over the support the filter keeps) and
    the confidence of each token (float64, unfiltered, temperature-scaled), MASK excluded."""
    logits = without_mask_token_(logits.clone(), mask_id)
    support = filtered_probs(logits, params) > 0
    logits = logits.double()  # the model's float32 logits, in float64 from here
    scaled = torch.softmax(logits / params.temperature, -1)
    sampling = torch.where(support, scaled, 0.0)
    return sampling / sampling.sum(-1, keepdim=True), scaled


def chi2_pvalue(counts, probs):
    N = counts.sum()
    keep = probs * N >= 5
    assert keep.sum() >= 8 and probs[keep].sum() > 0.8  # enough cells for the test to have power
    expected = probs[keep] * N
    observed = counts[keep]
    return chisquare(observed.numpy(), (expected * observed.sum() / expected.sum()).numpy()).pvalue


# the random model is confident: high temperatures give flat enough distributions for the test to have power
@pytest.mark.parametrize("params", [SamplingParams(temperature=5.0),
                                    SamplingParams(temperature=8.0, top_k=7, top_p=0.9)])
def test_static_first_step_follows_the_exact_distribution(target, params):
    """One static step from an all-MASK block reveals (position, token) with probability
    f_p(x) * prod_{q<p} P(c_q(X_q) < c_p(x)) * prod_{q>p} P(c_q(X_q) <= c_p(x)) (ties go to the
    lower position): every position's token is sampled with its own key, the most confident
    one is revealed. 4000 seeds through the vanilla step (Step.run_batch)."""
    mask = target.mask_token_id
    block = [mask] * 4
    logits = block_logits(target.model, [1, 2, 3, 4], block)
    f, conf = step_dists(logits, params, mask)
    exact = torch.zeros(4, VOCAB, dtype=torch.float64)
    for p in range(4):
        for x in range(VOCAB):
            if f[p, x] == 0:
                continue
            c = conf[p, x]
            prob = f[p, x]
            for q in range(4):
                if q != p:
                    prob = prob * f[q][(conf[q] < c) if q < p else (conf[q] <= c)].sum()
            exact[p, x] = prob
    assert abs(float(exact.sum()) - 1) < 1e-9
    N = 4000
    cfg = DecodeConfig(block_length=4, strategy="static", sampling=params)
    blk = torch.tensor(block)
    steps = [Step(blk, 0, cfg, mask, NoiseKey(seed, 4)) for seed in range(N)]
    out = Step.run_batch(steps, logits.repeat(N, 1, 1))
    counts = torch.zeros(4, VOCAB, dtype=torch.float64)
    for new, revealed, _ in out:
        p = int(revealed.nonzero())
        counts[p, int(new[p])] += 1
    assert counts.sum() == N
    assert float(counts[exact == 0].sum()) == 0
    assert chi2_pvalue(counts.flatten(), exact.flatten()) > 1e-3


def test_two_sequential_steps_follow_the_exact_joint(target):
    """Vanilla decoding of N rows (row i seeded i): the first two tokens (steps 0 and 1 of the
    block, positions 0 and 1) follow p_0(x0) * p_1(x1 | x0), the product of the target's step
    distributions (the second computed from the block with x0 revealed): the noise is
    independent across positions and steps."""
    mask = target.mask_token_id
    params = SamplingParams(temperature=5.0)
    prompt = [1, 2, 3, 4]
    f0, _ = step_dists(block_logits(target.model, prompt, [mask] * 4), params, mask)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for x0 in range(VOCAB):
        if f0[0, x0] > 0:
            f1, _ = step_dists(block_logits(target.model, prompt, [x0, mask, mask, mask]), params, mask)
            joint[x0] = f0[0, x0] * f1[1]
    N = 1500
    cfg = DecodeConfig(block_length=4, strategy="sequential", max_new_tokens=2, sampling=params)
    out = vanilla_generate_batch(target.model, [prompt] * N, cfg, mask, [])
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for r in out.results:
        counts[r.token_ids[0], r.token_ids[1]] += 1
    assert chi2_pvalue(counts.flatten(), joint.flatten()) > 1e-3


def test_two_static_steps_follow_the_exact_joint(target):
    """Two ``static`` steps of a block with two MASK positions (a prompt tail of two tokens):
    step 0 reveals the more confident position (its law as in the first-step test), step 1
    samples the other one afresh from the target's distribution given the first token. The
    position that lost step 0's race must not reuse that step's draw: the final pair (x2, x3)
    follows sum over the first position p of P(step 0 reveals p with x) * f_q(y | x at p),
    computed exactly (float64 forwards for every first outcome). 3000 seeds through the vanilla
    step (Step.run_batch)."""
    mask = target.mask_token_id
    params = SamplingParams(temperature=5.0)
    prompt, block = [1, 2, 3, 4], [5, 6, mask, mask]
    f, conf = step_dists(block_logits(target.model, prompt, block), params, mask)
    cond = {}  # (p, x) -> logits of the block with x at p
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for p, q in ((2, 3), (3, 2)):
        for x in range(VOCAB):
            if f[p, x] == 0:
                continue
            c = conf[p, x]
            first = f[p, x] * f[q][(conf[q] < c) if q < p else (conf[q] <= c)].sum()
            state = list(block)
            state[p] = x
            cond[(p, x)] = block_logits(target.model, prompt, state)
            g, _ = step_dists(cond[(p, x)], params, mask)
            for y in range(VOCAB):
                pair = (x, y) if p == 2 else (y, x)
                joint[pair] += first * g[q, y]
    assert abs(float(joint.sum()) - 1) < 1e-9
    N = 3000
    cfg = DecodeConfig(block_length=4, strategy="static", sampling=params)
    blk = torch.tensor(block)
    keys = [NoiseKey(seed, 4) for seed in range(N)]
    out = Step.run_batch([Step(blk, 0, cfg, mask, k) for k in keys],
                         block_logits(target.model, prompt, block).repeat(N, 1, 1))
    steps, logits = [], []
    for k, (new, revealed, _) in zip(keys, out):
        p = int(revealed.nonzero())
        steps.append(Step(new, 1, cfg, mask, k))
        logits.append(cond[(p, int(new[p]))])
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for new, _, _ in Step.run_batch(steps, torch.stack(logits)):
        assert mask not in new.tolist()
        counts[int(new[2]), int(new[3])] += 1
    assert float(counts[joint == 0].sum()) == 0
    assert chi2_pvalue(counts.flatten(), joint.flatten()) > 1e-3


def test_step_noise_is_keyed_by_position_and_step():
    """The noise of a block step is the same wherever it is computed, and differs across
    positions, steps, seeds and streams."""
    a = step_noise([NoiseKey(1, 8)], 2, 4, 50, "cpu")[0]
    assert torch.equal(a, step_noise([NoiseKey(9, 0), NoiseKey(1, 8)], [0, 2], 4, 50, "cpu")[1])
    assert torch.equal(a[1:], step_noise([NoiseKey(1, 9)], 2, 3, 50, "cpu")[0])  # positions are absolute
    for other in ([NoiseKey(1, 8)], 3), ([NoiseKey(2, 8)], 2), ([NoiseKey(1, 8, PAPER_DRAFT)], 2):
        assert not torch.equal(a, step_noise(other[0], other[1], 4, 50, "cpu")[0])
