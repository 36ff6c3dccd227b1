"""Proposal trees: the block states an exact round puts to the target (docs/design.md §4.1, §4.4).

A round proposes states of the block, each one denoising step after its parent: node 0 is the
round's block (a known state), node ``j > 0`` its parent's state with one proposed step applied.
A draft's chain of steps is a tree without branches (:meth:`ProposalTree.chain`); a tree may
also hold *alternatives*: siblings that propose another outcome of the same step (other
positions than the most confident, other tokens at the most confident one,
:func:`step_candidates`), so that a step the primary proposal gets wrong may still be right.

Exact verification (:func:`simsd.speculative.verification.tree_verdict`) puts one copy of every
node that still has MASK into the verify forward; the target's own step on each copy decides: a
node is valid when every node on its path is its parent's target step, and the round commits
the target's step on the deepest valid node. Sibling states differ, so at most one sibling of a
valid node is valid: the valid nodes form a path, and the output is vanilla decoding's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config.speculative import ALTERNATIVES, LEFTMOST, NGRAM
from ..decoding.sampling import filtered_probs, sample
from ..decoding.step import tokens_to_reveal, without_mask_token_
from ..decoding.strategies import select_positions
from ..engine.host_sync import to_device


@dataclass
class ProposalTree:
    """The nodes of one round (module doc).

    ``states``: ``(N, L)`` int64 on the target's device (node 0: the round's block);
    ``parent``: ``N`` host ints (-1 for the root); ``depth``: ``N`` host ints (the root 0; the
    target's step on a node is the round's step plus its depth); ``copies``: ``N`` host bools,
    the node still has MASK (one verify copy, one target step); ``proposed``: the tokens the
    proposals revealed (every node but the root), a host int or a 0-d device tensor; ``kind``:
    ``N`` host ints, a node's kind among its siblings (0: the primary proposal, ``k``: the
    ``k``-th alternative of :data:`~simsd.config.speculative.ALTERNATIVES`), or None.
    """
    states: torch.Tensor
    parent: list
    depth: list
    copies: list
    proposed: object
    kind: list | None = None
    #: the filled nodes that carry a lookahead each (the block's commit and the next block's
    #: first step, :class:`~simsd.speculative.self_draft.SelfExactVerifier`), the first one's
    #: commit written by the forward
    finishes: tuple = ()
    #: the MASK count of the round's block (a host int), or None
    masks: int | None = None
    #: per finish, how many of the next block's first steps are proposed under its next block:
    #: the first ``1 + ahead[i]`` states of ``ahead_states``
    ahead: tuple = ()
    #: host lists: the next block all MASK, then after each of its first steps as the row's
    #: history predicts them (:meth:`~simsd.speculative.self_draft.SelfDraft.ahead_chain`)
    ahead_states: list = ()

    @property
    def nodes(self) -> int:
        return len(self.parent)

    def copy_nodes(self) -> list:
        """The nodes with a verify copy, in node order."""
        return [j for j, c in enumerate(self.copies) if c]

    def tree(self) -> "ProposalTree":
        return self

    @classmethod
    def chain(cls, states: list, final: torch.Tensor, remaining: int, proposed) -> "ProposalTree":
        """A draft's chain: ``states[c]`` the block before draft step ``c`` (``states[0]`` the
        round's block), ``final`` after the last step, ``remaining`` its MASK count (a host int):
        node ``c`` is ``states[c]``, node ``n`` is ``final`` (with a copy while it has MASK)."""
        n = len(states)
        return cls(torch.stack(list(states) + [final]), [-1] + list(range(n)), list(range(n + 1)),
                   [True] * n + [remaining > 0], proposed)

    def constants(self, device) -> tuple:
        """What :func:`~simsd.speculative.verification.tree_verdict` reads of the shape, on
        ``device``: :func:`tree_constants` of this tree's shape."""
        return tree_constants(tuple(self.parent), tuple(self.depth), tuple(self.copies), torch.device(device))


@functools.lru_cache(maxsize=256)
def tree_constants(parent: tuple, depth: tuple, copies: tuple, device: torch.device) -> tuple:
    """A tree shape's constants on ``device`` (built in one copy, then kept: rounds repeat a few
    shapes, and the tensors are only read): the copy nodes ``(C,)``, the parents of nodes
    ``1..N-1``, the depths ``(N,)``, the copy flags ``(N,)``, each node's rank among the copies
    ``(N,)`` and the path matrix ``(N, N)`` (``path[j, a]``: ``a`` is on the path from the root's
    child to ``j``, ``j`` included). ``parent``, ``depth``, ``copies``: the
    :class:`ProposalTree`'s fields as tuples."""
    N = len(parent)
    copy_nodes = [j for j, c in enumerate(copies) if c]
    rank = [0] * N
    for r, j in enumerate(copy_nodes):
        rank[j] = r
    path = []
    for j in range(N):
        row, a = [0] * N, j
        while a > 0:
            row[a], a = 1, parent[a]
        path.extend(row)
    flat = copy_nodes + list(parent[1:]) + list(depth) + [int(c) for c in copies] + rank + path
    t = to_device(flat, device)
    C = len(copy_nodes)
    copy_index, parent_t, depth_t, copies_t, rank_t, path_t = t.split([C, N - 1, N, N, N, N * N])
    return copy_index, parent_t, depth_t, copies_t, rank_t, path_t.view(N, N).bool()


def applies(kind: int, positional: bool, masks: int | None, ngram: bool = False) -> bool:
    """Whether a candidate of ``kind`` exists on a state with ``masks`` MASK (None: unknown): an
    alternative that leaves ``skip`` positions out needs a positional strategy and ``skip + 1``
    MASK, one of the leftmost positions a positional strategy; one of the history's tokens needs
    its predictions (``ngram``: the round has some, :func:`step_candidates`)."""
    skip, rank = ALTERNATIVES[kind - 1] if kind else (0, 0)
    if skip == LEFTMOST:
        return positional and (rank != NGRAM or ngram)
    return (not skip or (positional and (masks is None or masks > skip))) and (rank != NGRAM or ngram)


def masks_after(masks: int, reveals: int) -> int:
    """The MASK left on a state of ``masks`` MASK after a step whose schedule reveals ``reveals``
    tokens (at least one, at most what is left)."""
    return masks - min(max(1, reveals), masks)


def step_draws(logits: torch.Tensor, mask_id: int, cfg, noise) -> tuple:
    """What every candidate of one step reads, drawn once for all the states it is applied to:
    ``(logits, tokens, conf, ent)`` with ``logits (L, V)`` (MASK made impossible in place), each
    position's token, confidence and (``entropy`` strategy) entropy under the step's ``noise``
    (its keyed draws, None when greedy)."""
    logits = without_mask_token_(logits, mask_id)
    tokens, conf, ent, _ = sample(logits, cfg.sampling, noise, with_probs=False,
                                  with_entropy=cfg.strategy == "entropy", with_confidence=True)
    return logits, tokens, conf, ent


def step_candidates(logits: torch.Tensor, state: torch.Tensor, mask_id: int, cfg, index: int, noise,
                    kinds, masks: int | None, primary: tuple | None = None, draws: tuple | None = None,
                    fill: torch.Tensor | None = None) -> tuple:
    """The outcomes of one denoising step on ``state (L,)`` from ``logits (L, V)`` (MASK made
    impossible in place) proposed as siblings, each of a *kind*: 0 the step as the strategy
    takes it (step ``index`` of the schedule, ``noise`` its keyed draws, None when greedy),
    ``k >= 1`` the ``k``-th entry ``(skip, rank)`` of
    :data:`~simsd.config.speculative.ALTERNATIVES`:

    * ``skip`` positions left out (``static``, ``dynamic``; needs ``skip + 1`` MASK, ``masks``
      the host count, None: unknown): the step's most confident revealed position and the next
      most confident ones; the strategy's choice without them (``skip``
      :data:`~simsd.config.speculative.LEFTMOST`: the leftmost MASK positions, as many as the
      step reveals);
    * the ``rank``-th next most likely token at the most confident revealed position (every
      strategy): greedy, by logit; sampling, by arrival in the exponential race under the step's
      noise (the same draw), the token already there left out;
    * (``rank`` :data:`~simsd.config.speculative.NGRAM`) at every revealed position the token
      ``fill (L,)`` predicts there (the row's history, :meth:`~simsd.speculative.ngram.NgramIndex.fill`;
      MASK: no prediction, the logits' token kept). Such a state may equal a sibling (when the
      history predicts the logits' token): it is then never the valid one of the two.

    ``kinds``: the kinds wanted, in order (those that do not apply,
    :func:`applies`, are left out). ``primary``: ``(new_state,
    revealed)`` of the step as it was taken (a draft model's step on these logits): the
    alternatives are built around it. ``draws``: :func:`step_draws` of these logits and noise
    when several states take the same step. The states differ from each other and from the
    primary whatever the logits (a left-out position, or a left-out token), so at most one
    sibling is the target's step.

    Returns ``(states, kinds)``: ``(L,)`` states on the logits' device and the kind of each, no
    host read."""
    greedy = cfg.sampling.greedy
    masked = state == mask_id
    logits, tokens, conf, ent = draws if draws is not None else step_draws(logits, mask_id, cfg, noise)
    positional = cfg.strategy in ("static", "dynamic")
    k = tokens_to_reveal(cfg, index, logits.device)
    if primary is None:
        revealed = select_positions(cfg.strategy, masked, conf, ent, k, cfg.threshold)
        primary = (torch.where(revealed, tokens, state), revealed)
    top = None
    states, out = [], []
    for kind in kinds:
        if not applies(kind, positional, masks, fill is not None):
            continue
        skip, rank = ALTERNATIVES[kind - 1] if kind else (0, 0)
        new, revealed = primary
        if skip == LEFTMOST:  # as many positions as the step reveals, the leftmost MASK ones
            revealed = masked & (masked.long().cumsum(0) <= revealed.sum())
            new = torch.where(revealed, tokens, state)
        elif skip:
            if top is None:  # the step's most confident position
                top = conf.masked_fill(~primary[1], float("-inf")).argmax().view(1)
            rest = masked.index_fill(0, top, False)
            drop = torch.cat([top, conf.masked_fill(~rest, float("-inf")).topk(skip - 1).indices])
            revealed = select_positions(cfg.strategy, rest.index_fill(0, drop, False), conf, ent, k, cfg.threshold)
            new = torch.where(revealed, tokens, state)
        if rank == NGRAM:
            new = torch.where(revealed & (fill != mask_id), fill, new)
        elif rank:
            at = conf.masked_fill(~revealed, float("-inf")).argmax().view(1)  # its most confident revealed position
            scores = logits[at[0]].float() if greedy else filtered_probs(logits[at[0]], cfg.sampling) / noise[at[0]]
            scores = scores.index_fill(0, new[at], float("-inf"))  # the token there now: not again
            new = new.index_copy(0, at, scores.topk(rank).indices[rank - 1].view(1))
        states.append(new)
        out.append(kind)
    return states, out
