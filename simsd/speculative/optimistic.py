"""Optimistic drafting: bookkeeping of a draft started before the target's verdict (docs/design.md §6).

When draft and target sit on different devices, the next round's draft can run while the
target verifies: the row launches the verify forward (asynchronously), drafts from the state
the round would reach if the target **accepted every draft step** (the *assumed outcome*),
and only then reads the verdict. These pure functions decide what of that speculation is
still valid:

* :func:`assumed_outcome` — the next round's starting state under full acceptance, or None
  when it is not worth speculating (generation would end);
* :func:`keep_commit` — a speculation that crossed a block boundary committed the assumed
  block into the draft cache; it stands only if the target completed exactly that block,
  otherwise the draft cache is rolled back to ``Speculation.draft_cached``;
* :func:`reconcile` — the index ``j`` of the speculative draft's states that equals the
  actual next-round state (0: the target accepted everything; 1: in exact mode the target's
  bonus step equals the draft's first speculative step), or None: discard and draft again;
* :func:`salvage` — the speculative draft from step ``j`` on, as a proposal for the actual state.

Their host reads touch the draft's device only (speculative states and blocks live there), so
they never wait for the target's verify forward.

Decoding with speculation is token-identical to decoding without it, greedy or sampling: a
kept speculation is exactly the draft the row would have computed, since the draft's noise is
keyed by the row seed, the block position, the block step and (paper mode) the round it is
drafted for (:mod:`simsd.decoding.noise`), never by how many draws came before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from simsd_kernels import TAU_INF


@dataclass
class Speculation:
    """A draft computed from an assumed round outcome.

    ``block (L,)`` and ``block_step``: the assumed next-round state; ``draft``: the proposal
    (:class:`simsd.speculative.spec_row.Draft`) drafted from it; ``draft_cached``: the draft cache length
    before the speculation; ``committed``: the assumed finished block the speculation committed
    to the draft cache (crossing a block boundary), or None.
    """
    block: torch.Tensor
    block_step: int
    draft: object
    draft_cached: int
    committed: torch.Tensor | None = None


def assumed_outcome(draft, block_step: int, mask_id: int, block_ends_generation) -> tuple | None:
    """Next-round state ``(block, block_step, committed)`` if every draft step is accepted.

    ``draft.final (L,)`` is the block after the draft's ``n`` steps (its draft-device copy
    ``draft.final_draft`` when present, so that nothing here waits for the target's device);
    ``draft.remaining`` its MASK count (host int). A full block starts the next block (all MASK,
    step 0) after committing it (``committed`` = that block), unless
    ``block_ends_generation(block)`` (a stop id or the token limit): then None.
    """
    final = draft.final if getattr(draft, "final_draft", None) is None else draft.final_draft
    if draft.remaining:
        return final, block_step + draft.n, None
    if block_ends_generation(final):
        return None
    return torch.full_like(final, mask_id), 0, final


def _host(x) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def keep_commit(spec: Speculation, finished_block) -> bool:
    """True when the speculation's committed block equals the block the target finished
    (``finished_block``: a host list or a tensor; the committed block is read from the draft's
    device)."""
    return spec.committed is not None and spec.committed.tolist() == _host(finished_block)


def reconcile(spec: Speculation, block, block_step: int) -> int | None:
    """Index ``j`` with ``spec.draft.states[j] == block`` and ``spec.block_step + j == block_step``
    (the speculative draft's steps ``j..`` are valid proposals for the actual state), else None.
    ``block``: a host list or a tensor; the speculative state is read from the draft's device."""
    j = block_step - spec.block_step
    states = spec.draft.states
    if not 0 <= j < len(states):
        return None
    return j if states[j].tolist() == _host(block) else None


def salvage(draft, j: int):
    """The draft's steps ``j..`` as a proposal for ``draft.states[j]`` (reveal steps renumbered)."""
    tau = draft.tau
    tau = torch.where((tau <= j) | (tau == TAU_INF), torch.full_like(tau, TAU_INF), tau - j)
    return type(draft)(draft.states[j:], draft.final, tau, draft.probs, draft.remaining,
                       getattr(draft, "final_draft", None))
