"""Self-speculation: the target proposes its own next steps (``draft="self"``; docs/design.md §4.4).

No draft model. Every exact verify forward of a row carries its state and a chain of proposed
states; the target's step on each copy is computed there anyway (:class:`~simsd.speculative.verifiers.ExactVerifier`),
and its logits are kept (``Step(keep_logits=True)``). After the verdict the logits of the last
*valid* copy -- the copy whose step produced the new block -- are the freshest the target has
of this block, one step old: :class:`SelfDraft` proposes the next round's chain from them, each
proposed step drawn as the strategy would draw that step (its schedule entry, its keyed noise:
:func:`simsd.decoding.step.denoise_step` on the same logits, step after step). Exact
verification then accepts a proposed step only if it is the target's own decision at that
state, so the output is vanilla decoding's whatever the proposals (the SimSD paper's
self-speculative setting, where reference tokens come from "previously decoded trajectories").

A block's first round has nothing to propose from (the chain is empty: one copy, a plain target
step); from its second round on each forward decides its own step plus every proposed step
that was right.
"""
from __future__ import annotations

import time

import torch

from simsd_kernels import KIND_KNOWN, TAU_INF

from ..decoding.noise import NoiseKey, step_noise
from ..decoding.sampling import filtered_probs
from ..decoding.step import Step, without_mask_token_
from .tree import ProposalTree, step_candidates
from .verification import exact_layout, tree_verdict
from .verifiers import ExactVerifier, PaperVerifier, Verdict
from .width import WidthPolicy


class SelfDraft:
    """One row's proposals from the target's own logits (module doc).

    Args:
        cfg: the target's decoding settings (the proposals follow its strategy and schedule).
        mask_id: the MASK token id.
        gamma: the most steps a round proposes (the tree's depth).
        width: ``speculation_width``, ``"auto"`` or the most block copies of a verify forward:
            each round's depth and alternatives (siblings beside each proposed step,
            :func:`~simsd.speculative.tree.step_candidates`) are :class:`~simsd.speculative.width.WidthPolicy`'s
            choice.
        alternatives: a fixed shape instead (depth ``gamma``, this many alternatives), for tests.

    ``logits``: ``(L, V)`` the kept logits (MASK made impossible), on the target's device, or
    None (a fresh block); set by :meth:`keep`, used up by :meth:`propose`. ``policy``: the
    :class:`~simsd.speculative.width.WidthPolicy` (its ``cost`` set by the row: the engine's).
    """

    def __init__(self, cfg, mask_id: int, gamma: int, width="auto", alternatives: int | None = None):
        self.cfg, self.mask_id, self.gamma, self.alternatives = cfg, mask_id, gamma, alternatives
        self.policy = WidthPolicy(width, gamma, cfg.block_length)
        self.logits: torch.Tensor | None = None

    def keep(self, logits: torch.Tensor, copy: torch.Tensor) -> None:
        """Keep the logits of one verify copy: ``logits (C, L, V)`` of a verify forward's copies,
        ``copy`` a 0-d int64 device tensor (the copy whose step gave the new block); no host read."""
        self.logits = logits.index_select(0, copy.view(1))[0]

    def drop(self) -> None:
        """Forget the kept logits (the block is finished or its state moved on without them)."""
        self.logits = None

    def propose(self, block: torch.Tensor, block_step: int, masks: int, key: NoiseKey,
                lookahead: bool = False) -> ProposalTree:
        """The proposal tree of the round starting at ``block (L,)`` after ``block_step`` steps
        with ``masks`` MASK left: a chain of up to ``gamma`` steps (step ``block_step + d`` applied
        to the kept logits with that step's noise; ``key``: the row's block key), each step with
        its alternatives as siblings, the shape chosen by :attr:`policy` (``lookahead``: a chain
        that finishes the block also takes the next block's first step, two more copies). Without kept logits the
        tree is the block alone. The ``dynamic`` and ``entropy`` strategies reveal data-dependent
        counts: the nodes' MASK counts are read in one host read after the tree is grown, and
        nodes that reveal nothing or hang below a full state are dropped."""
        logits, self.logits = self.logits, None
        if logits is None or masks == 0:
            return ProposalTree(block[None], [-1], [0], [masks > 0], 0, [0])
        per_step = self.per_step(block_step)
        if self.alternatives is None:
            depth, alternatives = self.policy.shape(masks, per_step, self.policy.rows(), lookahead)
        else:
            depth, alternatives = self.gamma, self.alternatives
        started = time.perf_counter()
        tree = self._grow(logits, block, block_step, masks, key, depth, alternatives, per_step)
        self.policy.proposing(time.perf_counter() - started, tree.nodes - 1)
        return tree

    def chain(self, block: torch.Tensor, block_step: int, masks: int, key: NoiseKey, draft_type, with_probs: bool):
        """Paper mode's proposal: a chain of up to ``gamma`` steps from the kept logits (the
        paper's layout verifies one chain) as a ``draft_type`` (:class:`~simsd.speculative.spec_row.Draft`:
        the states before each step, the final state, the reveal steps and, for rejection
        sampling (``with_probs``), the distribution each token was drawn from: the kept logits'
        filtered one), or None without kept logits (the row takes a target step first)."""
        logits, self.logits = self.logits, None
        if logits is None or masks == 0:
            return None
        tree = self._grow(logits, block, block_step, masks, key, self.gamma, 0, self.per_step(block_step))
        states = list(tree.states.unbind(0))
        tau = torch.full_like(block, TAU_INF)
        for c in range(1, len(states)):
            tau.masked_fill_(states[c] != states[c - 1], c)
        probs = filtered_probs(logits, self.cfg.sampling) if with_probs else None
        return draft_type(states[:-1], states[-1], tau, probs, masks - tree.proposed, states[-1])

    def per_step(self, block_step: int) -> list:
        """Tokens each of the next ``gamma`` steps reveals (the schedule's; 1 where the strategy's
        counts depend on the data)."""
        known = self.cfg.strategy in ("sequential", "static")
        return [self.cfg.tokens_for_step(block_step + d) if known else 1 for d in range(self.gamma)]

    def _grow(self, logits, block, block_step: int, masks: int, key: NoiseKey, depth: int, alternatives: int,
              per_step: list) -> ProposalTree:
        cfg = self.cfg
        known = cfg.strategy in ("sequential", "static")
        states, parent, depths, left, kind = [block], [-1], [0], [masks], [0]
        spine = 0
        for d in range(1, depth + 1):
            if known and left[spine] == 0:
                break
            index = block_step + d - 1
            noise = None if cfg.sampling.greedy else step_noise([key], [index], block.shape[0], logits.shape[-1],
                                                                 logits.device)[0]
            cands, kinds = step_candidates(logits, states[spine], self.mask_id, cfg, index, noise, alternatives,
                                           left[spine] if known else None)
            k = min(max(1, per_step[d - 1]), left[spine]) if known else None
            first = len(states)
            for c, st in zip(kinds, cands):
                states.append(st)
                parent.append(spine)
                depths.append(d)
                left.append(left[spine] - k if known else None)
                kind.append(c)
            spine = first
        if not known:
            states, parent, depths, left, kind = self._prune(states, parent, depths, kind)
        proposed = sum(left[parent[j]] - left[j] for j in range(1, len(states)))
        return ProposalTree(torch.stack(states), parent, depths, [m > 0 for m in left], proposed, kind)

    def _prune(self, states: list, parent: list, depth: list, kind: list) -> tuple:
        """The nodes whose step revealed something and whose parent had MASK, from one host read
        of every node's MASK count (renumbered, parents kept before children)."""
        left = (torch.stack(states) == self.mask_id).sum(-1).tolist()
        keep, new_index = [0], {0: 0}
        for j in range(1, len(states)):
            p = parent[j]
            if p in new_index and left[p] > 0 and left[j] < left[p]:
                new_index[j] = len(keep)
                keep.append(j)
        return ([states[j] for j in keep], [-1] + [new_index[parent[j]] for j in keep[1:]],
                [depth[j] for j in keep], [left[j] for j in keep], [kind[j] for j in keep])

    def observe(self, tree: ProposalTree, node: int) -> None:
        """Count a round's outcome for the width policy: ``node`` the deepest valid node of
        ``tree`` (read with the decision)."""
        def level(j: int) -> list:  # the kinds of the children of j
            return [tree.kind[c] for c in range(tree.nodes) if tree.parent[c] == j]
        path, j = [], node
        while j > 0:
            path.append((tree.kind[j], level(tree.parent[j])))
            j = tree.parent[j]
        self.policy.observe(path[::-1], level(node))


class SelfExactVerifier(ExactVerifier):
    """Exact verification that keeps the target's logits for the row's next proposals: the
    verify step returns its copies' logits, and the deepest valid node's copy's go to
    :attr:`draft`, which proposes up to ``spec.gamma`` (default: the block length) steps.

    **Lookahead** (``rnd.lookahead``: the next block will be decoded): when the tree's chain of
    primary proposals ends in a finished block ``F``, the forward also carries ``F`` as the
    block's commit (written to the cache, seeing the cache and itself) and the next block, all
    MASK, at the next positions, seeing the cache, ``F`` (its ancestor in the tree mask, as the
    cache would hold it) and itself: its target step is the next block's first step, its logits
    the next block's first proposals. Its noise is the next block's. When ``F`` is the deepest
    valid node the block is finished and committed by this forward; otherwise the row rolls
    the written ``F`` back (:class:`~simsd.speculative.spec_row.SpecRow`)."""

    def __init__(self, cfg, spec, mask_id: int, seed: int, alternatives: int | None = None):
        super().__init__(cfg, spec, mask_id, seed)
        self.draft = SelfDraft(cfg, mask_id, spec.gamma or cfg.block_length, spec.speculation_width, alternatives)

    @staticmethod
    def finished_leaf(tree: ProposalTree) -> int | None:
        """The node that ends the chain of primary proposals when it finishes the block, else None."""
        j, last = 0, None
        while True:
            children = [c for c in range(tree.nodes) if tree.parent[c] == j and (tree.kind or [0] * tree.nodes)[c] == 0]
            if not children:
                break
            j = last = children[0]
        return last if last is not None and not tree.copies[last] else None

    keep_logits = True

    def request(self, layouts, rnd):
        tree = rnd.draft.tree()
        leaf = self.finished_leaf(tree) if rnd.lookahead else None
        if leaf is None:
            return super().request(layouts, rnd)
        shape, copies, indices = self.tree_copies(tree, rnd)
        rnd.layout = (tree, shape, leaf)
        ids, positions, labels = exact_layout(copies, rnd.start)
        keys = [self.key(rnd.start)] * len(indices)
        L, C = copies.shape[1], copies.shape[0]
        nxt = torch.full((L,), self.mask_id, dtype=copies.dtype, device=copies.device)
        ids = torch.cat([tree.states[leaf], ids, nxt])
        positions = list(range(rnd.start, rnd.start + L)) + list(positions) + list(range(rnd.start + L,
                                                                                          rnd.start + 2 * L))
        labels = [(KIND_KNOWN, C + 1, C)] * L + list(labels) + [(KIND_KNOWN, 0, C + 1)] * L  # F: grp C, sees
        fwd = layouts.exact("target", ids, positions, labels, write=L)  # grp C + 1 (its subtree); next: C + 1
        fwd.step = Step(torch.cat([copies, nxt[None]]), indices + [0], self.cfg, self.mask_id,
                        keys + [self.key(rnd.start + L)], keep_logits=True)
        return fwd

    def judge(self, rnd, out):
        tree, shape, leaf = rnd.layout
        mine, logits = out[0], out[3].view(-1, *out[3].shape[-2:])
        C = shape[0].shape[0]
        new, taken, accepted, node, valid = tree_verdict(mine[:C], tree.states, shape)
        copy = shape[4].index_select(0, node.view(1))[0]  # the valid node's copy (a finished one has none)
        lp = self.revealing_logits(logits[:C], tree, shape, node)
        if leaf is None:
            self.draft.keep(logits, copy)
            return Verdict(new, taken, accepted, valid, node, logits=lp)
        self.draft.keep(logits, torch.where(node == leaf, C, copy))  # finished as proposed: the next block's
        return Verdict(new, taken, accepted, valid, node, mine[C], leaf, lp, None if lp is None else logits[C])


class SelfPaperVerifier(PaperVerifier):
    """Paper mode with the target's previous predictions as the draft (the SimSD paper's
    self-speculative setting): a round verifies a chain proposed from the kept logits
    (:meth:`SelfDraft.chain`) in the paper's ``[leftover | D | M]`` layout, and keeps its M slots'
    logits (each position's prediction in the round's context) for the next round. A block's
    first round has nothing to propose from: the row takes a target step that keeps its logits
    (:meth:`~simsd.speculative.spec_row.SpecRow.self_step`)."""

    def __init__(self, cfg, spec, mask_id: int, seed: int, alternatives: int | None = None):
        super().__init__(cfg, spec, mask_id, seed)
        self.draft = SelfDraft(cfg, mask_id, spec.gamma or cfg.block_length, spec.speculation_width, 0)

    def judge(self, rnd, logits):
        verdict = super().judge(rnd, logits)
        self.draft.logits = without_mask_token_(logits.index_select(0, rnd.layout), self.mask_id)
        return verdict
