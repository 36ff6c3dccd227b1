"""Optimistic drafting: the rollback bookkeeping and decoding with speculation (CPU)."""
import dataclasses

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint
from simsd.speculative import SpecConfig, speculative_generate, speculative_generate_batch
from simsd.speculative.optimistic import Speculation, assumed_outcome, keep_commit, reconcile, salvage
from simsd.speculative.spec_row import Draft
from simsd_kernels import TAU_INF
from tests.helpers import random_checkpoint

M = 99  # mask id of the hand-made drafts
INF = TAU_INF
V = 96


def draft_of(start, steps):
    """A Draft from ``start`` revealing ``steps`` = [(position, token), ...] one per step."""
    states, state = [], torch.tensor(start)
    tau = torch.full((len(start),), INF)
    for c, (p, tok) in enumerate(steps):
        states.append(state.clone())
        state[p] = tok
        tau[p] = c + 1
    return Draft(states, state, tau, torch.zeros(len(start), 4), int((state == M).sum()))


def never(_):
    return False


def test_assumed_outcome_inside_block_and_across():
    d = draft_of([7, M, M, M], [(1, 5), (3, 6)])
    block, step, committed = assumed_outcome(d, 1, M, never)
    assert block.tolist() == [7, 5, M, 6] and step == 3 and committed is None
    full = draft_of([7, M, M, M], [(1, 5), (2, 4), (3, 6)])
    block, step, committed = assumed_outcome(full, 0, M, never)
    assert block.tolist() == [M] * 4 and step == 0 and committed.tolist() == [7, 5, 4, 6]
    assert assumed_outcome(full, 0, M, lambda b: True) is None  # generation would stop: no speculation


def test_reconcile_accept_bonus_reject():
    nxt = draft_of([7, 5, M, 6], [(2, 4)])
    spec = Speculation(torch.tensor([7, 5, M, 6]), 3, nxt, draft_cached=8)
    assert reconcile(spec, torch.tensor([7, 5, M, 6]), 3) == 0           # every step accepted
    assert reconcile(spec, torch.tensor([7, 5, M, 8]), 3) is None        # step 2 rejected: 8 instead of 6
    assert reconcile(spec, torch.tensor([7, 5, M, M]), 2) is None        # fewer steps taken
    two = draft_of([7, 5, M, M], [(3, 6), (2, 4)])
    spec = Speculation(torch.tensor([7, 5, M, M]), 2, two, draft_cached=8)
    assert reconcile(spec, torch.tensor([7, 5, M, 6]), 3) == 1           # exact mode's bonus step matched
    assert reconcile(spec, torch.tensor([7, 5, 1, M]), 3) is None        # the bonus step chose otherwise
    rest = salvage(two, 1)
    assert rest.n == 1 and rest.states[0].tolist() == [7, 5, M, 6]
    assert rest.tau.tolist() == [INF, INF, 1, INF] and rest.final.tolist() == [7, 5, 4, 6]


def test_keep_commit():
    spec = Speculation(torch.full((4,), M), 0, draft_of([M] * 4, [(0, 1)]), 8, committed=torch.tensor([7, 5, 4, 6]))
    assert keep_commit(spec, torch.tensor([7, 5, 4, 6]))
    assert not keep_commit(spec, torch.tensor([7, 5, 4, 2]))
    assert not keep_commit(dataclasses.replace(spec, committed=None), torch.tensor([7, 5, 4, 6]))


def ckpt(name, layers=2, seed=0):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2)
    return load_checkpoint(path, dtype="float64", with_tokenizer=False)


PROMPTS = [list(range(1, 10)), list(range(20, 26)), [3, 1, 4]]


@pytest.mark.parametrize("mode", ["paper", "exact"])
@pytest.mark.parametrize("draft_kind", ["self", "poor"])
def test_optimistic_greedy_equals_plain(mode, draft_kind):
    """Greedy: speculation never changes the tokens; a poor draft's speculations get discarded
    and its speculative block commits rolled back (paper mode output depends on the draft
    cache, so a missed rollback would show)."""
    target = ckpt("target")
    draft = target if draft_kind == "self" else ckpt("poor-draft", layers=1, seed=11)
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=20)
    plain = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode, optimistic=False))
    opt = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode, optimistic=True))
    assert [r.token_ids for r in opt.results] == [r.token_ids for r in plain.results]
    s = [r.stats for r in opt.results]
    assert all(x["speculations"] > 0 for x in s)
    kept = sum(x["speculations_kept"] for x in s)
    if draft_kind == "self":
        assert kept > 0
    else:
        assert kept < sum(x["speculations"] for x in s)
    if mode == "paper" or draft_kind == "poor":
        # the target's work is the same; discarded speculations cost draft forwards
        assert [x["target_forwards"] for x in s] == [r.stats["target_forwards"] for r in plain.results]


def test_optimistic_sampling_and_separate_devices_default():
    """Different devices turn speculation on by default (here both are CPU: it stays off), and
    sampling with speculation is reproducible per seed."""
    target, draft = ckpt("target"), ckpt("poor-draft", layers=1, seed=11)
    cfg = DecodeConfig(block_length=4, max_new_tokens=12, seed=3, sampling=SamplingParams(temperature=2.0))
    off = speculative_generate(target, draft, PROMPTS[0], cfg, SpecConfig(mode="exact"))
    assert off.stats["speculations"] == 0
    a = speculative_generate(target, draft, PROMPTS[0], cfg, SpecConfig(mode="exact", optimistic=True))
    b = speculative_generate(target, draft, PROMPTS[0], cfg, SpecConfig(mode="exact", optimistic=True))
    assert a.token_ids == b.token_ids and a.stats["speculations"] > 0
