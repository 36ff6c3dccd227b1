"""Log-probabilities in the speculative modes (:mod:`simsd.decoding.logprobs`): exact mode reports
vanilla decoding's, bit for bit -- the verify copy that revealed a token is the state vanilla
stepped from, with the same logits (invariant numerics: tests/simsd/models/test_invariant_numerics.py)
-- with a draft model (chains and trees of alternatives), with ``draft="self"`` (lookahead rounds
included), optimistic drafting and fallback steps, greedy and sampled, float32 and bfloat16, every
strategy, in batches. Paper mode reports the target's distribution at each token's M slot, which
with one draft step per round is the vanilla step's state (checked within float32 rounding)."""
import pytest

from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.speculative import SpecConfig, speculative_generate_batch
from tests.simsd.speculative.test_exact_sampling import PROMPTS, THRESHOLD, ckpt

STRATEGIES = ["static", "sequential", "dynamic", "entropy"]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def models(request):
    dtype = request.param
    return {"target": ckpt("target", dtype=dtype), "near": ckpt("target", std=0.22, dtype=dtype),
            "tiny": ckpt("poor-draft", layers=1, seed=11, dtype=dtype)}


def cfg_for(strategy, T, seed=0, **kw):
    from simsd import DecodeConfig, SamplingParams
    return DecodeConfig(block_length=4, strategy=strategy, threshold=THRESHOLD.get(strategy), max_new_tokens=16,
                        seed=seed, sampling=SamplingParams(temperature=T, top_k=40, top_p=0.95), logprobs=4, **kw)


def vanilla(target, cfg):
    return vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, []).results


def assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, (what, i)
        assert g.logprobs == w.logprobs, (what, i)  # exactly: the same bits
        assert len(g.logprobs) == len(g.token_ids)


@pytest.mark.parametrize("T", [0.0, 0.8])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exact_logprobs_are_vanillas(models, strategy, T):
    target = models["target"]
    cfg = cfg_for(strategy, T, seed=7)
    want = vanilla(target, cfg)
    runs = {"near": (models["near"], SpecConfig(mode="exact")),
            "tiny": (models["tiny"], SpecConfig(mode="exact")),
            "self": ("self", SpecConfig(mode="exact", speculation_width=7)),
            "optimistic": (models["near"], SpecConfig(mode="exact", optimistic=True)),
            "fallback": (models["near"], SpecConfig(mode="exact", gamma=2, on_reject="fallback"))}
    if strategy in ("static", "sequential"):  # a draft model's alternatives beside each step (a tree)
        runs["tree"] = (models["near"], SpecConfig(mode="exact", gamma=2, speculation_width=9))
    accepted = 0
    for what, (draft, spec) in runs.items():
        got = speculative_generate_batch(target, draft, PROMPTS, cfg, spec).results
        assert_same(got, want, what)
        accepted += sum(r.stats["accepted"] for r in got)
    assert accepted > 0  # tokens came from proposals, not only from the target's own steps


def test_self_speculation_lookahead_rounds_keep_vanillas_logprobs(models):
    """A lookahead round takes the next block's first step: its tokens' log-probabilities come
    from that copy's logits and are carried into the next block."""
    target = models["target"]
    cfg = cfg_for("static", 0.0)
    got = speculative_generate_batch(target, "self", PROMPTS, cfg, SpecConfig(mode="exact", speculation_width=7))
    assert sum(r.stats["lookahead_blocks"] for r in got.results) > 0
    assert_same(got.results, vanilla(target, cfg), "self")


@pytest.mark.parametrize("gamma", [1, 2, None])
def test_paper_logprobs_are_the_m_slots_distribution(gamma):
    """Paper mode reports the target's distribution at each token's M slot. For a one-layer model
    the paper's mask is exact (docs/design.md §4.1: an M slot's keys are the embeddings of the
    state vanilla's step sees), so with the target as its own draft, greedy, paper mode decodes
    vanilla's tokens and its log-probabilities are vanilla's, up to float32 rounding of another
    forward layout. (From two layers on, M slots see draft tokens through other M slots: paper
    mode's approximation, in its log-probabilities too.)"""
    target = ckpt("poor-draft", layers=1, seed=11)
    cfg = cfg_for("static", 0.0, seed=3)
    want = vanilla(target, cfg)
    got = speculative_generate_batch(target, ckpt("poor-draft", layers=1, seed=11), PROMPTS, cfg,
                                     SpecConfig(mode="paper", gamma=gamma)).results
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.stats["accepted"] > 0
        for (lp, rank, top), (lp2, rank2, top2) in zip(g.logprobs, w.logprobs):
            assert abs(lp - lp2) < 1e-5 and rank == rank2
            assert [t for t, _ in top] == [t for t, _ in top2]


def test_paper_sampled_logprobs_cover_every_token():
    """Under rejection sampling (fresh draft noise) the tokens are paper mode's own: each has an
    entry, its top 4 sorted, its rank consistent with them."""
    target = ckpt("target")
    got = speculative_generate_batch(target, ckpt("target", std=0.22), PROMPTS, cfg_for("dynamic", 0.8, seed=3),
                                     SpecConfig(mode="paper")).results
    for g in got:
        assert len(g.logprobs) == len(g.token_ids) == 16
        for (lp, rank, top), t in zip(g.logprobs, g.token_ids):
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True) and lp <= 0
            assert (rank <= 4) == (t in [i for i, _ in top])


def test_paper_self_draft_reports_every_token(models):
    target = models["target"]
    cfg = cfg_for("static", 0.0)
    got = speculative_generate_batch(target, "self", PROMPTS, cfg, SpecConfig(mode="paper")).results
    for r in got:
        assert len(r.logprobs) == len(r.token_ids) == 16
        assert all(lp <= 0 and rank >= 1 for lp, rank, _ in r.logprobs)
