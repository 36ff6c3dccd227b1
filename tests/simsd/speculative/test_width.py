"""The width of self-speculative rounds (simsd/speculative/width.py) and the engine's forward costs
(simsd/engine/costs.py): a tree's copies and expected steps by hand, the choice under a cap, under
a GPU-like flat cost and a CPU-like growing one, and the running fit."""
import pytest
import torch

from simsd.config.speculative import MAX_ALTERNATIVES
from simsd.config.vocabulary import ParamError
from simsd.engine.costs import ForwardCost
from simsd.speculative.width import WidthPolicy, tree_copies

ONE = [1, 1, 1, 1]  # one token per step (B = 4, static)


class Fixed:
    """A stand-in for the engine's ForwardCost: a fixed fit."""

    def __init__(self, a, b, rows=1):
        self.ab, self.rows = (a, b), rows

    def fit(self):
        return self.ab


def test_tree_copies_and_expected_steps_by_hand():
    # 4 MASK, depth 3, one alternative: the root, then 2 nodes at each depth while MASK remains after
    # the step (depths 1, 2: 3 and 2 left; depth 3 leaves 1): 1 + 2 + 2 + 2
    assert tree_copies(3, 1, 4, ONE) == 7
    assert tree_copies(3, 1, 3, ONE) == 5  # the third step fills the block: no copy
    assert tree_copies(0, 0, 4, ONE) == 1
    policy = WidthPolicy(4, 4, 4)
    policy.hits = [[1, 2], [1, 4], [0, 1]]  # p = 0.5, q1 = 0.25, q2 = 0
    assert policy.expected_steps(0, 0) == 1.0
    assert policy.expected_steps(2, 0) == pytest.approx(1 + 0.5 + 0.25)
    s = 0.5 + 0.5 * 0.25
    assert policy.expected_steps(2, 1) == pytest.approx(1 + s + 0.5 * s)


def test_a_cap_is_respected_and_filled():
    policy = WidthPolicy(3, 4, 4)
    for masks in (1, 2, 4):
        depth, alts = policy.shape(masks, ONE)
        assert tree_copies(depth, alts, masks, ONE) <= 3 and depth <= masks
    assert policy.shape(4, ONE) in ((2, 0), (1, 1))  # three copies: a chain of two, or one step and a sibling
    assert WidthPolicy(1, 4, 4).shape(4, ONE) == (0, 0)  # one copy: the round's own step only


def test_a_lookahead_counts_its_two_copies_within_the_cap():
    # 2 MASK: a chain of two steps finishes the block; with the lookahead it also carries the
    # finished block (the commit) and the next block: root + depth 1 + those two = 4 copies
    for cap in (2, 3, 4, 5):
        depth, alts = WidthPolicy(cap, 4, 4).shape(2, ONE, lookahead=True)
        fills = depth >= 2
        assert tree_copies(depth, alts, 2, ONE) + (2 if fills else 0) <= cap, (cap, depth, alts)
    assert WidthPolicy(4, 4, 4).shape(2, ONE, lookahead=True) == (2, 0)


def test_auto_is_wide_when_width_is_free_and_narrow_when_it_is_not():
    flat = WidthPolicy("auto", 4, 4, Fixed(0.006, 0.0))  # a GPU: the weights are read once whatever the width
    assert flat.shape(4, ONE) == (3, MAX_ALTERNATIVES)  # every alternative
    steep = WidthPolicy("auto", 4, 4, Fixed(0.001, 0.001))  # every query token costs as much as the fixed part
    assert steep.shape(4, ONE) == (0, 0)
    assert WidthPolicy("auto", 4, 4).shape(4, ONE) == (3, MAX_ALTERNATIVES)  # no fit yet: taken as flat
    # proposing costs host time per node: a slow proposer narrows the tree
    slow = WidthPolicy("auto", 4, 4, Fixed(0.006, 0.0))
    slow.proposing(0.06, 2)
    assert slow.shape(4, ONE) == (0, 0)


def test_observed_outcomes_move_the_rates():
    policy = WidthPolicy("auto", 4, 4)
    before = policy.rates()
    for _ in range(20):
        policy.observe([(0, [0, 1, 2]), (0, [0, 1, 2])], [])  # two primaries accepted, the tree ended there
    mid = policy.rates()[0]
    assert mid == pytest.approx((1 + 40) / (2 + 40)) and mid > before[0]
    for _ in range(20):
        policy.observe([], [0, 1, 2])  # the root's three candidates all failed
    p, q1, q2, *later = policy.rates()
    assert p == pytest.approx(41 / 62) and q1 < before[1] and q2 < before[2] and later == before[3:]
    policy.observe([(1, [0, 1, 2])], [])  # the primary failed, its first alternative was right
    assert policy.hits[1] == [1.6, 23.0] and policy.hits[2] == [0.4, 22.0]  # the later one was not tried
    policy.observe([(3, [0, 2, 3])], [])  # alternative 1 did not apply (one MASK): not counted as tried
    assert policy.hits[1] == [1.6, 23.0] and policy.hits[2] == [0.4, 23.0] and policy.hits[3] == [1.3, 3.0]


def test_forward_cost_fit():
    cost = ForwardCost(window=8)
    assert cost.fit() is None
    cost.samples.extend([(4, 0.010), (4, 0.010)])
    assert cost.fit() is None  # one width only
    cost.samples.extend([(8, 0.012), (16, 0.016)])
    a, b = cost.fit()
    assert a == pytest.approx(0.008) and b == pytest.approx(0.0005)
    cost.samples.clear()
    cost.samples.extend([(4, 0.010), (16, 0.009)])  # never cheaper for more tokens: b >= 0
    assert cost.fit()[1] == 0.0
    n = len(cost.samples)
    cost.stop(cost.start(torch.device("cpu")), 12, 3)  # nothing wants the timings yet: not timed
    assert len(cost.samples) == n and cost.rows == 1
    started = cost.want().start(torch.device("cpu"))
    cost.stop(started, 12, 3)
    assert cost.samples[-1][0] == 12 and cost.rows == 3


def test_speculation_width_setting():
    from simsd import LLM
    from simsd.config.engine import EngineArgs
    from simsd.speculative import SpecConfig
    assert EngineArgs(draft="self", speculation_width="3").speculation_width == 3
    for bad in (0, "wide", 2.5):
        with pytest.raises(ParamError, match="auto or an integer"):
            EngineArgs(draft="self", speculation_width=bad)
    assert EngineArgs(speculation_width=9).speculation_width == 9  # a draft model's alternatives
    with pytest.raises(ParamError, match="speculation_width"):
        SpecConfig(mode="paper", speculation_width=2)
    with pytest.raises(ParamError, match="speculation_width"):
        EngineArgs(mode="paper", speculation_width=9)  # paper mode verifies one chain
    llm = LLM(draft="self", speculation_width=2, batch_size=1, scheduler_thread=False)
    assert llm.decoder.plan.spec.speculation_width == 2
