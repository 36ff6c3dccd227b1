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

import torch

from ..decoding.noise import NoiseKey, step_noise
from .tree import ProposalTree, step_candidates
from .verifiers import ExactVerifier


class SelfDraft:
    """One row's proposals from the target's own logits (module doc).

    Args:
        cfg: the target's decoding settings (the proposals follow its strategy and schedule).
        mask_id: the MASK token id.
        gamma: the most steps a round proposes (the tree's depth).
        alternatives: siblings proposed beside each step of the chain
            (:func:`~simsd.speculative.tree.step_candidates`: the next most confident position,
            then the next most likely token); 0: a plain chain.

    ``logits``: ``(L, V)`` the kept logits (MASK made impossible), on the target's device, or
    None (a fresh block); set by :meth:`keep`, used up by :meth:`propose`.
    """

    def __init__(self, cfg, mask_id: int, gamma: int, alternatives: int = 0):
        self.cfg, self.mask_id, self.gamma, self.alternatives = cfg, mask_id, gamma, alternatives
        self.logits: torch.Tensor | None = None

    def keep(self, logits: torch.Tensor, copy: torch.Tensor) -> None:
        """Keep the logits of one verify copy: ``logits (C, L, V)`` of a verify forward's copies,
        ``copy`` a 0-d int64 device tensor (the copy whose step gave the new block); no host read."""
        self.logits = logits.index_select(0, copy.view(1))[0]

    def drop(self) -> None:
        """Forget the kept logits (the block is finished or its state moved on without them)."""
        self.logits = None

    def propose(self, block: torch.Tensor, block_step: int, masks: int, key: NoiseKey) -> ProposalTree:
        """The proposal tree of the round starting at ``block (L,)`` after ``block_step`` steps
        with ``masks`` MASK left: a chain of up to ``gamma`` steps (step ``block_step + d`` applied
        to the kept logits with that step's noise; ``key``: the row's block key), each step with
        its alternatives as siblings. Without kept logits the tree is the block alone. The
        ``dynamic`` and ``entropy`` strategies reveal data-dependent counts: the nodes' MASK counts
        are read in one host read after the tree is grown, and nodes that reveal nothing or hang
        below a full state are dropped."""
        logits, self.logits = self.logits, None
        if logits is None or masks == 0:
            return ProposalTree(block[None], [-1], [0], [masks > 0], 0)
        cfg = self.cfg
        known = cfg.strategy in ("sequential", "static")
        states, parent, depth, left = [block], [-1], [0], [masks]
        spine = 0
        for d in range(1, self.gamma + 1):
            if known and left[spine] == 0:
                break
            index = block_step + d - 1
            noise = None if cfg.sampling.greedy else step_noise([key], [index], block.shape[0], logits.shape[-1],
                                                                 logits.device)[0]
            cands = step_candidates(logits, states[spine], self.mask_id, cfg, index, noise, self.alternatives,
                                    left[spine] if known else None)
            k = min(max(1, cfg.tokens_for_step(index)), left[spine]) if known else None
            first = len(states)
            for c, st in enumerate(cands):
                states.append(st)
                parent.append(spine)
                depth.append(d)
                left.append(left[spine] - k if known else None)
            spine = first
        if not known:
            states, parent, depth, left = self._prune(states, parent, depth)
        proposed = sum(left[parent[j]] - left[j] for j in range(1, len(states)))
        return ProposalTree(torch.stack(states), parent, depth, [m > 0 for m in left], proposed)

    def _prune(self, states: list, parent: list, depth: list) -> tuple:
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
                [depth[j] for j in keep], [left[j] for j in keep])


class SelfExactVerifier(ExactVerifier):
    """Exact verification that keeps the target's logits for the row's next proposals: the
    verify step returns its copies' logits, and the last valid copy's (the one whose step is the
    new block: ``taken - 1``) go to :attr:`draft`, which proposes up to ``spec.gamma`` (default:
    the block length) steps."""

    def __init__(self, cfg, spec, mask_id: int, seed: int, alternatives: int = 0):
        super().__init__(cfg, spec, mask_id, seed)
        self.draft = SelfDraft(cfg, mask_id, spec.gamma or cfg.block_length, alternatives)

    def request(self, layouts, rnd):
        fwd = super().request(layouts, rnd)
        fwd.step.keep_logits = True
        return fwd

    def judge(self, rnd, out):
        verdict = super().judge(rnd, out)
        rank = rnd.layout[1][4]  # each node's copy (a full valid node has none: its block is done)
        self.draft.keep(out[3].view(-1, *out[3].shape[-2:]), rank.index_select(0, verdict.node.view(1))[0])
        return verdict
