"""One request's SimSD rounds (draft, verify, accept, commit) as a :mod:`simsd.engine.batching` program.

See :mod:`simsd.speculative` for the modes and :mod:`simsd.speculative.optimistic` for speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from simsd_kernels import TAU_INF

from ..decoding.noise import ACCEPT, PAPER_DRAFT, RESIDUAL, SAMPLE, NoiseKey, uniform
from ..decoding.step import Step, denoise_step, step_noise, without_mask_token
from ..decoding.vanilla import new_block
from ..engine.batching import Fwd, Row
from .optimistic import Speculation, assumed_outcome, keep_commit, reconcile, salvage
from .verification import accept_in_order, exact_layout, exact_step_verdict, paper_layout, token_verdicts


class Stats:
    """A row's verification counters (README, "Statistics"):

    * ``proposed``: draft tokens put to the target, i.e. every token the draft revealed in every
      verified draft step, rejected steps included;
    * ``accepted``: the proposed tokens the target accepted; ``acceptance_rate`` = accepted /
      proposed (the field's definition);
    * ``target_tokens``: tokens the target chose itself (the correction at a rejection, its own
      steps in exact mode, fallback steps). ``accepted + target_tokens`` = every token decoded,
      the returned ones and those cut after a stop or the token budget;
    * ``rounds``, ``accepted_per_round`` = accepted / rounds, ``fallback_steps``, ``speculations``
      (optimistic drafts started), ``speculations_kept``.

    ``origins`` records, per decoded token, whether it came from the draft (True) or the
    target (False), so that the decoder can count the draft's share of the returned tokens.
    """

    def __init__(self):
        self.proposed = self.accepted = self.rounds = 0
        self.target_tokens = 0
        self.fallback_steps = 0
        self.speculations = self.speculations_kept = 0
        self.origins: list = []

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "target_tokens": self.target_tokens, "rounds": self.rounds,
                "accepted_per_round": self.accepted / self.rounds if self.rounds else 0.0,
                "fallback_steps": self.fallback_steps, "speculations": self.speculations,
                "speculations_kept": self.speculations_kept}


@dataclass
class Draft:
    """One draft proposal, on the draft's device until :meth:`to` moves it.

    ``states[c] (L,)``: the block before draft step ``c`` (``c = 0..n-1``); ``final (L,)``: after
    the ``n`` steps; ``tau (L,)`` int64: 1-based reveal step, ``TAU_INF`` where not revealed;
    ``probs (L, V)``: the draft's sampling distribution at each position's reveal step (paper
    mode's rejection sampling; None when greedy and in exact mode); ``remaining``: MASK positions
    left in ``final`` (a host int, known without reading the device for the schedule strategies).
    """
    states: list
    final: torch.Tensor
    tau: torch.Tensor
    probs: torch.Tensor | None
    remaining: int
    #: ``final`` on the draft's device: reading it never waits for the target's device
    final_draft: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return len(self.states)

    def to(self, device) -> "Draft":
        probs = None if self.probs is None else self.probs.to(device)
        return Draft([s.to(device) for s in self.states], self.final.to(device), self.tau.to(device), probs,
                     self.remaining, self.final_draft)


class SpecRow:
    """One request's SimSD rounds as a :mod:`simsd.engine.batching` program: its seed, its
    counters, and the draft / verify / commit logic. Methods that run forwards are generators
    (``yield`` a :class:`Fwd`, receive the logits).

    Noise (:mod:`simsd.decoding.noise`, row seed ``seed``): every sampling step at block step
    ``s`` of the block at absolute position ``start`` uses ``NoiseKey(seed, start)`` and ``s``
    -- the target's steps (fallback, exact verification) and, in exact mode, the draft's too, so
    exact mode commits what vanilla decoding with the same seed commits and the draft agrees
    with the target whenever the coupled draws agree. Paper mode's draft samples from the
    ``PAPER_DRAFT`` stream keyed by the round as well (fresh noise for every round's proposal,
    as rejection sampling needs), its acceptance test and residual draws from ``ACCEPT`` and
    ``RESIDUAL``.

    Host reads: one per round, the accept decision (new block and counters, see
    :meth:`decide`); the ``dynamic`` and ``entropy`` draft strategies add one per draft step
    (how many positions are still masked: their reveal counts depend on the data); a fallback
    target step reads its new block. Everything else stays on the devices.
    """

    def __init__(self, dec, row: Row, seed: int, optimistic: bool = False, stop_ids=None):
        self.dec, self.row, self.seed = dec, row, seed
        #: generation ends after a block that holds one of these (default: the target's stop ids)
        self.stop_ids = list(dec.t.stop_ids if stop_ids is None else stop_ids)
        self.cfg, self.mask_id = dec.cfg, dec.mask_id
        self.optimistic = optimistic
        self.round_index = 0  # rounds verified so far (keys paper mode's noise)
        self.stats = Stats()

    def key(self, start: int, stream: int = SAMPLE, round_index: int = 0) -> NoiseKey:
        return NoiseKey(self.seed, start, stream, round_index)

    @property
    def rejection_sampling(self) -> bool:
        """Whether sampled proposals are judged token by token by rejection sampling (paper
        mode): then the draft keeps its distributions and needs fresh noise every round."""
        return self.dec.spec.mode == "paper"

    def draft_key(self, start: int, round_index: int) -> NoiseKey:
        """The draft's noise key: the target's (exact mode: coupled draws) or, for rejection
        sampling, a stream of its own that is fresh every round."""
        if not self.rejection_sampling:
            return self.key(start)
        return self.key(start, PAPER_DRAFT, round_index)

    # -- draft ---------------------------------------------------------------------------
    def propose(self, block: torch.Tensor, block_step: int, masks: int, start: int, round_index: int):
        """Draft up to gamma steps from ``block`` (``masks`` MASK positions), the block at
        absolute position ``start`` after ``block_step`` steps, for round ``round_index``;
        returns a :class:`Draft`. Draft step ``c`` is block step ``block_step + c`` (its noise key)."""
        dev = self.row.devices["draft"]
        dcfg = self.dec.draft_cfg
        state = block.to(dev)
        L = state.shape[0]
        tau = torch.full((L,), TAU_INF, dtype=torch.int64, device=dev)
        key = self.draft_key(start, round_index)
        keep_probs = not dcfg.sampling.greedy and self.rejection_sampling
        probs = torch.zeros(L, self.dec.d.config.vocab_size, device=dev) if keep_probs else None
        states = []
        counts_known = dcfg.strategy in ("sequential", "static")
        for c in range(self.dec.gamma):
            if masks == 0:
                break
            states.append(state)
            state, revealed, p = yield self.row.denoise(
                "draft", state, Step(state, block_step + c, dcfg, self.mask_id, key))
            tau = torch.where(revealed, c + 1, tau)
            if probs is not None:
                probs = torch.where(revealed[:, None], p.to(probs.dtype), probs)
            if counts_known:
                masks -= min(max(1, dcfg.tokens_for_step(block_step + c)), masks)
            else:
                masks = int((state == self.mask_id).sum())  # data-dependent reveal count
        return Draft(states, state, tau, probs, masks, state)

    # -- target verification -------------------------------------------------------------
    def exact_request(self, draft: Draft) -> Fwd:
        """The exact verify forward: one copy per draft step, plus a bonus copy of the draft's
        final state when it still has MASK."""
        states = list(draft.states)
        if draft.remaining:
            states.append(draft.final)
        return self.row.exact("target", *exact_layout(states, self.row.start("target")))

    def judge_exact(self, draft: Draft, logits: torch.Tensor, block_step: int, start: int):
        """``(new_block, steps_taken, accepted, proposed)`` from the exact verify logits, as
        device tensors (the decision, read by :meth:`decide`): copy ``c`` gets the target's own
        step ``block_step + c`` on its state, with that step's noise, and the draft's step is
        accepted when it is the same decision (:func:`exact_step_verdict`)."""
        bonus = draft.remaining > 0
        states = torch.stack(draft.states)
        verified = torch.cat([states, draft.final[None]]) if bonus else states
        C, L = verified.shape
        logits = logits.view(C, L, -1)
        steps = block_step + torch.arange(C, device=logits.device)
        noise = None
        if not self.cfg.sampling.greedy:
            noise = step_noise([self.key(start)] * C, [block_step + c for c in range(C)], L, logits.shape[-1],
                               logits.device)
        mine, _, _ = denoise_step(logits, verified, self.mask_id, self.cfg, steps, noise)
        return exact_step_verdict(mine, states, draft.final, draft.tau, bonus)

    def paper_request(self, block: torch.Tensor, block_host: list, draft: Draft):
        """The paper verify forward ``[leftover | D | M]`` and ``m_index`` (see :func:`paper_layout`)."""
        known = [t != self.mask_id for t in block_host]
        start = self.row.cached["target"]
        ids, pos, lab, m_index = paper_layout(block, known, draft.final, draft.tau, start,
                                              self.mask_id, self.dec.spec.rope_copy)
        return Fwd("target", ids[0], pos[0], lab[0], "paper"), m_index

    def judge_paper(self, block: torch.Tensor, draft: Draft, logits: torch.Tensor, m_index, start: int):
        """``(new_block, steps_taken, accepted, proposed)`` from the paper verify logits (each
        proposal judged at its M slot), as device tensors."""
        at = without_mask_token(logits[m_index.clamp_min(0)], self.mask_id)
        rng = None
        if not self.cfg.sampling.greedy:
            L, V = at.shape
            r = self.round_index
            u = uniform([self.key(start, ACCEPT, r)], 0, L, 1, at.device)[0, :, 0]
            rng = (u, step_noise([self.key(start, RESIDUAL, r)], 0, L, V, at.device)[0])
        ok, repl = token_verdicts(at, draft.final, draft.probs, self.cfg.sampling, rng)
        new, _, taken, acc, prop = accept_in_order(block, draft.final, draft.tau, draft.n, ok, repl)
        return new, taken, acc, prop

    def decide(self, verdict, draft: Draft, before: list) -> tuple:
        """Read a round's decision on the host, in one transfer (the new block, the draft's
        reveal steps, steps taken, accepted count): ``(block, block_host, taken)`` with
        ``block`` the device tensor and ``block_host`` its list. The counters go to ``stats``;
        ``before``: the block at the round start (host list).

        Accepted proposals are the first ``accepted`` ones in the draft's temporal order (reveal
        step, then position), in every mode; the other positions revealed this round are the
        target's."""
        new, taken, acc, _ = verdict
        L = new.shape[0]
        host = torch.cat([new, draft.tau.to(new.dtype), torch.stack([taken, acc]).to(new.dtype)]).tolist()
        block_host, tau, taken, acc = host[:L], host[L:2 * L], host[2 * L], host[2 * L + 1]
        proposals = sorted((t, i) for i, t in enumerate(tau) if t <= draft.n)
        self.stats.proposed += len(proposals)
        self.stats.accepted += acc
        self.mark(before, block_host, {i for _, i in proposals[:acc]})
        return new, block_host, taken

    def mark(self, before: list, after: list, from_draft=frozenset()) -> None:
        """Record who chose the positions revealed between ``before`` and ``after``."""
        for i, (a, b) in enumerate(zip(before, after)):
            if a == self.mask_id and b != self.mask_id:
                self.origin[i] = i in from_draft
                self.stats.target_tokens += i not in from_draft

    def compare_with_exact(self, draft: Draft, paper_logits, m_index):
        """Diagnostics (``simsd bench``): paper vs exact verification distributions, untimed and
        not counted as a target forward."""
        ids, pos, lab = exact_layout(draft.states, self.row.cached["target"])
        exact = (yield Fwd("target", ids[0], pos[0], lab[0], "exact", count=False))
        exact = exact.view(draft.n, draft.final.shape[0], -1)
        diag = self.dec.diagnostics
        for p in torch.nonzero(draft.tau <= draft.n).flatten().tolist():
            e = torch.log_softmax(without_mask_token(exact[int(draft.tau[p]) - 1, p], self.mask_id).double(), -1)
            a = torch.log_softmax(without_mask_token(paper_logits[int(m_index[p])], self.mask_id).double(), -1)
            diag["agree"] += int(e.argmax() == a.argmax())
            diag["kl"] += float((e.exp() * (e - a)).nan_to_num().sum())
            diag["total"] += 1

    # -- main loop -----------------------------------------------------------------------
    def check_progress(self, block_host: list, masks: int, block_step: int) -> None:
        """A round (or a fallback step) commits at least one token; raise instead of looping
        when it did not (checked on the host copy already read, no extra read)."""
        if block_host.count(self.mask_id) >= masks:
            raise RuntimeError(f"row {self.row.index}: the {self.dec.spec.mode} round at block step {block_step} "
                               f"committed no token ({masks} MASK left): decoding would not progress")

    def target_step(self, block: torch.Tensor, block_step: int, start: int):
        """One vanilla target step (fallback); returns ``(block, block_host)`` (one host read)."""
        block, _, _ = yield self.row.denoise("target", block,
                                             Step(block, block_step, self.cfg, self.mask_id, self.key(start)))
        self.stats.fallback_steps += 1
        return block, block.tolist()

    def speculate(self, draft: Draft, block_step: int, ends, start: int):
        """Draft the next round from the assumed outcome of this one (see :mod:`simsd.speculative.optimistic`);
        returns a :class:`Speculation` or None. Its noise keys are those of the round it is for,
        so a kept speculation is exactly the draft that round would compute."""
        out = assumed_outcome(draft, block_step, self.mask_id, ends)
        if out is None:
            return None
        block, step, committed = out
        cached = self.row.cached["draft"]
        if committed is not None:
            yield self.row.commit("draft", committed.to(self.row.devices["draft"]))
        masks = draft.remaining if committed is None else block.shape[0]
        next_start = start if committed is None else start + block.shape[0]
        proposal = yield from self.propose(block, step, masks, next_start, self.round_index + 1)
        self.stats.speculations += 1
        return Speculation(block, step, proposal, cached, committed)

    def take(self, spec: Speculation | None, block_host: list, block_step: int, device) -> Draft | None:
        """The part of a speculation that is valid for the actual round start, if any."""
        if spec is None:
            return None
        j = reconcile(spec, block_host, block_step)
        if j is None:
            return None
        self.stats.speculations_kept += 1
        return salvage(spec.draft, j).to(device)

    def program(self, tail: list, on_block=None):
        """The row's decoding; returns ``(generated, blocks)``.

        With ``optimistic``, the next round's draft runs between launching the verify forward
        and reading its decision (on another device it overlaps the target's forward).
        ``on_block(new_ids) -> bool``: see :func:`simsd.decoding.vanilla.vanilla_program`.
        """
        cfg, spec, dec = self.cfg, self.dec.spec, self.dec
        B = cfg.block_length
        stops = set(self.stop_ids)
        generated: list = []
        blocks = 0
        device = self.row.devices["target"]
        carried = None  # a Speculation for the next round
        while True:
            block_host = list(tail) + [self.mask_id] * (B - len(tail))
            self.origin = [None] * B  # per position: True = from the draft, False = the target's
            block = new_block(tail, B, self.mask_id, device)
            start = self.row.start("target")  # absolute position of the block (noise keys)
            first_gen, tail, block_step = len(tail), [], 0

            def ends(full: torch.Tensor) -> bool:
                new = full[first_gen:].tolist()
                return bool(stops.intersection(new)) or len(generated) + len(new) >= cfg.max_new_tokens

            while self.mask_id in block_host:
                masks = block_host.count(self.mask_id)
                if spec.on_reject == "fallback" and masks < dec.gamma:
                    carried = None
                    before = block_host
                    block, block_host = yield from self.target_step(block, block_step, start)
                    self.mark(before, block_host)
                    self.check_progress(block_host, masks, block_step)
                    block_step += 1
                    continue
                draft = self.take(carried, block_host, block_step, device)
                carried = None
                if draft is None:
                    draft = (yield from self.propose(block, block_step, masks, start, self.round_index)).to(device)
                self.stats.rounds += 1
                if spec.mode == "exact":
                    logits = yield self.exact_request(draft)
                else:
                    flush = self.row.flush("target")  # the paper layout has no place for it
                    if flush is not None:
                        yield flush
                    fwd, m_index = self.paper_request(block, block_host, draft)
                    logits = yield fwd
                    if self.dec.diagnostics is not None:
                        yield from self.compare_with_exact(draft, logits, m_index)
                if self.optimistic:  # before the decision is read
                    carried = yield from self.speculate(draft, block_step, ends, start)
                if spec.mode == "exact":
                    verdict = self.judge_exact(draft, logits, block_step, start)
                else:
                    verdict = self.judge_paper(block, draft, logits, m_index, start)
                self.round_index += 1
                block, block_host, taken = self.decide(verdict, draft, block_host)
                self.check_progress(block_host, masks, block_step)
                block_step += taken
                if carried is not None and carried.committed is not None and not keep_commit(carried, block_host):
                    self.row.truncate("draft", carried.draft_cached)  # roll back the speculative commit
                    carried = None
            blocks += 1
            new = block_host[first_gen:]
            generated.extend(new)
            self.stats.origins.extend(self.origin[first_gen:])
            if on_block is not None and on_block(new):
                return generated, blocks
            if stops.intersection(new) or len(generated) >= cfg.max_new_tokens:
                return generated, blocks
            # folded commits are not combined with optimistic drafting (its rollback assumes
            # explicit draft commits)
            fold = cfg.fold_commit and not self.optimistic
            fwd = self.row.commit("target", block, fold=fold)
            if fwd is not None:
                yield fwd
            if carried is None or carried.committed is None:
                fwd = self.row.commit("draft", block.to(self.row.devices["draft"]), fold=fold)
                if fwd is not None:
                    yield fwd
