"""How wide a self-speculative round is: the proposal tree's depth and alternatives (docs/design.md §4.4).

A wider verify forward proposes more and costs more; what it costs depends on the device. On a
GPU a forward of 16 query tokens costs about what one of 4 does (the weights are read once), so
the widest useful tree pays; on a CPU the time grows with the query tokens, and a wide tree can
cost more than the steps it saves. :class:`WidthPolicy` picks, every round, the tree with the
most expected steps per second:

* **expected steps** of a tree of depth ``D`` with ``a`` alternatives beside each proposed step:
  the round's own step, plus ``sum_{d=1..D} p^(d-1) * s_a`` with ``p`` the rate at which a
  primary proposal is the target's step and ``s_a = p + (1 - p) (q_1 + (1 - q_1) q_2 ...)`` the
  rate at which one of the level's candidates is (an accepted alternative ends the path: it has
  no children), all estimated from the row's own verdicts (:meth:`WidthPolicy.observe`, with a
  weak prior);
* **cost** of a forward of ``q`` query tokens: the engine's running fit ``t(q) = a + b q`` of
  its own forwards and their steps (:class:`simsd.engine.costs.ForwardCost`), the row's share of
  a forward over ``R`` rows being ``a / R + b q``, plus the host time the row spends proposing
  each node (:meth:`WidthPolicy.proposing`); before forwards of two widths are timed the cost
  is taken as flat.

``width`` N caps the tree at N block copies (the verify forward's query tokens over the block
length) and picks the most expected steps within it; ``"auto"`` also weighs the cost.
"""
from __future__ import annotations

from ..config.speculative import MAX_ALTERNATIVES

#: prior pseudo-counts (successes, trials) of a primary proposal and of each alternative
#: (:data:`~simsd.config.speculative.ALTERNATIVES`, in order)
PRIOR = ((1.0, 2.0), (0.6, 2.0), (0.4, 2.0), (0.3, 2.0), (0.3, 2.0), (0.2, 2.0))


def tree_copies(depth: int, alternatives: int, masks: int, per_step: list) -> int:
    """Block copies of a spine-and-alternatives tree: the root (it has MASK), and at each depth
    ``d`` the primary and its alternatives while the state before the level's step leaves MASK
    after it (``per_step[d - 1]``: the tokens step ``d`` reveals; a full state has no copy)."""
    copies, left = 1, masks
    for d in range(1, depth + 1):
        left -= min(per_step[d - 1], left)
        if left > 0:
            copies += 1 + alternatives
    return copies


class WidthPolicy:
    """A row's choice of tree shape (module doc).

    Args:
        width: ``"auto"``, or the most block copies of a verify forward (an int >= 1).
        gamma: the deepest tree (proposed steps per round).
        block_length: query tokens per copy.
        cost: the target's :class:`~simsd.engine.costs.ForwardCost`, or None (flat).
    """

    def __init__(self, width, gamma: int, block_length: int, cost=None):
        self.width, self.gamma, self.L, self.cost = width, gamma, block_length, cost
        self.hits = [list(p) for p in PRIOR]  # per kind (primary, the alternatives): [successes, trials]
        self.per_node = 0.0  # seconds the row spends proposing one node (running mean)

    def proposing(self, seconds: float, nodes: int) -> None:
        """A round's proposal took ``seconds`` of host time for ``nodes`` proposed nodes (on a GPU
        the launches, on a CPU the work): its share of a round's cost."""
        if nodes:
            self.per_node = seconds / nodes if not self.per_node else 0.8 * self.per_node + 0.2 * seconds / nodes

    def rates(self) -> list:
        """The estimated success rate of a primary proposal and of each alternative (given the
        candidates before it failed)."""
        return [s / t for s, t in self.hits]

    def expected_steps(self, depth: int, alternatives: int, fills: bool = False) -> float:
        """Steps a round of this shape is expected to take: the proposed steps accepted, plus the
        target's own step on the deepest valid node, which it does not take when that node fills
        the block (``fills``: the tree's last level does)."""
        p, *q = self.rates()
        miss = 1.0 - p
        s = p
        for r in q[:alternatives]:
            s += miss * r
            miss *= 1.0 - r
        steps = 1.0 + sum(p ** (d - 1) * s for d in range(1, depth + 1))
        return steps - (p ** (depth - 1) * s if fills and depth else 0.0)

    def shape(self, masks: int, per_step: list, rows: int = 1, lookahead: bool = False) -> tuple:
        """``(depth, alternatives)`` of the next round with ``masks`` MASK left (``per_step``: the
        tokens each of the next steps reveals, from the schedule; ``rows``: the rows sharing the
        forward, for the cost share; ``lookahead``: a chain that finishes the block also carries
        its commit and the next block's first step: two more copies, and the target's step after
        the finished block is the next block's)."""
        best, best_value = (0, 0), None
        cap = None if self.width == "auto" else int(self.width)
        for depth in range(0, min(self.gamma, masks) + 1):
            for a in range(0, MAX_ALTERNATIVES + 1 if depth else 1):
                fills = sum(per_step[:depth]) >= masks
                copies = tree_copies(depth, a, masks, per_step) + (2 if fills and lookahead else 0)
                if cap is not None and copies > cap:
                    continue
                steps = self.expected_steps(depth, a, fills and not lookahead)
                value = steps if cap is not None else steps / self.seconds(copies, rows)
                if best_value is None or value > best_value * (1 + 1e-9):
                    best, best_value = (depth, a), value
        return best

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

    def observe(self, path: list, below: list) -> None:
        """Count a round's outcome: ``path`` the valid nodes below the root, in path order, each
        as ``(kind, the kinds of its level)`` (0 primary, 1.. the alternatives; the kinds before
        the valid one were tried and failed); ``below``: the kinds at the level below the deepest
        valid node (none when the tree ended there), all of which failed."""
        for kind, level in path:
            for k in level:
                if k <= kind:
                    self.hits[k][1] += 1
            self.hits[kind][0] += 1
        for k in below:
            self.hits[k][1] += 1
