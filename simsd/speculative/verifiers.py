"""The target's verification of a SimSD round, one verifier per mode (docs/design.md §4).

A verifier turns a round (the block at its start and the draft's proposal, a :class:`Round`)
into the target's verify forward (:meth:`Verifier.request`, run by :meth:`Verifier.verify`)
and what the forward returns into the round's verdict on the device (:meth:`Verifier.judge`,
no host read; the row reads the verdict once). :class:`ExactVerifier` verifies whole draft
steps, one block copy per step (exact mode, token-identical to vanilla decoding): its forward
carries the target's own step on every copy, which the engine runs batched with the other
rows' steps; :class:`PaperVerifier` verifies tokens in one ``[leftover | D | M]`` forward
(paper mode).

A row's verifier is ``SpeculativeDecoder.verifier_class(cfg, spec, mask_id, seed)`` (by
default :data:`VERIFIERS` of the mode): a subclass replaces a rule (``simsd bench``'s
paper-vs-exact comparison, ``bench/bench_coupling.py``'s rejection sampling on exact copies).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..decoding.config import DecodeConfig
from ..decoding.noise import ACCEPT, RESIDUAL, SAMPLE, NoiseKey, step_noise, uniform
from ..decoding.step import Step, without_mask_token_
from ..engine.batching import Fwd, Row
from .verification import accept_in_order, exact_layout, exact_step_verdict, paper_layout, token_verdicts


@dataclass
class Round:
    """One SimSD round of a row: ``block (L,)`` at the round start on the target's device and
    ``host``, its host copy; ``step``: the block step it starts at; ``start``: the block's
    absolute position (noise keys); ``draft``: the proposal
    (:class:`~simsd.speculative.spec_row.Draft`, on the target's device); ``index``: the row's
    rounds before this one (paper mode's noise keys). ``layout``: what :meth:`Verifier.request`
    computed for :meth:`Verifier.judge`."""
    block: torch.Tensor
    host: list
    step: int
    start: int
    draft: object
    index: int
    layout: object = None


class Verdict(NamedTuple):
    """A round's decision on the device (0-d tensors but ``block``): the new ``block (L,)``,
    the block steps ``taken`` and the ``accepted`` draft tokens."""
    block: torch.Tensor
    taken: torch.Tensor
    accepted: torch.Tensor


class Verifier:
    """The target's verification of a row's rounds (module doc).

    Args:
        cfg: the target's decoding settings (sampling, strategy, schedule).
        spec: the :class:`~simsd.speculative.decoder.SpecConfig`.
        mask_id: the MASK token id.
        seed: the row seed of the keyed noise (:mod:`simsd.decoding.noise`).
    """
    #: sampled proposals are judged token by token by rejection sampling: the draft keeps its
    #: distributions and draws fresh noise every round (``PAPER_DRAFT`` stream)
    rejection_sampling = False

    def __init__(self, cfg: DecodeConfig, spec, mask_id: int, seed: int):
        self.cfg, self.spec, self.mask_id, self.seed = cfg, spec, mask_id, seed

    def key(self, start: int, stream: int = SAMPLE, round_index: int = 0) -> NoiseKey:
        return NoiseKey(self.seed, start, stream, round_index)

    def verify(self, row: Row, rnd: Round):
        """The round's verify forward (a generator of forward requests); returns its logits."""
        return (yield self.request(row, rnd))

    def request(self, row: Row, rnd: Round) -> Fwd:
        """The target's verify forward of ``rnd`` on engine row ``row``."""
        raise NotImplementedError

    def judge(self, rnd: Round, out) -> Verdict:
        """The round's verdict on the device from what the verify forward returned (its logits,
        changed in place, or its step's result)."""
        raise NotImplementedError


class ExactVerifier(Verifier):
    """Exact mode (§4.1, §4.2): one block copy per draft step, plus a bonus copy of the draft's
    final state while it has MASK; copy ``c`` carries the target's own step ``block step + c``
    on its state (with that step's noise: a :class:`~simsd.decoding.step.Step` over the copies,
    run by the engine), and draft step ``c`` is accepted when that step is the same decision
    (:func:`~simsd.speculative.verification.exact_step_verdict`). A pending commit folds into
    the forward as its shared prefix."""

    def request(self, row: Row, rnd: Round) -> Fwd:
        d = rnd.draft
        chain = torch.stack(d.states + [d.final])  # the block before each draft step, and after the last
        verified = chain if d.remaining else chain[:-1]
        rnd.layout = chain
        fwd = row.exact("target", *exact_layout(verified, rnd.start))
        fwd.step = Step(verified, rnd.step, self.cfg, self.mask_id, self.key(rnd.start))
        return fwd

    def judge(self, rnd: Round, out) -> Verdict:
        mine = out[0]  # the target's own step on each copy
        return Verdict(*exact_step_verdict(mine, rnd.layout, rnd.draft.tau, rnd.draft.remaining > 0))


class PaperVerifier(Verifier):
    """Paper mode (§4): the ``[leftover | D | M]`` layout with the RoPE copy and the temporal
    mask; each proposal is judged at its M slot (greedy matching or rejection sampling with
    the ``ACCEPT`` and ``RESIDUAL`` noise of the round) and accepted in the draft's temporal
    order (:func:`~simsd.speculative.verification.accept_in_order`). A pending commit runs as
    its own forward first (the layout has no place for it)."""
    rejection_sampling = True

    def verify(self, row: Row, rnd: Round):
        flush = row.flush("target")
        if flush is not None:
            yield flush
        return (yield self.request(row, rnd))

    def request(self, row: Row, rnd: Round) -> Fwd:
        d = rnd.draft
        known = [t != self.mask_id for t in rnd.host]
        ids, positions, labels, taus, m_index = paper_layout(rnd.block, known, d.final, d.tau, row.cached["target"],
                                                             self.spec.rope_copy)
        rnd.layout = m_index
        return Fwd("target", ids, positions, labels, "paper", tau=taus)

    def judge(self, rnd: Round, logits: torch.Tensor) -> Verdict:
        d = rnd.draft
        at = without_mask_token_(logits.index_select(0, rnd.layout), self.mask_id)
        rng = None
        if not self.cfg.sampling.greedy:
            L, V = at.shape
            u = uniform([self.key(rnd.start, ACCEPT, rnd.index)], 0, L, 1, at.device)[0, :, 0]
            rng = (u, step_noise([self.key(rnd.start, RESIDUAL, rnd.index)], 0, L, V, at.device)[0])
        ok, repl = token_verdicts(at, d.final, d.probs, self.cfg.sampling, rng)
        new, _, taken, acc = accept_in_order(rnd.block, d.final, d.tau, d.n, ok, repl)
        return Verdict(new, taken, acc)


#: the verifier of each mode
VERIFIERS = {"exact": ExactVerifier, "paper": PaperVerifier}
