"""The verifiers on hand-made rounds (simsd.speculative.verifiers): the verify forward each mode
requests (tokens, positions, labels, mask mode, folded or flushed commits, the exact copies'
own step) and the verdict each judges, every value written by hand.

The round of tests/simsd/speculative/test_verdicts.py: L = 4, MASK = 9, the draft reveals
position 0 (token 5), then 2 (token 6), then 1 and 3 (tokens 7 and 8):

    states[0] = [M, M, M, M]   states[1] = [5, M, M, M]   states[2] = [5, M, 6, M]   final = [5, 7, 6, 8]
"""
import pytest
import torch

from simsd.decoding.config import DecodeConfig
from simsd.decoding.layouts import RowLayouts
from simsd.decoding.step import Step
from simsd.engine.batching import Row
from simsd.speculative.decoder import SpecConfig
from simsd.speculative.spec_row import Draft
from simsd.speculative.verifiers import ExactVerifier, PaperVerifier, Round, Verdict
from simsd_kernels import KIND_DRAFT, KIND_KNOWN, KIND_MASK, SHARED_GRP, TAU_INF

M = 9
S0, S1, S2, FINAL = [M, M, M, M], [5, M, M, M], [5, M, 6, M], [5, 7, 6, 8]
CFG = DecodeConfig(block_length=4)
START = 8  # the block's absolute position: 8 tokens cached


def t(x):
    return torch.tensor(x)


def row(pending=None):
    """The layouts of an engine row with ``START`` tokens cached (and a folded commit)."""
    r = RowLayouts(Row(0, {"target": torch.device("cpu")}, {"target": START}, {"target": 0}))
    if pending is not None:  # a folded commit of the previous block (4 tokens): the block starts after it
        r.row.cached["target"] = START - 4
        r.pending["target"] = t(pending)
        assert r.start("target") == START
    return r


def exact_round(states, final, tau, remaining, step=2, index=5):
    draft = Draft([t(s) for s in states], t(final), t(tau), None, remaining)
    return Round(t(states[0]), list(states[0]), step, START, draft, index)


def unpack(verdict):
    return verdict.block.tolist(), int(verdict.taken), int(verdict.accepted)


# -- exact -------------------------------------------------------------------------------------------------
def test_exact_request_one_copy_per_draft_step():
    v = ExactVerifier(CFG, SpecConfig(mode="exact"), M, seed=3)
    rnd = exact_round([S0, S1, S2], FINAL, [1, 3, 2, 3], 0)
    fwd = v.request(row(), rnd)
    assert (fwd.model, fwd.mask_mode, fwd.num_write, fwd.count) == ("target", "exact", 0, True)
    assert fwd.ids.tolist() == S0 + S1 + S2  # no bonus copy: the final state has no MASK
    assert list(fwd.positions) == [8, 9, 10, 11] * 3
    assert fwd.labels == [(KIND_KNOWN, 0, c) for c in range(3) for _ in range(4)] and fwd.tau is None
    assert fwd.logits == slice(None)
    # the copies carry the target's own step, at block steps 2, 3, 4 with the row's noise key
    assert isinstance(fwd.step, Step) and fwd.step.states == 3 and fwd.step.indices() == [2, 3, 4]
    assert fwd.step.block.tolist() == [S0, S1, S2] and fwd.step.cfg is CFG and fwd.step.mask_id == M
    assert (fwd.step.key.seed, fwd.step.key.start) == (3, START)


def test_exact_request_bonus_copy_and_folded_commit():
    v = ExactVerifier(CFG, SpecConfig(mode="exact"), M, seed=3)
    rnd = exact_round([S0, S1], S2, [1, TAU_INF, 2, TAU_INF], 2)  # two steps, MASK left: a bonus copy
    r = row(pending=[1, 2, 3, 4])
    fwd = v.request(r, rnd)
    assert fwd.ids.tolist() == [1, 2, 3, 4] + S0 + S1 + S2
    assert list(fwd.positions) == [4, 5, 6, 7] + [8, 9, 10, 11] * 3
    assert fwd.labels == [(KIND_KNOWN, 0, SHARED_GRP)] * 4 + [(KIND_KNOWN, 0, c) for c in range(3) for _ in range(4)]
    assert fwd.num_write == 4 and fwd.logits == slice(4, None) and not r.pending
    assert fwd.step.states == 3 and fwd.step.block.tolist() == [S0, S1, S2]


def test_exact_judge():
    v = ExactVerifier(CFG, SpecConfig(mode="exact"), M, seed=3)
    rnd = exact_round([S0, S1, S2], FINAL, [1, 3, 2, 3], 0)
    v.request(row(), rnd)
    # the target's own steps agree with the draft's first two steps, then reveal position 1 only
    mine = t([S1, S2, [5, 7, 6, M]])
    assert unpack(v.judge(rnd, (mine, None, None))) == ([5, 7, 6, M], 3, 2)
    assert unpack(v.judge(rnd, (t([S1, S2, FINAL]), None, None))) == (FINAL, 3, 4)
    # with a bonus copy: every draft step accepted, the target's bonus step committed
    rnd = exact_round([S0, S1], S2, [1, TAU_INF, 2, TAU_INF], 2)
    v.request(row(), rnd)
    assert unpack(v.judge(rnd, (t([S1, S2, [5, 7, 6, M]]), None, None))) == ([5, 7, 6, M], 3, 2)
    assert unpack(v.judge(rnd, (t([[M, 5, M, M], S2, [5, 7, 6, M]]), None, None))) == ([M, 5, M, M], 1, 0)


# -- paper -------------------------------------------------------------------------------------------------
def paper_round(index=0):
    # position 0 known before the round (token 3); the draft reveals 1 (tau 1), 3 (tau 2), 2 (tau 3)
    block = [3, M, M, M]
    draft = Draft([t(block), t([3, 7, M, M]), t([3, 7, M, 8])], t([3, 7, 6, 8]), t([TAU_INF, 1, 3, 2]), None, 0)
    return Round(t(block), block, 1, START, draft, index)


def test_paper_request_layout():
    v = PaperVerifier(CFG, SpecConfig(mode="paper"), M, seed=3)
    rnd = paper_round()
    fwd = v.request(row(), rnd)
    assert (fwd.mask_mode, fwd.num_write) == ("paper", 0)
    assert fwd.ids.tolist() == [3, 7, 6, 8, M, M, M]  # leftover, D slots, M slots
    assert list(fwd.positions) == [8, 9, 10, 11, 9, 10, 11]  # the RoPE copy: M_k at D_k's position
    assert fwd.labels == [(KIND_KNOWN, 0, 0)] + [(KIND_DRAFT, 0, 0)] * 3 + [(KIND_MASK, 0, 0)] * 3
    assert fwd.tau.dtype == torch.int32 and fwd.tau.tolist() == [0, 1, 3, 2, 1, 3, 2]
    assert rnd.layout.tolist() == [0, 4, 5, 6]  # each position's M slot (known: not read)
    no_copy = PaperVerifier(CFG, SpecConfig(mode="paper", rope_copy=False), M, seed=3).request(row(), paper_round())
    assert list(no_copy.positions) == [8, 9, 10, 11, 12, 13, 14]


def test_paper_verify_flushes_a_pending_commit_first():
    v = PaperVerifier(CFG, SpecConfig(mode="paper"), M, seed=3)
    r = row(pending=[1, 2, 3, 4])
    prog = v.verify(r, paper_round())
    flush = next(prog)
    assert flush.ids.tolist() == [1, 2, 3, 4] and flush.num_write == 4 and flush.logits is None
    r.row.cached["target"] += 4  # what the engine does when it runs the commit
    fwd = prog.send(None)
    assert fwd.mask_mode == "paper" and list(fwd.positions)[0] == START
    logits = torch.zeros(7, 12)
    with pytest.raises(StopIteration) as stop:
        prog.send(logits)
    assert stop.value.value is logits  # verify returns the verify forward's logits


def test_paper_judge_greedy():
    v = PaperVerifier(CFG, SpecConfig(mode="paper"), M, seed=3)
    rnd = paper_round()
    v.request(row(), rnd)
    logits = torch.zeros(7, 12)
    logits[4, 7] = 5.0  # M slot of position 1: the draft's 7
    logits[6, 8] = 5.0  # position 3: the draft's 8
    logits[5, 9] = 9.0  # position 2: MASK wins the raw logits ...
    logits[5, 10] = 5.0  # ... but is excluded: 10 rejects the draft's 6
    # temporal order 1 (tau 1), 3 (tau 2), 2 (tau 3): two accepted, position 2 takes 10 at step 3
    assert unpack(v.judge(rnd, logits)) == ([3, 7, 10, 8], 3, 2)
    logits = torch.zeros(7, 12)
    logits[4, 1] = 5.0  # the first proposal in temporal order rejected: the round took one step
    rnd = paper_round()
    v.request(row(), rnd)
    assert unpack(v.judge(rnd, logits)) == ([3, 1, M, M], 1, 0)


def test_verdict_and_sampling_flags():
    assert Verdict._fields == ("block", "taken", "accepted", "valid", "node", "next", "finished", "logits",
                               "next_logits", "next_taken", "next_accepted", "next_node")
    assert PaperVerifier.rejection_sampling and not ExactVerifier.rejection_sampling
