"""Paper mode as the SimSD release's code runs it (``paper_variant="release"``,
simsd.speculative.verifiers.ReleaseVerifier): position-order acceptance on hand-worked rounds,
the fresh draft schedule of every round, counters on context-free models whose verdicts are
fixed, and whole generations held to an independent implementation of the release's loop
(tests/reference_decoder.py ``reference_release_generate``).

The hand-worked round is tests/simsd/speculative/test_verifiers.py's: L = 4, MASK = 9, position 0
known (token 3); the draft reveals 1 (token 7, tau 1), 3 (token 8, tau 2), 2 (token 6, tau 3).
"""
import dataclasses

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint
from simsd.speculative import SpecConfig, speculative_generate
from simsd.speculative.decoder import speculative_generate_batch
from simsd.speculative.spec_row import Draft
from simsd.speculative.verification import accept_in_position_order
from simsd.speculative.verifiers import PaperVerifier, ReleaseVerifier, Round
from simsd_kernels import TAU_INF
from tests.reference_decoder import ReferenceModel, reference_release_generate
from tests.simsd.speculative.reference_pair import THRESHOLD, prompt_of, reference_pair_paths
from tests.simsd.speculative.test_counters import B_TOK, GREEDY, PROMPT, SAMPLED, TARGET, WRONG, A, hand_counters
from tests.simsd.speculative.test_verifiers import START, row

M = 9
CFG = DecodeConfig(block_length=4)
RELEASE = SpecConfig(mode="paper", paper_variant="release")


def t(x):
    return torch.tensor(x)


def position_order(ok, replacement, proposed=(False, True, True, True), block=(3, M, M, M), drafted=(3, 7, 6, 8)):
    new, acc = accept_in_position_order(t(list(block)), t(list(drafted)), t(list(proposed)), t(list(ok)),
                                        t(list(replacement)))
    return new.tolist(), int(acc)


def test_position_order_verdicts():
    # every proposal accepted: the draft's tokens and nothing more (no bonus token)
    assert position_order([True] * 4, [0] * 4) == ([3, 7, 6, 8], 3)
    # position 2 rejected: 1 accepted, 2 takes the replacement, 3 (accepted on its own) is re-drafted
    assert position_order([True, True, False, True], [0, 0, 5, 0]) == ([3, 7, 5, M], 1)
    # the first position rejected: only the replacement, the rest MASK
    assert position_order([True, False, True, True], [0, 4, 0, 0]) == ([3, 4, M, M], 0)
    # the last position rejected: the prefix before it accepted, the replacement at the end
    assert position_order([True, True, True, False], [0, 0, 0, 1]) == ([3, 7, 6, 1], 2)
    # a known position's verdict is never read
    assert position_order([False, True, True, True], [0, 0, 0, 0]) == ([3, 7, 6, 8], 3)


def paper_round():
    block = [3, M, M, M]
    draft = Draft([t(block), t([3, 7, M, M]), t([3, 7, M, 8])], t([3, 7, 6, 8]), t([TAU_INF, 1, 3, 2]), None, 0)
    return Round(t(block), block, 1, START, draft, 0)


def judge(verifier_class, argmax):
    """The verdict of ``verifier_class`` when the target's argmax at the M slots of positions 1, 2,
    3 is ``argmax``."""
    v = verifier_class(CFG, SpecConfig(mode="paper"), M, seed=3)
    rnd = paper_round()
    fwd = v.request(row(), rnd)
    logits = torch.zeros(fwd.ids.shape[0], 12)
    for p, tok in zip((1, 2, 3), argmax):
        logits[int(rnd.layout[p]), tok] = 5.0
    logits[int(rnd.layout[2]), M] = 9.0  # MASK is never a verdict
    verdict = v.judge(rnd, logits)
    return verdict.block.tolist(), int(verdict.taken), int(verdict.accepted)


def test_release_judge_hand_worked():
    # the same request as paper mode's: the layout, mask and positions are the paper's
    a, b = ReleaseVerifier(CFG, RELEASE, M, 3), PaperVerifier(CFG, SpecConfig(mode="paper"), M, 3)
    fa, fb = a.request(row(), paper_round()), b.request(row(), paper_round())
    assert fa.ids.tolist() == fb.ids.tolist() and list(fa.positions) == list(fb.positions)
    assert fa.labels == fb.labels and fa.tau.tolist() == fb.tau.tolist() and fa.mask_mode == "paper"
    # position 2 (tau 3) rejected: the release commits 1 and the target's 10 at 2 and re-drafts 3;
    # the paper accepts in temporal order 1, 3 and replaces 2. The block step does not advance.
    assert judge(ReleaseVerifier, [7, 10, 8]) == ([3, 7, 10, M], 0, 1)
    assert judge(PaperVerifier, [7, 10, 8]) == ([3, 7, 10, 8], 3, 2)
    # position 3 (tau 2) rejected: position order accepts 1 and 2 (2's verdict was read with 3's
    # draft token in view), the paper stops at 3 before judging 2
    assert judge(ReleaseVerifier, [7, 6, 11]) == ([3, 7, 6, 11], 0, 2)
    assert judge(PaperVerifier, [7, 6, 11]) == ([3, 7, M, 11], 2, 1)
    # all accepted: the draft's block, no bonus token
    assert judge(ReleaseVerifier, [7, 6, 8]) == ([3, 7, 6, 8], 0, 3)
    assert a.acceptance_order([TAU_INF, 1, 3, 2], 3) == [1, 2, 3]
    assert b.acceptance_order([TAU_INF, 1, 3, 2], 3) == [1, 3, 2]


def test_release_draft_schedule_is_fresh_every_round():
    cfg = DecodeConfig(block_length=8, steps=3)
    v = ReleaseVerifier(cfg, RELEASE, M, 0)
    # the release's rule: step c reveals ceil(masks / (steps - c)), masks counted before the step,
    # whatever block step the round starts at; steps past the schedule reveal every MASK left
    got = []
    for c, masks in enumerate([5, 3, 1]):
        step_cfg, index = v.draft_step(cfg, 6, c, masks)
        got.append((index, step_cfg.tokens_for_step(index)))
    assert got == [(0, 2), (1, 2), (2, 1)]
    step_cfg, index = v.draft_step(cfg, 0, 4, 3)
    assert (index, step_cfg.tokens_for_step(index)) == (4, 3)
    assert v.draft_step(cfg, 0, 0, 8)[0].tokens_for_step(0) == 3  # a full block: the block's schedule 3, 3, 2
    assert cfg.schedule == [3, 3, 2]  # the draft's own settings are left as they are
    # paper mode as described goes on with the block's schedule
    assert PaperVerifier(cfg, SpecConfig(mode="paper"), M, 0).draft_step(cfg, 2, 1, 3) == (cfg, 3)


# hand-computed on the context-free models of tests/simsd/speculative/test_counters.py (B = 4,
# two blocks): the target's argmax is A everywhere; the draft is the target (all accepted) or puts
# its mass on B (every round's first position rejected).
#   self, 4 steps: one round per block, 4 draft steps of 1; no bonus token.
#   self, 2 steps: one round per block, 2 draft steps of 2.
#   wrong, 4 steps: rounds with 4, 3, 2, 1 MASK; each drafts all of them one per step (ceil(m / 4)
#     = 1 ...): 10 draft steps and proposals per block, 1 target token per round.
#   wrong, 2 steps: rounds with 4, 3, 2, 1 MASK draft 2 + 2, 2 + 1, 1 + 1, 1 positions: 7 draft
#     steps, 10 proposals per block.
# forwards: target = rounds + 1 commit; draft = its steps + 1 commit.
HAND = {
    ("self", 4): dict(proposed=8, accepted=8, target_tokens=0, rounds=2, from_draft=8, tf=3, df=9),
    ("self", 2): dict(proposed=8, accepted=8, target_tokens=0, rounds=2, from_draft=8, tf=3, df=5),
    ("wrong", 4): dict(proposed=20, accepted=0, target_tokens=8, rounds=8, from_draft=0, tf=9, df=21),
    ("wrong", 2): dict(proposed=20, accepted=0, target_tokens=8, rounds=8, from_draft=0, tf=9, df=15),
}


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampling"])
@pytest.mark.parametrize("key", HAND, ids=[f"{d}-steps{s}" for d, s in HAND])
def test_release_hand_checked_counters(key, sampling):
    which, steps = key
    draft = TARGET if which == "self" else WRONG
    cfg = DecodeConfig(block_length=4, steps=steps, strategy="static", sampling=sampling, max_new_tokens=8)
    out = speculative_generate(TARGET, draft, PROMPT, cfg, RELEASE)
    assert out.token_ids == [A] * 8 and B_TOK not in out.token_ids
    assert hand_counters(out.stats) == HAND[key]


def test_release_refusals():
    with pytest.raises(ValueError, match=r"paper_variant is a variant of paper mode \(the mode is exact\)"):
        SpecConfig(mode="exact", paper_variant="release")
    with pytest.raises(ValueError, match="no gamma"):
        SpecConfig(mode="paper", paper_variant="release", gamma=2)
    with pytest.raises(ValueError, match="fallback"):
        SpecConfig(mode="paper", paper_variant="release", on_reject="fallback")
    with pytest.raises(ValueError, match="paper_variant must be one of"):
        SpecConfig(mode="paper", paper_variant="published")


# -- whole generations against the independent implementation -----------------------------------------------
@pytest.fixture(scope="module")
def refs():
    return tuple(ReferenceModel(p) for p in reference_pair_paths())


@pytest.fixture(scope="module")
def pair():
    return tuple(dataclasses.replace(load_checkpoint(p, dtype="float64", with_tokenizer=False), stop_ids=[])
                 for p in reference_pair_paths())


@pytest.mark.parametrize("strategy", ["sequential", "static", "dynamic"])
@pytest.mark.parametrize("B,steps", [(4, 2), (8, 3), (8, 5)])
def test_release_equals_reference(pair, refs, strategy, B, steps):
    target, draft = pair
    redrafts = 0
    for n in (8, 13):  # no prompt tail, and a tail of 5 tokens (1 at B = 4)
        want = reference_release_generate(*refs, prompt_of(n), block_length=B, steps=steps, strategy=strategy,
                                          threshold=THRESHOLD.get(strategy), max_new_tokens=2 * B + 3, stop_ids=[])
        cfg = DecodeConfig(block_length=B, steps=steps, strategy=strategy, threshold=THRESHOLD.get(strategy),
                           max_new_tokens=2 * B + 3)
        got = speculative_generate(target, draft, prompt_of(n), cfg, RELEASE)
        assert got.token_ids == want.token_ids
        assert got.stats["rounds"] == sum(len(blk) for blk in want.trace)
        # the accepted prefix in position order is what the draft wrote
        assert got.stats["from_draft"] == sum(want.origins[:len(want.token_ids)])
        redrafts += sum(len(blk) - 1 for blk in want.trace)
    assert redrafts > 0  # rejections happen: suffixes are drafted again


def test_release_batched_and_optimistic_equal_alone(pair):
    """Rows whose fresh schedules differ share batched draft steps; optimistic drafting keeps the tokens."""
    target, draft = pair
    cfg = DecodeConfig(block_length=8, steps=3, strategy="dynamic", threshold=THRESHOLD["dynamic"],
                       max_new_tokens=19)
    prompts = [prompt_of(n) for n in (8, 13, 11)]
    alone = [speculative_generate(target, draft, p, cfg, RELEASE).token_ids for p in prompts]
    batch = speculative_generate_batch(target, draft, prompts, cfg, RELEASE)
    assert [r.token_ids for r in batch.results] == alone
    optimistic = dataclasses.replace(RELEASE, optimistic=True)
    assert [speculative_generate(target, draft, p, cfg, optimistic).token_ids for p in prompts] == alone


def test_release_sampling_is_seeded(pair):
    """Under sampling the release variant runs its position-order rejection sampling with keyed
    noise: the same seed gives the same tokens, another seed other tokens."""
    target, draft = pair
    run = lambda seed: speculative_generate(target, draft, prompt_of(8), DecodeConfig(  # noqa: E731
        block_length=4, sampling=SamplingParams(temperature=1.0), seed=seed, max_new_tokens=12), RELEASE).token_ids
    assert run(1) == run(1)
    assert run(1) != run(2)
