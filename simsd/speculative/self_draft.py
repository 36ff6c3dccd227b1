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

from simsd_kernels import TAU_INF

from ..decoding.noise import NoiseKey, step_noise
from ..decoding.step import denoise_step
from .verifiers import ExactVerifier


class SelfDraft:
    """One row's proposals from the target's own logits (module doc).

    Args:
        cfg: the target's decoding settings (the proposals follow its strategy and schedule).
        mask_id: the MASK token id.
        gamma: the most steps a chain proposes.

    ``logits``: ``(L, V)`` the kept logits (MASK made impossible), on the target's device, or
    None (a fresh block); set by :meth:`keep`, used up by :meth:`propose`.
    """

    def __init__(self, cfg, mask_id: int, gamma: int):
        self.cfg, self.mask_id, self.gamma = cfg, mask_id, gamma
        self.logits: torch.Tensor | None = None

    def keep(self, logits: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep the logits of the last valid copy: ``logits (C, L, V)`` of a verify forward's
        copies, ``valid`` a 0-d int64 device tensor (the copy whose step gave the new block); no
        host read."""
        self.logits = logits.index_select(0, valid.view(1))[0]

    def drop(self) -> None:
        """Forget the kept logits (the block is finished or its state moved on without them)."""
        self.logits = None

    def propose(self, block: torch.Tensor, block_step: int, masks: int, key: NoiseKey, draft_type):
        """The chain for the round starting at ``block (L,)`` after ``block_step`` steps with
        ``masks`` MASK left: up to ``gamma`` states, step ``block_step + c`` applied to the
        kept logits with that step's noise (``key``: the row's block key). Returns a
        ``draft_type`` (:class:`~simsd.speculative.spec_row.Draft`): ``states`` the block before
        each proposed step, ``final`` after the last, ``tau`` the 1-based proposed step per
        position, ``remaining`` the MASK left in ``final``. Without kept logits the chain is
        empty. The ``dynamic`` and ``entropy`` strategies reveal data-dependent counts: their
        chain's counts are read in one host read after the chain."""
        logits, self.logits = self.logits, None
        L = block.shape[0]
        tau = torch.full((L,), TAU_INF, dtype=torch.int64, device=block.device)
        if logits is None or masks == 0:
            return draft_type([], block, tau, None, masks, block)
        cfg = self.cfg
        known_counts = cfg.strategy in ("sequential", "static")
        states, state, left = [], block, masks
        steps = min(self.gamma, masks) if known_counts else self.gamma
        for c in range(steps):
            if known_counts and left == 0:
                break
            index = block_step + c
            noise = None if cfg.sampling.greedy else step_noise([key], [index], L, logits.shape[-1], logits.device)[0]
            states.append(state)
            state, revealed, _ = denoise_step(logits, state, self.mask_id, cfg, index, noise)
            tau.masked_fill_(revealed, c + 1)
            if known_counts:
                left -= min(max(1, cfg.tokens_for_step(index)), left)
        if not known_counts:  # one read: the MASK left after each proposed step
            counts = (torch.stack(states[1:] + [state]) == self.mask_id).sum(-1).tolist()
            n = next((c + 1 for c, m in enumerate(counts) if m == 0), len(counts))
            states, state, left = states[:n], (states[n] if n < len(states) else state), counts[n - 1]
            tau.masked_fill_(tau > n, TAU_INF)
        return draft_type(states, state, tau, None, left, state)


class SelfExactVerifier(ExactVerifier):
    """Exact verification that keeps the target's logits for the row's next proposals: the
    verify step returns its copies' logits, and the last valid copy's (the one whose step is the
    new block: ``taken - 1``) go to :attr:`draft`, which proposes up to ``spec.gamma`` (default:
    the block length) steps."""

    def __init__(self, cfg, spec, mask_id: int, seed: int):
        super().__init__(cfg, spec, mask_id, seed)
        self.draft = SelfDraft(cfg, mask_id, spec.gamma or cfg.block_length)

    def request(self, layouts, rnd):
        fwd = super().request(layouts, rnd)
        fwd.step.keep_logits = True
        return fwd

    def judge(self, rnd, out):
        verdict = super().judge(rnd, out)
        self.draft.keep(out[3].view(-1, *out[3].shape[-2:]), verdict.taken - 1)
        return verdict
