"""How wide a self-speculative round is: which proposal tree it puts to the target (docs/design.md §4.4).

A wider verify forward proposes more and costs more; what it costs depends on the device. On a
GPU a forward of 16 query tokens costs about what one of 4 does (the weights are read once), so
the widest useful tree pays; on a CPU the time grows with the query tokens, and a wide tree can
cost more than the steps it saves. :class:`WidthPolicy` grows every round's tree best first:

* **a node's value** is the probability that it is valid (its state is the target's own step on
  its parent, and so on up to the round's block): the product, along its path, of the rate at
  which a node of its kind (the primary proposal, or the ``k``-th alternative of
  :data:`~simsd.config.speculative.ALTERNATIVES`) at its depth, in a round whose block had as
  many MASK, is its parent's target step given that the parent is valid, estimated from the
  row's own verdicts (:meth:`WidthPolicy.observe`, with a prior, :data:`PRIOR`). Siblings are
  exclusive, so these are rates of one outcome each;
* **expected steps** of a tree: the round's own step plus the value of every node with MASK
  left (a valid node is one step accepted; a node that fills the block saves nothing, because
  the target's step on its parent would have filled it in the same forward), plus, when the
  round may take the next block's first step (a *lookahead*), the value of every filled node
  that carries the block's commit and the next block (two copies each: siblings are exclusive,
  so at most one of them is the target's and the values add up);
* best first: each addition is the candidate node (a child of the tree's nodes, of a kind that
  applies) with the most value per copy; children of alternatives are grown as well as the
  primary's, so a step the primary got wrong can still be followed by accepted steps;
* **cost** of a forward of ``q`` query tokens: the engine's running fit ``t(q) = a + b q`` of
  its own forwards and their steps (:class:`simsd.engine.costs.ForwardCost`), the row's share of
  a forward over ``R`` rows being ``a / R + b q``, plus the host time the row spends proposing
  each node (:meth:`WidthPolicy.proposing`); before forwards of two widths are timed the cost
  is taken as flat.

``width`` N caps the tree at N block copies (the verify forward's query tokens over the block
length) and takes the best-first tree of that size; ``"auto"`` grows it, within
:func:`auto_copies`, while a node adds expected steps per second (the candidates' values per
copy only fall as the tree grows, so the first that does not pay ends it).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..config.speculative import MAX_ALTERNATIVES
from .tree import applies, masks_after

#: prior pseudo-counts (successes, trials) of a node of each kind (the primary proposal, then
#: :data:`~simsd.config.speculative.ALTERNATIVES` in order) being its parent's target step, the
#: same at every depth, weighted as two trials: the measured shares of the bundled target's next
#: steps predicted from one-step-old logits (46%, 9.3%, 8.7%, 4.1%, 3.9%, 2.8%), then the
#: history's predictions at the primary's positions, the skipped ones and the leftmost ones
#: (14.5%, 7.5%, 4.0%, 9.0% of their trials: the bundled target, greedy, width 64, 24 prompts of
#: the training split)
PRIOR = ((1.0, 2.0), (0.19, 2.0), (0.17, 2.0), (0.08, 2.0), (0.08, 2.0), (0.06, 2.0), (0.29, 2.0), (0.15, 2.0),
         (0.08, 2.0), (0.18, 2.0))
#: the heap's kind of a proposed step of the next block under a finish (:meth:`WidthPolicy.plan`)
AHEAD = -1
#: prior pseudo-counts (successes, trials) of such a step being the target's, given the one
#: before it was (the measurement of :data:`PRIOR`: 51% the first, 72% and 64% the second and
#: third)
AHEAD_PRIOR = (1.2, 2.0)


def auto_copies(gamma: int) -> int:
    """The most block copies of an ``"auto"`` tree without its lookahead: the root and ``1 +``
    :data:`~simsd.config.speculative.MAX_ALTERNATIVES` per proposed step (the engine sizes its
    cache margin and graphs by it, :func:`~simsd.config.speculative.max_query_blocks`)."""
    return 1 + (1 + MAX_ALTERNATIVES) * gamma


@dataclass
class TreePlan:
    """A round's tree shape, parents before children: node ``j`` is the ``kind[j]`` candidate of
    node ``parent[j]``'s step, at ``depth[j]`` (node 0: the round's block, parent -1, kind 0,
    depth 0); ``finishes``: the filled nodes that carry a lookahead, in the order they were added
    (the first one's commit copy is written by the forward); ``ahead``: per finish, how many of the
    next block's first steps, as the history predicts them, are proposed under its next block (a
    chain of copies: :class:`~simsd.speculative.self_draft.SelfExactVerifier`)."""
    parent: list
    kind: list
    depth: list
    finishes: list = field(default_factory=list)
    ahead: list = field(default_factory=list)

    @classmethod
    def chain(cls, depth: int) -> "TreePlan":
        """``depth`` primary proposals one below the other (paper mode's draft)."""
        return cls([-1] + list(range(depth)), [0] * (depth + 1), list(range(depth + 1)))


class WidthPolicy:
    """A row's choice of tree (module doc).

    Args:
        width: ``"auto"``, or the most block copies of a verify forward (an int >= 1).
        gamma: the deepest tree (proposed steps per round).
        block_length: query tokens per copy.
        cost: the target's :class:`~simsd.engine.costs.ForwardCost`, or None (flat).
    """

    def __init__(self, width, gamma: int, block_length: int, cost=None):
        self.width, self.gamma, self.L, self.cost = width, gamma, block_length, cost
        # per (the round's MASK count, depth 1..gamma), per kind: [successes, trials]
        self.hits = {}
        self.per_node = 0.0  # seconds the row spends proposing one node (running mean)

    def proposing(self, seconds: float, nodes: int) -> None:
        """A round's proposal took ``seconds`` of host time for ``nodes`` proposed nodes (on a GPU
        the launches, on a CPU the work): its share of a round's cost."""
        if nodes:
            self.per_node = seconds / nodes if not self.per_node else 0.8 * self.per_node + 0.2 * seconds / nodes

    def counts(self, masks: int, depth: int) -> list:
        """The ``[successes, trials]`` per kind of nodes at ``depth`` (1-based) in rounds whose block
        had ``masks`` MASK (how far the block is decoded changes how well old logits predict a
        step: the bundled target's next step was the primary 65% of the time with one MASK left,
        21% with three), from :data:`PRIOR`."""
        return self.hits.setdefault((masks, depth), [list(p) for p in PRIOR])

    def ahead_rate(self, depth: int) -> float:
        """The estimated rate at which the next block's step ``depth`` (1-based), as the history
        predicts it, is the target's, given that the finish and the steps before it are."""
        s, t = self.hits.setdefault(("ahead", depth), list(AHEAD_PRIOR))
        return s / t

    def observe_ahead(self, proposed: int, valid: int) -> None:
        """Count the next block's predicted steps under a finish that was the target's: ``proposed``
        of them, the first ``valid`` right (a step is tried when the one before it was right)."""
        for d in range(1, min(proposed, valid + 1) + 1):
            hit = self.hits.setdefault(("ahead", d), list(AHEAD_PRIOR))
            hit[1] += 1
            hit[0] += d <= valid

    def rates(self, masks: int, depth: int) -> list:
        """The estimated rate at which a node of each kind at ``depth`` (1-based), in a round
        whose block had ``masks`` MASK, is its parent's target step, given that the parent is
        valid."""
        return [s / t for s, t in self.counts(masks, depth)]

    def plan(self, masks: int, per_step: list, positional: bool, rows: int = 1, lookahead: bool = False,
             ngram: bool = False, ahead: int = 0) -> TreePlan:
        """The next round's tree on a block with ``masks`` MASK left (module doc): ``per_step`` the
        tokens each of the next steps reveals (the schedule's; estimates where the strategy's
        counts depend on the data); ``positional``: the strategy picks positions by confidence
        (the position alternatives apply); ``rows``: the rows sharing the forward, for the cost
        share; ``lookahead``: a filled node may carry the block's commit and the next block's
        first step (two more copies each); ``ngram``: the row's history predicts some of the block's
        MASK positions (its kinds apply); ``ahead``: the next block's first steps the history
        predicts (each, under a finish, one more copy valued at the finish's value times the rate
        of such a step at its depth, :meth:`counts` ``(AHEAD, depth)``)."""
        cap = auto_copies(self.gamma) + 2 * lookahead if self.width == "auto" else int(self.width)
        rates = [self.rates(masks, d) for d in range(1, self.gamma + 1)]
        plan = TreePlan([-1], [0], [0])
        left, value = [masks], [1.0]
        heap, order = [], 0  # candidates: (-value per copy, order, parent, kind, copies, MASK left)
        # (the next block's predicted steps: (-value, order, finish's position in finishes, AHEAD, 1, depth))

        def offer(j: int) -> None:
            nonlocal order
            d = plan.depth[j] + 1
            if left[j] == 0 or d > self.gamma:
                return
            rest = masks_after(left[j], per_step[d - 1])
            if rest == 0 and not lookahead:
                return  # a filled node saves no step without a lookahead
            for k in range(1 + MAX_ALTERNATIVES):
                if applies(k, positional, left[j], ngram) and rates[d - 1][k] > 0:
                    copies = 1 if rest else 2
                    heapq.heappush(heap, (-value[j] * rates[d - 1][k] / copies, order, j, k, copies, rest))
                    order += 1

        def offer_ahead(f: int, d: int, v: float) -> None:
            nonlocal order
            if d <= ahead:
                heapq.heappush(heap, (-v * self.ahead_rate(d), order, f, AHEAD, 1, d))
                order += 1

        offer(0)
        copies, steps = 1, 1.0
        while heap:
            gain, _, j, k, cost, rest = heapq.heappop(heap)
            if copies + cost > cap:
                continue
            if self.width == "auto" and (steps - gain * cost) / self.seconds(copies + cost, rows) <= \
                    steps / self.seconds(copies, rows) * (1 + 1e-9):
                break  # no better per second: the values per copy only fall from here
            if k == AHEAD:  # the next block's step ``rest`` under finish ``j``
                plan.ahead[j] = rest
                copies, steps = copies + 1, steps - gain
                offer_ahead(j, rest + 1, -gain)
                continue
            d = plan.depth[j] + 1
            plan.parent.append(j)
            plan.kind.append(k)
            plan.depth.append(d)
            left.append(rest)
            value.append(value[j] * rates[d - 1][k])
            copies, steps = copies + cost, steps - gain * cost
            if cost == 2:
                plan.finishes.append(len(plan.parent) - 1)
                plan.ahead.append(0)
                offer_ahead(len(plan.finishes) - 1, 1, value[-1])
            offer(len(plan.parent) - 1)
        return plan

    def chain_length(self, available: int, rows: int = 1) -> int:
        """How many of ``available`` steps the history predicts, one below the other, a round with
        nothing else to propose puts to the target (a block's first round without logits): each
        one copy, worth the product of :meth:`ahead_rate` along the chain; as many as the width
        holds, or with ``"auto"`` while one adds expected steps per second."""
        cap = auto_copies(self.gamma) if self.width == "auto" else int(self.width)
        copies, steps, value, d = 1, 1.0, 1.0, 0
        while d < available and copies < cap:
            value *= self.ahead_rate(d + 1)
            if self.width == "auto" and (steps + value) / self.seconds(copies + 1, rows) <= \
                    steps / self.seconds(copies, rows) * (1 + 1e-9):
                break
            copies, steps, d = copies + 1, steps + value, d + 1
        return d

    def rows(self) -> int:
        """Rows of the target's last forward (the share of its fixed cost), 1 without a cost."""
        return 1 if self.cost is None else self.cost.rows

    def seconds(self, copies: int, rows: int) -> float:
        """The row's share of a forward with ``copies`` block copies: ``a / rows + b q`` from the
        engine's fit; flat (1) before the engine has timed forwards of two widths."""
        fit = None if self.cost is None else self.cost.fit()
        if fit is None:
            return 1.0
        a, b = fit
        return max(a / max(rows, 1) + b * copies * self.L + self.per_node * (copies - 1), 1e-9)

    def observe(self, masks: int, parent: list, depth: list, kind: list, valid: list) -> None:
        """Count a round's outcome: ``masks`` the MASK of its block, the tree's ``parent``,
        ``depth`` and ``kind`` per node, and ``valid`` the nodes on the valid path (the root
        first). Every child of a valid node was tried: a trial of its kind at its depth, a
        success when it is valid too."""
        on_path = set(valid)
        for j in range(1, len(parent)):
            if parent[j] in on_path:
                hit = self.counts(masks, depth[j])[kind[j]]
                hit[1] += 1
                hit[0] += j in on_path
