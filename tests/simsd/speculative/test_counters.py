"""What the statistics of a run mean, checked on hand-computed cases and by the invariants
between counters, in every mode (vanilla, paper, exact), greedy and sampling, with stops inside
an accepted prefix (docs/statistics.md "Invariants").

Hand-checked cases use *context-free* models: attention and MLP write nothing back (o_proj and
down_proj are zero), so the logits at a position depend only on the token there. Every MASK
position then has the same distribution: one-hot at token A for the target; the draft either
shares the target's weights (every proposal is accepted) or puts its mass on B != A (every
proposal is rejected). Sampling at temperature 1 takes the same decisions (the distributions are
one-hot in float32), so the same numbers hold greedy and sampling. Confidences tie, so
``static`` reveals left to right, one token per step (B = 4, 4 steps).
"""
import dataclasses

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, vanilla_generate
from simsd.models.loading import Checkpoint
from simsd.speculative import SpecConfig, speculative_generate
from tests.helpers import context_free_checkpoint, random_checkpoint

V, MASK, A, B_TOK = 32, 31, 7, 9
PROMPT = [1, 2, 3, 4]  # aligned: no prompt tail in the first block


def context_free(top: int, seed: int = 0) -> Checkpoint:
    """Logits at MASK one-hot at ``top`` (a margin of 200: exactly one-hot in float32 at T = 1)."""
    logits = torch.zeros(V, dtype=torch.float64)
    logits[top] = 200.0
    return context_free_checkpoint(logits, MASK, seed=seed)


TARGET, WRONG = context_free(A), context_free(B_TOK, seed=1)
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=1.0)


def cfg_of(sampling, max_new=8):
    return DecodeConfig(block_length=4, steps=4, strategy="static", sampling=sampling, max_new_tokens=max_new)


def run(mode, draft, sampling, gamma=4, stop=(), max_new=8):
    target = dataclasses.replace(TARGET, stop_ids=list(stop))
    if mode == "vanilla":
        return vanilla_generate(target.model, PROMPT, cfg_of(sampling, max_new), MASK, list(stop))
    return speculative_generate(target, dataclasses.replace(draft, stop_ids=list(stop)), PROMPT,
                                cfg_of(sampling, max_new), SpecConfig(mode=mode, gamma=gamma))


# hand-computed: (mode, draft, gamma) -> counters over two blocks of 4 tokens (8 new tokens)
#   self draft, gamma 4: one round per block, 4 proposed and accepted.
#   self draft, gamma 2, exact: round 1 proposes 2 (accepted) and the bonus copy adds the target's own
#     step (1 target token); round 2 proposes the last 1 -> per block 3 proposed, 3 accepted, 1 target.
#   self draft, gamma 2, paper: no bonus copy: 2 + 2 proposed and accepted per block.
#   wrong draft: the first proposal of every round is rejected and corrected by the target (1 target
#     token); the draft re-drafts the rest: 4 rounds per block, proposals 4+3+2+1 (gamma 4) or 2+2+2+1.
# forwards: target = verify rounds + 1 commit (the last block is not committed); draft = its
#   denoising steps (the proposals, one token per step) + 1 commit.
HAND = {
    ("exact", "self", 4): dict(proposed=8, accepted=8, target_tokens=0, rounds=2, from_draft=8, tf=3, df=9),
    ("paper", "self", 4): dict(proposed=8, accepted=8, target_tokens=0, rounds=2, from_draft=8, tf=3, df=9),
    ("exact", "self", 2): dict(proposed=6, accepted=6, target_tokens=2, rounds=4, from_draft=6, tf=5, df=7),
    ("paper", "self", 2): dict(proposed=8, accepted=8, target_tokens=0, rounds=4, from_draft=8, tf=5, df=9),
    ("exact", "wrong", 4): dict(proposed=20, accepted=0, target_tokens=8, rounds=8, from_draft=0, tf=9, df=21),
    ("paper", "wrong", 4): dict(proposed=20, accepted=0, target_tokens=8, rounds=8, from_draft=0, tf=9, df=21),
    ("exact", "wrong", 2): dict(proposed=14, accepted=0, target_tokens=8, rounds=8, from_draft=0, tf=9, df=15),
    ("paper", "wrong", 2): dict(proposed=14, accepted=0, target_tokens=8, rounds=8, from_draft=0, tf=9, df=15),
}


def hand_counters(stats: dict) -> dict:
    """The counters the hand-checked tables give (target/draft forwards as ``tf``/``df``)."""
    got = {k: stats[k] for k in ("proposed", "accepted", "target_tokens", "rounds", "from_draft")}
    return dict(got, tf=stats["target_forwards"], df=stats["draft_forwards"])


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampling"])
@pytest.mark.parametrize("key", HAND, ids=[f"{m}-{d}-gamma{g}" for m, d, g in HAND])
def test_hand_checked_counters(key, sampling):
    mode, which, gamma = key
    want = HAND[key]
    r = run(mode, TARGET if which == "self" else WRONG, sampling, gamma)
    s = r.stats
    assert r.token_ids == [A] * 8
    assert hand_counters(s) == want
    assert (s["new_tokens"], s["cut_tokens"], s["blocks"]) == (8, 0, 2)
    assert s["acceptance_rate"] == want["accepted"] / want["proposed"]
    assert s["draft_share"] == want["from_draft"] / 8
    assert s["accepted_per_round"] == want["accepted"] / want["rounds"]


# a prompt of 5 tokens: its last token is the first block's tail, the block generates 3 tokens and
# the next one 4 (7 new tokens). Self draft: one round per block, every proposal accepted (3 + 4).
# Wrong draft: every round's first proposal rejected: proposals 3+2+1 and 4+3+2+1, 7 rounds.
HAND_TAIL = {
    ("exact", "self"): dict(proposed=7, accepted=7, target_tokens=0, rounds=2, from_draft=7, tf=3, df=8),
    ("paper", "self"): dict(proposed=7, accepted=7, target_tokens=0, rounds=2, from_draft=7, tf=3, df=8),
    ("exact", "wrong"): dict(proposed=16, accepted=0, target_tokens=7, rounds=7, from_draft=0, tf=8, df=17),
    ("paper", "wrong"): dict(proposed=16, accepted=0, target_tokens=7, rounds=7, from_draft=0, tf=8, df=17),
}


@pytest.mark.parametrize("key", HAND_TAIL, ids=[f"{m}-{d}" for m, d in HAND_TAIL])
def test_hand_checked_counters_with_a_prompt_tail(key):
    """The prompt tail's position is neither the draft's nor the target's: the counters and the
    draft's share cover the generated positions only."""
    mode, which = key
    want = HAND_TAIL[key]
    cfg = cfg_of(GREEDY, 7)
    r = speculative_generate(TARGET, TARGET if which == "self" else WRONG, PROMPT + [5], cfg,
                             SpecConfig(mode=mode, gamma=4))
    s = r.stats
    assert r.token_ids == [A] * 7
    assert hand_counters(s) == want
    assert (s["new_tokens"], s["cut_tokens"], s["blocks"]) == (7, 0, 2)
    assert s["draft_share"] == want["from_draft"] / 7


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampling"])
def test_hand_checked_vanilla(sampling):
    s = run("vanilla", None, sampling).stats
    assert (s["new_tokens"], s["cut_tokens"], s["target_forwards"], s["blocks"]) == (8, 0, 9, 2)
    s = run("vanilla", None, sampling, stop=[A]).stats  # the first token stops: 3 decoded tokens are cut
    assert (s["new_tokens"], s["cut_tokens"], s["target_forwards"], s["blocks"]) == (1, 3, 4, 1)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampling"])
@pytest.mark.parametrize("mode", ["exact", "paper"])
def test_stop_inside_an_accepted_prefix(mode, sampling):
    """The whole first block is accepted in one round; its first token is a stop id. Accepted
    counts verification (4), the output holds 1 token, 3 are reported as cut."""
    r = run(mode, TARGET, sampling, stop=[A])
    s = r.stats
    assert r.token_ids == [A]
    want = dict(new_tokens=1, cut_tokens=3, proposed=4, accepted=4, target_tokens=0, from_draft=1, rounds=1,
                target_forwards=1, draft_forwards=4, blocks=1)
    assert {k: s[k] for k in want} == want
    assert s["draft_share"] == 1.0 and s["acceptance_rate"] == 1.0


@pytest.mark.parametrize("mode", ["exact", "paper"])
def test_budget_cut_inside_an_accepted_prefix(mode):
    r = run(mode, TARGET, GREEDY, max_new=6)
    s = r.stats
    assert len(r.token_ids) == 6
    assert (s["new_tokens"], s["cut_tokens"], s["accepted"], s["from_draft"]) == (6, 2, 8, 6)


# -- invariants on random models ------------------------------------------------------------
def random_pair():
    from simsd import load_checkpoint
    t = load_checkpoint(random_checkpoint("counters-t", tokenizer=False, vocab_size=64, seed=3, std=0.3),
                        dtype="float64", with_tokenizer=False)
    d = load_checkpoint(random_checkpoint("counters-d", tokenizer=False, vocab_size=64, seed=4, num_hidden_layers=1,
                                          std=0.3), dtype="float64", with_tokenizer=False)
    return t, d


def check_invariants(stats: dict, token_ids: list, cfg: DecodeConfig, mode: str) -> None:
    s = stats
    assert s["new_tokens"] == len(token_ids) <= cfg.max_new_tokens
    assert 0 <= s["cut_tokens"] < cfg.block_length  # only the last block is cut
    if mode == "vanilla":
        return
    assert s["accepted"] + s["target_tokens"] == s["new_tokens"] + s["cut_tokens"]
    assert 0 <= s["accepted"] <= s["proposed"]
    assert 0 <= s["from_draft"] <= min(s["accepted"], s["new_tokens"])
    assert s["new_tokens"] - s["from_draft"] <= s["target_tokens"]
    assert s["acceptance_rate"] == (s["accepted"] / s["proposed"] if s["proposed"] else 0.0)
    assert s["draft_share"] == s["from_draft"] / s["new_tokens"]
    assert s["accepted_per_round"] == (s["accepted"] / s["rounds"] if s["rounds"] else 0.0)
    assert s["rounds"] + s["fallback_steps"] >= 1


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.8, top_k=8)], ids=["greedy", "sampling"])
@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_invariants_with_stops(mode, sampling):
    """Stop ids chosen among the tokens a free run emits, so stops land inside accepted prefixes."""
    target, draft = random_pair()
    cfg = DecodeConfig(block_length=4, strategy="static", sampling=sampling, max_new_tokens=24)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 6]
    for on_reject in ("redraft", "fallback"):
        for p in prompts:
            free = (vanilla_generate(target.model, p, cfg, target.mask_token_id, []) if mode == "vanilla" else
                    speculative_generate(target, draft, p, cfg, SpecConfig(mode=mode, on_reject=on_reject)))
            check_invariants(free.stats, free.token_ids, cfg, mode)
            for stop in sorted(set(free.token_ids[1:6])):
                t = dataclasses.replace(target, stop_ids=[stop])
                r = (vanilla_generate(t.model, p, cfg, t.mask_token_id, [stop]) if mode == "vanilla" else
                     speculative_generate(t, draft, p, cfg, SpecConfig(mode=mode, on_reject=on_reject)))
                check_invariants(r.stats, r.token_ids, cfg, mode)
                assert r.token_ids[-1] == stop and stop not in r.token_ids[:-1]
        if mode == "vanilla":
            break
