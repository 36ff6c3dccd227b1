"""The width of self-speculative rounds (simsd/speculative/width.py) and the engine's forward costs
(simsd/engine/costs.py): a tree's copies and expected steps by hand, the choice under a cap, under
a GPU-like flat cost and a CPU-like growing one, and the running fit."""
import pytest
import torch

from simsd.config.speculative import ALTERNATIVES, MAX_ALTERNATIVES, NGRAM
from simsd.config.vocabulary import ParamError
from simsd.engine.costs import ForwardCost
from simsd.speculative.tree import applies
from simsd.speculative.width import AHEAD_PRIOR, PRIOR, WidthPolicy, auto_copies

ONE = [1, 1, 1, 1]  # one token per step (B = 4, static)


class Fixed:
    """A stand-in for the engine's ForwardCost: a fixed fit."""

    def __init__(self, a, b, rows=1):
        self.ab, self.rows = (a, b), rows

    def fit(self):
        return self.ab


def with_rates(policy, *levels, masks=(1, 2, 3, 4)):
    """Set the policy's rates by hand for rounds of ``masks`` MASK: ``levels[d - 1]`` the per-kind
    rates at depth ``d`` (kinds not given: 0), as counts over 100 trials."""
    for m in masks:
        for d, rates in enumerate(levels, 1):
            policy.hits[(m, d)] = [[100 * r, 100] for r in list(rates) + [0.0] * (1 + MAX_ALTERNATIVES - len(rates))]
    return policy


def copies(plan, masks, per_step=ONE):
    """Block copies of a plan: the root, every node with MASK left, two for each lookahead node and
    one for each of the next block's steps proposed under it."""
    left = [masks]
    for j in range(1, len(plan.parent)):
        left.append(left[plan.parent[j]] - min(per_step[plan.depth[j] - 1], left[plan.parent[j]]))
    return 1 + sum(1 for j in range(1, len(left)) if left[j]) + 2 * len(plan.finishes) + sum(plan.ahead), left


def test_best_first_by_hand():
    # depth 1: the primary 0.5, the first alternative 0.45; depth 2: the primary 0.9. Value of a
    # node: the product of the rates on its path
    policy = with_rates(WidthPolicy(3, 4, 4), [0.5, 0.45], [0.9, 0.0], [0.9, 0.0], [0.9, 0.0])
    plan = policy.plan(4, ONE, positional=True)
    assert (plan.parent, plan.kind, plan.depth) == ([-1, 0, 0], [0, 0, 1], [0, 1, 1])  # 0.5, 0.45
    # two more copies: the primary's child (0.45) and the alternative's (0.405), before the
    # primary's grandchild (0.405, offered later)
    policy.width = 5
    plan = policy.plan(4, ONE, positional=True)
    assert (plan.parent, plan.kind, plan.depth) == ([-1, 0, 0, 1, 2], [0, 0, 1, 0, 0], [0, 1, 1, 2, 2])
    assert plan.finishes == []


def test_a_cap_is_respected_and_no_filled_node_without_a_lookahead():
    for cap in range(1, 12):
        for masks in (1, 2, 3, 4):
            plan = WidthPolicy(cap, 4, 4).plan(masks, ONE, positional=True)
            n, left = copies(plan, masks)
            assert n <= cap, (cap, masks)
            assert all(left[1:]) and plan.finishes == []  # a filled node saves no step here
            assert all(plan.parent[j] < j for j in range(1, len(plan.parent)))
    assert WidthPolicy(1, 4, 4).plan(4, ONE, positional=True).parent == [-1]  # the round's own step only


def test_a_lookahead_node_costs_two_copies_within_the_cap():
    # 1 MASK: the only useful node is one that fills the block and carries the lookahead
    assert WidthPolicy(2, 4, 4).plan(1, ONE, positional=True, lookahead=True).parent == [-1]  # 3 copies needed
    plan = WidthPolicy(3, 4, 4).plan(1, ONE, positional=True, lookahead=True)
    assert plan.parent == [-1, 0] and plan.finishes == [1] and copies(plan, 1)[0] == 3
    for cap in range(4, 14):  # 2 MASK: a step, then the filled node (with the prior, worth more than siblings)
        plan = WidthPolicy(cap, 4, 4).plan(2, ONE, positional=True, lookahead=True)
        n, left = copies(plan, 2)
        assert n <= cap and plan.finishes and all(left[f] == 0 for f in plan.finishes)
        assert [j for j in range(1, len(left)) if left[j] == 0] == plan.finishes  # each filled node carries one


def test_several_finished_blocks_each_carry_a_lookahead():
    # 1 MASK: the finishing step's candidates (the primary, the runner-up tokens) are siblings that
    # fill the block; each is worth its rate, and each takes two copies (its commit, the next block)
    policy = with_rates(WidthPolicy(7, 4, 4), [0.5, 0.0, 0.2, 0.0, 0.0, 0.1])
    plan = policy.plan(1, ONE, positional=True, lookahead=True)
    assert plan.parent == [-1, 0, 0, 0] and plan.kind == [0, 0, 2, 5] and plan.finishes == [1, 2, 3]
    assert copies(plan, 1)[0] == 7
    policy.width = 6  # the third does not fit
    assert policy.plan(1, ONE, positional=True, lookahead=True).finishes == [1, 2]
    # 2 MASK: filled nodes under both of the first step's candidates, best first
    policy = with_rates(WidthPolicy(40, 4, 4), [0.6, 0.3], [0.8, 0.0, 0.1])
    plan = policy.plan(2, ONE, positional=True, lookahead=True)
    n, left = copies(plan, 2)
    assert n <= 40 and {plan.parent[f] for f in plan.finishes} == {1, 2}
    value = {f: [0.6, 0.3][plan.kind[plan.parent[f]]] * [0.8, 0.0, 0.1][plan.kind[f]] for f in plan.finishes}
    assert [value[f] for f in plan.finishes] == sorted(value.values(), reverse=True)  # the first is written


def test_the_next_blocks_predicted_steps_under_a_finish():
    # 1 MASK, the primary finishing (0.5): its next block's first predicted step is worth
    # 0.5 x 0.6 (the prior), the second 0.18, one copy each, within the cap
    policy = with_rates(WidthPolicy(5, 4, 4), [0.5])
    plan = policy.plan(1, ONE, positional=True, lookahead=True, ahead=3)
    assert plan.finishes == [1] and plan.ahead == [2] and copies(plan, 1)[0] == 5
    policy.width = 4
    assert policy.plan(1, ONE, positional=True, lookahead=True, ahead=3).ahead == [1]
    policy.width = 9
    assert policy.plan(1, ONE, positional=True, lookahead=True, ahead=2).ahead == [2]  # as many as predicted
    assert policy.plan(1, ONE, positional=True, lookahead=True).ahead == [0]  # none predicted
    # the rate is the row's own: with a second finish (the runner-up token, 0.2: 0.1 per copy)
    # beside them, the predicted steps come first while they are right as often as the prior
    # says, the second finish once they never were
    policy = with_rates(WidthPolicy(5, 4, 4), [0.5, 0.0, 0.2])
    plan = policy.plan(1, ONE, positional=True, lookahead=True, ahead=2)
    assert (plan.finishes, plan.ahead) == ([1], [2])
    for _ in range(50):
        policy.observe_ahead(2, 0)
    s, t = AHEAD_PRIOR
    assert AHEAD_PRIOR == (1.2, 2.0) and policy.ahead_rate(1) < 0.05
    assert policy.ahead_rate(2) == s / t  # the second was never tried
    plan = policy.plan(1, ONE, positional=True, lookahead=True, ahead=2)
    assert (plan.finishes, plan.ahead) == ([1, 2], [0, 0])
    policy.observe_ahead(2, 2)
    assert policy.hits[("ahead", 2)] == [s + 1, t + 1]


def test_a_history_chain_holds_as_many_steps_as_the_width():
    # a round without logits: the block's copy and one per predicted step, at most the width
    # (whatever the rates), fewer when fewer are predicted
    policy = WidthPolicy(3, 4, 4)
    assert policy.chain_length(10) == 2 and policy.chain_length(1) == 1 and policy.chain_length(0) == 0
    policy.width = 1
    assert policy.chain_length(10) == 0


def test_kinds_that_do_not_apply_are_not_planned():
    assert [k for k in range(1 + MAX_ALTERNATIVES) if applies(k, True, 2, ngram=True)] == \
        [k for k in range(1 + MAX_ALTERNATIVES) if k == 0 or ALTERNATIVES[k - 1][0] < 2]
    assert [k for k in range(1 + MAX_ALTERNATIVES) if not applies(k, False, 4, ngram=True)] == \
        [k for k in range(1, 1 + MAX_ALTERNATIVES) if ALTERNATIVES[k - 1][0]]  # no position left out
    # the history's tokens only where the row's history predicts some of the block
    assert [k for k in range(1 + MAX_ALTERNATIVES) if applies(k, True, 4) != applies(k, True, 4, ngram=True)] == \
        [k for k in range(1, 1 + MAX_ALTERNATIVES) if ALTERNATIVES[k - 1][1] == NGRAM] != []
    plan = WidthPolicy(40, 4, 4).plan(3, ONE, positional=True)
    assert all(ALTERNATIVES[k - 1][1] != NGRAM for k in plan.kind[1:] if k)
    plan = WidthPolicy(40, 4, 4).plan(3, ONE, positional=True, ngram=True)
    assert {ALTERNATIVES[k - 1] for k in plan.kind[1:] if k} >= {(0, NGRAM), (1, NGRAM)}
    plan = WidthPolicy(40, 4, 4).plan(2, ONE, positional=False)
    assert all(not ALTERNATIVES[k - 1][0] for k in plan.kind[1:] if k)
    plan = WidthPolicy(40, 4, 4).plan(2, ONE, positional=True)
    first = [ALTERNATIVES[k - 1] if k else (0, 0) for j, k in enumerate(plan.kind) if plan.depth[j] == 1]
    second = [ALTERNATIVES[k - 1] if k else (0, 0) for j, k in enumerate(plan.kind) if plan.depth[j] == 2]
    assert (1, 0) in first and all(skip < 2 for skip, _ in first)  # 2 MASK: one position may be left out
    assert second == [] and plan.finishes == []  # a second step fills the block: no lookahead asked
    plan = WidthPolicy(40, 4, 4).plan(3, ONE, positional=True)
    assert all(ALTERNATIVES[k - 1][0] < 2 for j, k in enumerate(plan.kind) if k and plan.depth[j] == 2)  # 2 MASK


def test_auto_is_wide_when_width_is_free_and_narrow_when_it_is_not():
    flat = WidthPolicy("auto", 4, 4, Fixed(0.006, 0.0))  # a GPU: the weights are read once whatever the width
    n, _ = copies(flat.plan(4, ONE, positional=True), 4)
    assert n == auto_copies(4)  # every node the budget holds
    steep = WidthPolicy("auto", 4, 4, Fixed(0.001, 0.001))  # every query token costs as much as the fixed part
    assert steep.plan(4, ONE, positional=True).parent == [-1]
    assert copies(WidthPolicy("auto", 4, 4).plan(4, ONE, positional=True), 4)[0] == auto_copies(4)  # no fit: flat
    # proposing costs host time per node: a slow proposer narrows the tree
    slow = WidthPolicy("auto", 4, 4, Fixed(0.006, 0.0))
    slow.proposing(0.06, 2)
    assert slow.plan(4, ONE, positional=True).parent == [-1]
    # a middling cost keeps the nodes worth their copies: the most likely ones
    mid = with_rates(WidthPolicy("auto", 4, 4, Fixed(0.004, 0.00025)), [0.8, 0.1], [0.8, 0.1], [0.8], [0.8])
    plan = mid.plan(4, ONE, positional=True)
    assert plan.kind[1:] == [0] * (len(plan.kind) - 1) and len(plan.parent) >= 2


def test_observed_outcomes_move_the_rates():
    policy = WidthPolicy("auto", 4, 4)
    prior = [s / t for s, t in PRIOR]
    # a tree: root 0; its children 1 (primary), 2 (alternative 1); under 1: 3 (primary), 4 (alternative 2)
    parent, depth, kind = [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2], [0, 0, 1, 0, 2]
    for _ in range(10):
        policy.observe(3, parent, depth, kind, [0, 1, 4])  # the primary, then alternative 2 under it
    assert policy.counts(3, 1)[0] == [PRIOR[0][0] + 10, PRIOR[0][1] + 10]
    assert policy.counts(3, 1)[1] == [PRIOR[1][0], PRIOR[1][1] + 10]  # tried, failed
    assert policy.counts(3, 2)[0] == [PRIOR[0][0], PRIOR[0][1] + 10]
    assert policy.counts(3, 2)[2] == [PRIOR[2][0] + 10, PRIOR[2][1] + 10]
    policy.observe(3, parent, depth, kind, [0, 2])  # alternative 1 was right: nothing under it was tried
    assert policy.counts(3, 1)[1][0] == PRIOR[1][0] + 1 and policy.counts(3, 2)[0][1] == PRIOR[0][1] + 10
    assert policy.rates(3, 1)[0] > prior[0] and policy.rates(3, 2)[2] > prior[2]
    assert policy.rates(3, 3) == prior and policy.rates(4, 1) == prior  # never tried: the prior
    # the plan reads the rates of its round's MASK count: with 3 MASK the alternative is likelier
    policy = with_rates(WidthPolicy(2, 4, 4), [0.6, 0.1], masks=(4,))
    with_rates(policy, [0.1, 0.6], masks=(3,))
    assert policy.plan(4, ONE, positional=True).kind == [0, 0] and policy.plan(3, ONE, positional=True).kind == [0, 1]


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
