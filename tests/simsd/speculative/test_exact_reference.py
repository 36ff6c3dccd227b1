"""Exact mode (greedy) is token-identical to vanilla target decoding, held to the independent
reference decoder (tests/reference_decoder.py) with several tokens per denoising step.

A poor draft (a different random model) makes most draft steps fail, so every verdict path
runs: accepted steps, rejected steps (the target's own step committed), the bonus copy, and
the schedule continuing across rounds at the right step.
"""
import dataclasses

import pytest

from simsd import DecodeConfig, load_checkpoint
from simsd.speculative import SpecConfig, speculative_generate
from tests.reference_decoder import ReferenceModel, reference_generate
from tests.simsd.speculative.reference_pair import THRESHOLD, V, prompt_of, reference_pair_paths


@pytest.fixture(scope="module")
def paths():
    return reference_pair_paths()


@pytest.fixture(scope="module")
def ref(paths):
    return ReferenceModel(paths[0])


@pytest.fixture(scope="module")
def pair(paths):
    return tuple(load_checkpoint(p, dtype="float64", with_tokenizer=False) for p in paths)


def run_exact(pair, prompt, cfg, **spec):
    target, draft = pair
    return speculative_generate(target, draft, prompt, cfg, SpecConfig(mode="exact", **spec))


@pytest.mark.parametrize("strategy", ["sequential", "static", "dynamic", "entropy"])
@pytest.mark.parametrize("B,steps", [(4, 4), (4, 2), (4, 3), (8, 4), (8, 3), (8, 5)])
def test_exact_equals_reference(pair, ref, strategy, B, steps):
    """Across prompt tails of 0, 1, 3 and 5 tokens; the whole grid runs with gamma = B."""
    target, _ = pair
    target = dataclasses.replace(target, stop_ids=[])
    for n in (8, 9, 11, 13):
        prompt = prompt_of(n)
        want = reference_generate(ref, prompt, block_length=B, steps=steps, strategy=strategy,
                                  threshold=THRESHOLD.get(strategy), max_new_tokens=2 * B + 3, stop_ids=[])
        cfg = DecodeConfig(block_length=B, steps=steps, strategy=strategy, threshold=THRESHOLD.get(strategy),
                           max_new_tokens=2 * B + 3)
        got = run_exact((target, pair[1]), prompt, cfg)
        assert got.token_ids == want.token_ids, n


@pytest.mark.parametrize("spec", [dict(gamma=1), dict(gamma=2), dict(gamma=2, on_reject="fallback"),
                                  dict(gamma=3, optimistic=True), dict(fold=True)],
                         ids=["gamma1", "gamma2", "fallback", "optimistic", "fold"])
@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_exact_variants_equal_reference(pair, ref, spec, strategy):
    """Fewer draft steps than the block has masks (the bonus copy), the paper's fallback,
    optimistic drafting and folded commits, with a non-uniform schedule ([3, 3, 2])."""
    spec = dict(spec)
    fold = spec.pop("fold", False)
    target = dataclasses.replace(pair[0], stop_ids=[])
    B, steps = 8, 3
    for n in (9, 13):
        prompt = prompt_of(n)
        want = reference_generate(ref, prompt, block_length=B, steps=steps, strategy=strategy,
                                  threshold=THRESHOLD.get(strategy), max_new_tokens=20, stop_ids=[])
        cfg = DecodeConfig(block_length=B, steps=steps, strategy=strategy, threshold=THRESHOLD.get(strategy),
                           max_new_tokens=20, fold_commit=fold)
        got = run_exact((target, pair[1]), prompt, cfg, **spec)
        assert got.token_ids == want.token_ids, n


def test_self_draft_exact_equals_reference(pair, ref):
    """The target as its own draft: every step is accepted and the bonus copy finishes blocks."""
    target = dataclasses.replace(pair[0], stop_ids=[])
    for B, steps, gamma in ((8, 3, 2), (8, 3, 1), (8, 5, 2), (8, 5, 3), (4, 2, 1)):
        prompt = prompt_of(11)
        want = reference_generate(ref, prompt, block_length=B, steps=steps, strategy="static",
                                  max_new_tokens=18, stop_ids=[])
        cfg = DecodeConfig(block_length=B, steps=steps, max_new_tokens=18)
        got = run_exact((target, target), prompt, cfg, gamma=gamma)
        assert got.token_ids == want.token_ids, (B, steps, gamma)


@pytest.mark.parametrize("mode", ["exact", "paper"])
def test_stop_ids_come_from_the_target(pair, ref, mode):
    """Draft and target with different stop ids: only the target's end the output. Several stop
    ids; stops that are the first, the last or a middle token of a block."""
    B = 4
    target, draft = pair
    prompt = prompt_of(9)  # a one-token tail: the first block generates 3 tokens
    free = reference_generate(ref, prompt, block_length=B, strategy="sequential", max_new_tokens=24, stop_ids=[])
    ids = free.token_ids
    fresh = [g for g in range(len(ids)) if ids.index(ids[g]) == g]
    first_of_block = next(g for g in fresh if g >= 3 and (g - 3) % B == 0)
    last_of_block = next(g for g in fresh if (g - 3) % B == B - 1)
    middle = next(g for g in fresh if (g - 3) % B in (1, 2))
    cfg = DecodeConfig(block_length=B, strategy="sequential", max_new_tokens=24)
    # the draft's stop id is a token generated early: taking it from the draft would end there
    draft_stop = ids[0]
    for g in (first_of_block, last_of_block, middle):
        stops = [ids[g], V - 3]
        if draft_stop in stops:
            continue
        t = dataclasses.replace(target, stop_ids=stops)
        d = dataclasses.replace(draft if mode == "exact" else target, stop_ids=[draft_stop])
        want = reference_generate(ref, prompt, block_length=B, strategy="sequential", max_new_tokens=24,
                                  stop_ids=stops)
        assert want.token_ids == ids[:g + 1]
        got = speculative_generate(t, d, prompt, cfg, SpecConfig(mode=mode))
        if mode == "exact":
            assert got.token_ids == want.token_ids, g
        else:  # paper mode (2 layers) has its own tokens: they end at the target's first stop id
            out = got.token_ids
            assert out[-1] in stops and not set(out[:-1]) & set(stops)
            free_paper = speculative_generate(dataclasses.replace(target, stop_ids=[]),
                                              dataclasses.replace(target, stop_ids=[]), prompt, cfg,
                                              SpecConfig(mode=mode)).token_ids
            assert out == free_paper[:len(out)]
        done = len(got.token_ids)
        assert got.stats["blocks"] == (1 if done <= 3 else 2 + (done - 4) // B)  # ended with that block
