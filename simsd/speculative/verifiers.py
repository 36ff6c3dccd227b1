"""The target's verification of a SimSD round, one verifier per mode (docs/design.md §4).

A verifier turns a round (the block at its start and the draft's proposal, a :class:`Round`)
into the target's verify forward (:meth:`Verifier.request`, run by :meth:`Verifier.verify`)
and what the forward returns into the round's verdict on the device (:meth:`Verifier.judge`,
no host read; the row reads the verdict once). :class:`ExactVerifier` verifies whole draft
steps, one block copy per step (exact mode, token-identical to vanilla decoding): its forward
carries the target's own step on every copy, which the engine runs batched with the other
rows' steps; :class:`PaperVerifier` verifies tokens in one ``[leftover | D | M]`` forward
(paper mode as the paper describes it: acceptance in the draft's temporal order) and
:class:`ReleaseVerifier` in the same forward as the SimSD release's code does (acceptance in
position order, a fresh draft schedule every round; ``paper_variant="release"``).

A row's verifier is ``SpeculativeDecoder.verifier_class(cfg, spec, mask_id, seed)`` (by
default :data:`VERIFIERS` of the mode): a subclass replaces a rule (``simsd bench``'s
paper-vs-exact comparison, ``bench/bench_coupling.py``'s rejection sampling on exact copies).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..decoding.config import DecodeConfig
from ..decoding.layouts import RowLayouts, exact_layout
from ..decoding.noise import ACCEPT, RESIDUAL, SAMPLE, NoiseKey, step_noise, uniform
from ..decoding.penalties import penalize_
from ..decoding.step import Step, without_mask_token_
from ..engine.batching import Fwd
from .verification import (
    accept_in_order,
    accept_in_position_order,
    paper_layout,
    revealing_copies,
    token_verdicts,
    tree_verdict,
)


@dataclass
class Round:
    """One SimSD round of a row: ``block (L,)`` at the round start on the target's device and
    ``host``, its host copy; ``step``: the block step it starts at; ``start``: the block's
    absolute position (noise keys); ``draft``: the proposal
    (:class:`~simsd.speculative.spec_row.Draft`, on the target's device); ``index``: the row's
    rounds before this one (paper mode's noise keys). ``layout``: what :meth:`Verifier.request`
    computed for :meth:`Verifier.judge`. ``lookahead``: the next block will be decoded (a
    self-speculative tree may then take its first step in this round,
    :class:`~simsd.speculative.self_draft.SelfExactVerifier`). ``history``: the row's
    :class:`~simsd.decoding.penalties.TokenHistory` before the block (None: no penalties)."""
    block: torch.Tensor
    host: list
    step: int
    start: int
    draft: object
    index: int
    layout: object = None
    lookahead: bool = False
    history: object = None


class Verdict(NamedTuple):
    """A round's decision on the device (0-d tensors but the blocks): the new ``block (L,)``,
    the block steps ``taken`` and the ``accepted`` draft tokens; exact verification also gives
    ``valid (L,)``, the deepest valid proposed state (the accepted tokens are where it differs
    from the round's block) and ``node``, its node in the round's proposal tree; a lookahead
    round (:class:`~simsd.speculative.self_draft.SelfExactVerifier`) gives ``next (L,)``, the
    next block after its first step under the proposed finished block that ``node`` is
    (``finished``: the nodes of the proposed finished blocks, the first one's commit written by
    the forward; ``next`` stands when ``node`` is one of them, else it is the first one's). With
    log-probabilities asked for (``DecodeConfig.logprobs``; None otherwise): ``logits (L, V)``,
    row ``i`` the target logits that revealed position ``i`` when it is revealed this round (MASK excluded;
    :mod:`simsd.decoding.logprobs`), and ``next_logits (L, V)``, those of ``next``. A lookahead
    round also gives ``next_taken`` (the next block's steps taken: its first, plus those of its
    steps the history predicted that were the target's), ``next_accepted`` (their tokens) and
    ``next_node`` (the deepest valid node of that finish's next-block chain)."""
    block: torch.Tensor
    taken: torch.Tensor
    accepted: torch.Tensor
    valid: torch.Tensor | None = None
    node: torch.Tensor | None = None
    next: torch.Tensor | None = None
    finished: tuple = ()
    logits: torch.Tensor | None = None
    next_logits: torch.Tensor | None = None
    next_taken: torch.Tensor | None = None
    next_accepted: torch.Tensor | None = None
    next_node: torch.Tensor | None = None


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

    def verify(self, layouts: RowLayouts, rnd: Round):
        """The round's verify forward (a generator of forward requests); returns its logits."""
        return (yield self.request(layouts, rnd))

    def draft_step(self, cfg: DecodeConfig, block_step: int, c: int, masks: int) -> tuple:
        """``(cfg, index)`` of the draft's step ``c`` of a round that starts at block step
        ``block_step`` with ``masks`` MASK left (``cfg``: the draft's settings): the block's
        schedule goes on, step ``block_step + c``."""
        return cfg, block_step + c

    def acceptance_order(self, tau: list, n: int) -> list:
        """The positions the draft proposed in a round of ``n`` steps (``tau``: host reveal
        steps), in the order they are accepted: reveal step, then position (the paper)."""
        return [i for _, i in sorted((t, i) for i, t in enumerate(tau) if t <= n)]

    def request(self, layouts: RowLayouts, rnd: Round) -> Fwd:
        """The target's verify forward of ``rnd``, laid out on the row of ``layouts``."""
        raise NotImplementedError

    def judge(self, rnd: Round, out) -> Verdict:
        """The round's verdict on the device from what the verify forward returned (its logits,
        changed in place, or its step's result)."""
        raise NotImplementedError


class ExactVerifier(Verifier):
    """Exact mode (§4.1, §4.2): the round's proposal tree (:mod:`simsd.speculative.tree`; a
    draft's chain of steps, plus the draft's final state as the bonus node) has one block copy
    per node with MASK; the copy of a node at depth ``d`` carries the target's own step ``block
    step + d`` on its state (with that step's noise: a :class:`~simsd.decoding.step.Step` over
    the copies, run by the engine), and a proposed step is accepted when it is that decision on
    its parent (:func:`~simsd.speculative.verification.tree_verdict`). A pending commit folds
    into the forward as its shared prefix. A committed token's log-probability is read from the
    copy whose step revealed it (:func:`~simsd.speculative.verification.revealing_copies`): that
    copy is the state vanilla decoding stepped from, with the same logits."""

    #: the verify step hands back its copies' logits too (self-speculation proposes from them)
    keep_logits = False

    def revealing_logits(self, logits: torch.Tensor, tree, shape, node: torch.Tensor) -> torch.Tensor | None:
        """``(L, V)``: per position, the logits of the copy (``logits (C, L, V)``) whose target step
        revealed it on the path to ``node`` (None when no log-probabilities are asked for)."""
        if self.cfg.logprobs is None:
            return None
        copy = revealing_copies(tree.states, shape, node, self.mask_id)
        return logits[copy, torch.arange(copy.shape[0], device=copy.device)]

    @staticmethod
    def tree_copies(tree, rnd: Round) -> tuple:
        """``(shape, copies (C, L), indices)`` of ``tree``'s verify copies: its constants on the
        round's device, the states of its nodes with MASK and the block step of each copy's
        target step (the round's step plus the node's depth)."""
        shape = tree.constants(rnd.block.device)
        return shape, tree.states.index_select(0, shape[0]), [rnd.step + tree.depth[j] for j in tree.copy_nodes()]

    def request(self, layouts: RowLayouts, rnd: Round) -> Fwd:
        tree = rnd.draft.tree()
        shape, copies, indices = self.tree_copies(tree, rnd)
        rnd.layout = (tree, shape, None)
        fwd = layouts.exact("target", *exact_layout(copies, rnd.start))
        fwd.step = Step(copies, indices, self.cfg, self.mask_id, self.key(rnd.start),
                        keep_logits=self.keep_logits or self.cfg.logprobs is not None, history=rnd.history)
        return fwd

    def judge(self, rnd: Round, out) -> Verdict:
        tree, shape, _ = rnd.layout
        new, taken, accepted, node, valid = tree_verdict(out[0], tree.states, shape)  # out[0]: the copies' steps
        logits = None if self.cfg.logprobs is None else self.revealing_logits(out[3], tree, shape, node)
        return Verdict(new, taken, accepted, valid, node, logits=logits)


class PaperVerifier(Verifier):
    """Paper mode (§4): the ``[leftover | D | M]`` layout with the RoPE copy and the temporal
    mask; each proposal is judged at its M slot (greedy matching or rejection sampling with
    the ``ACCEPT`` and ``RESIDUAL`` noise of the round) and accepted in the draft's temporal
    order (:func:`~simsd.speculative.verification.accept_in_order`). A pending commit runs as
    its own forward first (the layout has no place for it).

    Penalties (:mod:`simsd.decoding.penalties`) apply to each M slot's logits with the output so
    far of the state that slot sees: the leftover and the draft tokens revealed before its
    position's (``tau_j < tau_i``, the mask's M row), as the draft's own steps had them."""
    rejection_sampling = True

    def verify(self, layouts: RowLayouts, rnd: Round):
        flush = layouts.flush("target")
        if flush is not None:
            yield flush
        return (yield self.request(layouts, rnd))

    def request(self, layouts: RowLayouts, rnd: Round) -> Fwd:
        d = rnd.draft
        known = [t != self.mask_id for t in rnd.host]
        ids, positions, labels, taus, m_index = paper_layout(rnd.block, known, d.final, d.tau,
                                                             layouts.row.cached["target"], self.spec.rope_copy)
        rnd.layout = m_index
        return Fwd("target", ids, positions, labels, "paper", tau=taus)

    def slots(self, rnd: Round, logits: torch.Tensor) -> torch.Tensor:
        """``(L, V)``: each position's logits at its M slot, MASK made impossible and the
        penalties of the state the slot sees applied (class doc)."""
        at = without_mask_token_(logits.index_select(0, rnd.layout), self.mask_id)
        if rnd.history is not None:
            d = rnd.draft
            seen = torch.where(d.tau[None, :] < d.tau[:, None], d.final[None, :], rnd.block[None, :])  # (L, L)
            penalize_(at[:, None], seen, [rnd.history] * seen.shape[0], self.cfg.sampling)
        return at

    def verdicts(self, rnd: Round, at: torch.Tensor) -> tuple:
        """Per-position verdicts ``(ok (L,), replacement (L,))`` of the round's proposals from
        their M slots' logits ``at`` (:meth:`slots`): greedy matching, or rejection sampling with
        the round's ``ACCEPT`` and ``RESIDUAL`` noise."""
        d = rnd.draft
        rng = None
        if not self.cfg.sampling.greedy:
            L, V = at.shape
            u = uniform([self.key(rnd.start, ACCEPT, rnd.index)], 0, L, 1, at.device)[0, :, 0]
            rng = (u, step_noise([self.key(rnd.start, RESIDUAL, rnd.index)], 0, L, V, at.device)[0])
        return token_verdicts(at, d.final, d.probs, self.cfg.sampling, rng)

    def lp_logits(self, at: torch.Tensor) -> torch.Tensor | None:
        """The verdict's ``logits``: the M slots' (None when no log-probabilities are asked for)."""
        return None if self.cfg.logprobs is None else at

    def judge(self, rnd: Round, logits: torch.Tensor) -> Verdict:
        at = self.slots(rnd, logits)
        return self.accept(rnd, *self.verdicts(rnd, at), at)

    def accept(self, rnd: Round, ok: torch.Tensor, repl: torch.Tensor, at: torch.Tensor) -> Verdict:
        """The round's verdict from the per-position verdicts (the draft's temporal order); ``at``
        the M slots' logits (:meth:`slots`), the committed tokens' log-probabilities."""
        d = rnd.draft
        new, _, taken, acc = accept_in_order(rnd.block, d.final, d.tau, d.n, ok, repl)
        return Verdict(new, taken, acc, logits=self.lp_logits(at))


class ReleaseVerifier(PaperVerifier):
    """Paper mode as the SimSD release's code runs it (``paper_variant="release"``; the
    release's ``configs/experiments/sdar.yaml``, method ``ours``: ``greedy_match``,
    ``mrs_verify_order: position``, ``partial_block_fill: truncate``). The verify forward is
    paper mode's (the same layout, mask and positions); what differs:

    * the draft fills the rest of the block every round with a fresh schedule: its step ``c``
      reveals ``ceil(masks / (steps - c))`` tokens, ``masks`` counted before the step (the
      release's ``_denoise_block_with_cache``);
    * proposals are judged in block position order (greedy matching, or under sampling the
      release's modified rejection sampling with this round's keyed noise): the accepted
      prefix and the target's token at the first rejection are committed, the positions after
      it are drafted again next round; a round whose proposals are all accepted commits them
      and nothing more (no bonus token);
    * the block step does not advance (every round starts its own schedule).

    The release commits the known tokens as a prefix of the block, so its verification query
    is the leftover then the D and M slots of the suffix, as here.
    """

    def __init__(self, cfg: DecodeConfig, spec, mask_id: int, seed: int):
        super().__init__(cfg, spec, mask_id, seed)
        self._revealing: dict = {}  # (the draft's settings, k) -> those settings revealing k tokens a step

    def draft_step(self, cfg: DecodeConfig, block_step: int, c: int, masks: int) -> tuple:
        k = math.ceil(masks / max(cfg.steps - c, 1))
        cached = self._revealing.get(k)
        if cached is None or cached[0] is not cfg:
            cached = self._revealing[k] = (cfg, cfg.revealing(k))
        return cached[1], c

    def acceptance_order(self, tau: list, n: int) -> list:
        return [i for i, t in enumerate(tau) if t <= n]

    def accept(self, rnd: Round, ok: torch.Tensor, repl: torch.Tensor, at: torch.Tensor) -> Verdict:
        d = rnd.draft
        new, acc = accept_in_position_order(rnd.block, d.final, d.tau <= d.n, ok, repl)
        return Verdict(new, torch.zeros_like(acc), acc, logits=self.lp_logits(at))


#: the verifier of each mode
VERIFIERS = {"exact": ExactVerifier, "paper": PaperVerifier}
#: the verifier of each paper-mode variant (``SpecConfig.paper_variant``)
PAPER_VERIFIERS = {"described": PaperVerifier, "release": ReleaseVerifier}
