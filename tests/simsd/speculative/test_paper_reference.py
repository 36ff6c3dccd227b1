"""Paper mode (greedy) held to an independent implementation of the paper's verification
(tests/reference_decoder.py ``reference_paper_generate``): its own draft loop and schedule
bookkeeping, the [leftover | D | M] query with the four-quadrant mask built cell by cell and
the RoPE copy, acceptance in the draft's temporal order, gamma, the fallback, the ablation;
transformers' Qwen3 in float64 with full recomputation. Two layers: the paper's approximation
is part of what is reproduced.
"""
import dataclasses

import pytest

from simsd import DecodeConfig, load_checkpoint
from simsd.speculative import SpecConfig, speculative_generate
from tests.reference_decoder import ReferenceModel, reference_paper_generate
from tests.simsd.speculative.reference_pair import THRESHOLD, prompt_of, reference_pair_paths


@pytest.fixture(scope="module")
def paths():
    return reference_pair_paths()


@pytest.fixture(scope="module")
def refs(paths):
    return tuple(ReferenceModel(p) for p in paths)


@pytest.fixture(scope="module")
def pair(paths):
    return tuple(dataclasses.replace(load_checkpoint(p, dtype="float64", with_tokenizer=False), stop_ids=[])
                 for p in paths)


def check(pair, refs, prompt, B, steps, strategy, gamma=None, on_reject="redraft", rope_copy=True, self_draft=False):
    target, draft = pair
    tref, dref = refs
    if self_draft:
        draft, dref = target, tref
    want = reference_paper_generate(tref, dref, prompt, block_length=B, steps=steps, strategy=strategy,
                                    threshold=THRESHOLD.get(strategy), gamma=gamma, on_reject=on_reject,
                                    rope_copy=rope_copy, max_new_tokens=2 * B + 3, stop_ids=[])
    cfg = DecodeConfig(block_length=B, steps=steps, strategy=strategy, threshold=THRESHOLD.get(strategy),
                       max_new_tokens=2 * B + 3)
    got = speculative_generate(target, draft, prompt, cfg,
                               SpecConfig(mode="paper", gamma=gamma, on_reject=on_reject, rope_copy=rope_copy))
    assert got.token_ids == want.token_ids
    return want


@pytest.mark.parametrize("strategy", ["sequential", "static", "dynamic", "entropy"])
@pytest.mark.parametrize("B,steps", [(4, 2), (8, 3), (8, 5)])
def test_paper_equals_reference(pair, refs, strategy, B, steps):
    rounds = blocks = 0
    for n in (8, 13):  # no prompt tail, and a tail of 5 tokens (1 at B = 4)
        want = check(pair, refs, prompt_of(n), B, steps, strategy)
        rounds += sum(len(blk) for blk in want.trace)
        blocks += len(want.trace)
    assert rounds > blocks  # rejections happen: some blocks take several rounds


VARIANTS = [("static", dict(gamma=2)), ("static", dict(gamma=3, on_reject="fallback")),
            ("dynamic", dict(gamma=4, on_reject="fallback")), ("static", dict(rope_copy=False)),
            ("dynamic", dict(self_draft=True)), ("static", dict(self_draft=True, gamma=2)),
            ("static", dict(self_draft=True, gamma=1, steps=5))]


@pytest.mark.parametrize("strategy,spec", VARIANTS, ids=["gamma2", "fallback3", "fallback4", "no-rope-copy", "self",
                                                         "self-gamma2", "self-gamma1-steps5"])
def test_paper_variants_equal_reference(pair, refs, spec, strategy):
    """B = 8 with 3 steps (schedule 3, 3, 2) or 5 (2, 2, 2, 1, 1), prompt tails of 1 and 5 tokens.
    With the target as its own draft whole rounds are accepted and the schedule must go on at
    the right step."""
    spec = dict(spec)
    steps = spec.pop("steps", 3)
    for n in (9, 13):
        check(pair, refs, prompt_of(n), 8, steps, strategy, **spec)
