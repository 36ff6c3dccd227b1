"""One request's SimSD rounds (draft, verify, accept, commit) as a :mod:`simsd.batching` program.

See :mod:`simsd.speculative` for the modes and :mod:`simsd.optimistic` for speculation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from simsd_kernels import TAU_INF

from .batching import Fwd, Row
from .decoding import denoise_step, without_mask_token
from .optimistic import Speculation, assumed_outcome, keep_commit, reconcile, salvage
from .sampling import filtered_probs
from .vanilla import new_block
from .verification import accept_token, exact_layout, paper_layout


class Stats:
    def __init__(self):
        self.proposed = self.accepted = self.rounds = 0
        self.fallback_steps = 0
        self.speculations = self.speculations_kept = 0

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "rounds": self.rounds,
                "accepted_per_round": self.accepted / self.rounds if self.rounds else 0.0,
                "fallback_steps": self.fallback_steps, "speculations": self.speculations,
                "speculations_kept": self.speculations_kept}


@dataclass
class Draft:
    """One draft proposal: block states before each step, the final state, reveal steps, probs."""
    states: list          # states[c]: block before draft step c (c = 0..n-1)
    final: torch.Tensor   # block after the n draft steps
    tau: torch.Tensor     # (L,) 1-based reveal step, TAU_INF where not revealed
    probs: torch.Tensor   # (L, V) the draft's sampling distribution at each position's reveal step
    #: ``final`` on the draft's device: reading it never waits for the target's device
    final_draft: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return len(self.states)

    def to(self, device) -> "Draft":
        return Draft([s.to(device) for s in self.states], self.final.to(device), self.tau, self.probs,
                     self.final_draft)


class SpecRow:
    """One request's SimSD rounds as a :mod:`simsd.batching` program: its generator, its
    counters, and the draft / verify / commit logic. Methods that run forwards are generators
    (``yield`` a :class:`Fwd`, receive the logits)."""

    def __init__(self, dec, row: Row, generator: torch.Generator, optimistic: bool = False,
                 draft_generator: torch.Generator | None = None):
        self.dec, self.row, self.generator = dec, row, generator
        self.cfg, self.mask_id = dec.cfg, dec.mask_id
        self.optimistic = optimistic
        # with speculation the draft samples from its own stream (its draws may run before the
        # target's acceptance draws); without it, one stream as in the reference decoder
        self.draft_generator = draft_generator if optimistic else generator
        self.stats = Stats()

    # -- draft ---------------------------------------------------------------------------
    def propose(self, block: torch.Tensor, block_step: int):
        """Draft up to gamma steps from ``block``; returns a :class:`Draft`."""
        dev = self.row.devices["draft"]
        state = block.to(dev)
        L = state.shape[0]
        tau = torch.full((L,), TAU_INF, dtype=torch.int64)
        probs = torch.zeros(L, self.dec.d.config.vocab_size)
        states = []
        for c in range(self.dec.gamma):
            if not bool((state == self.mask_id).any()):
                break
            states.append(state.to(block.device))
            logits = yield self.row.denoise("draft", state)
            state, revealed, p = denoise_step(logits, state, self.mask_id, self.dec.draft_cfg, block_step + c,
                                              self.draft_generator)
            rev = revealed.cpu()
            tau[rev] = c + 1
            probs[rev] = p.cpu()[rev].to(probs.dtype)
        return Draft(states, state.to(block.device), tau, probs, state)

    # -- target verification -------------------------------------------------------------
    def exact_request(self, draft: Draft) -> Fwd:
        """The exact verify forward: one copy per draft step, plus a bonus copy of the draft's
        final state when it still has MASK."""
        states = list(draft.states)
        if bool((draft.final == self.mask_id).any()):
            states.append(draft.final)
        return self.row.exact("target", states)

    def judge_exact(self, draft: Draft, logits: torch.Tensor, block_step: int):
        """Returns ``(new_block, steps_taken, accepted_tokens)`` from the verify logits."""
        states = list(draft.states)
        bonus = bool((draft.final == self.mask_id).any())
        if bonus:
            states.append(draft.final)
        logits = logits.view(len(states), states[0].shape[0], -1)
        greedy = self.cfg.sampling.greedy
        accepted = 0
        for c in range(draft.n):
            before = states[c]
            after = states[c + 1] if c + 1 < draft.n else draft.final
            step_pos = torch.nonzero(draft.tau == c + 1).flatten().tolist()
            self.stats.proposed += len(step_pos)
            if greedy:
                mine, _, _ = denoise_step(logits[c], before, self.mask_id, self.cfg, block_step + c, None)
                if torch.equal(mine, after):
                    accepted += len(step_pos)
                    continue
                return mine, c + 1, accepted
            p_t = filtered_probs(without_mask_token(logits[c], self.mask_id), self.cfg.sampling)
            new = before.clone()
            for p in step_pos:
                ok, tok = accept_token(int(after[p]), p_t[p], draft.probs[p].to(p_t.device), self.generator)
                new[p] = tok
                if not ok:
                    return new, c + 1, accepted
                accepted += 1
        # every draft step accepted: the bonus copy gives the target's own next step
        if bonus:
            mine, _, _ = denoise_step(logits[draft.n], draft.final, self.mask_id, self.cfg,
                                      block_step + draft.n, self.generator)
            return mine, draft.n + 1, accepted
        return draft.final, draft.n, accepted

    def paper_request(self, block: torch.Tensor, draft: Draft):
        """The paper verify forward ``[leftover | D | M]`` and ``m_index`` (see :func:`paper_layout`)."""
        known = block != self.mask_id
        start = self.row.cached["target"]
        ids, pos, lab, m_index = paper_layout(block, known, draft.final, draft.tau.to(block.device), start,
                                              self.mask_id, self.dec.spec.rope_copy)
        return Fwd("target", ids[0], pos[0], lab[0], "paper"), m_index

    def judge_paper(self, block: torch.Tensor, draft: Draft, logits: torch.Tensor, m_index):
        """Returns ``(new_block, steps_taken, accepted_tokens)`` from the verify logits."""
        greedy = self.cfg.sampling.greedy
        new = block.clone()
        accepted = 0
        for c in range(draft.n):
            step_pos = torch.nonzero(draft.tau == c + 1).flatten().tolist()
            self.stats.proposed += len(step_pos)
            for p in step_pos:
                lg = without_mask_token(logits[int(m_index[p])], self.mask_id)
                x = int(draft.final[p])
                if greedy:
                    best = int(lg.argmax())
                    ok, tok = best == x, best
                else:
                    p_t = filtered_probs(lg[None], self.cfg.sampling)[0]
                    ok, tok = accept_token(x, p_t, draft.probs[p].to(p_t.device), self.generator)
                new[p] = tok
                if not ok:
                    return new, c + 1, accepted
                accepted += 1
        return new, draft.n, accepted

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
    def target_step(self, block: torch.Tensor, block_step: int):
        logits = yield self.row.denoise("target", block)
        block, _, _ = denoise_step(logits, block, self.mask_id, self.cfg, block_step, self.generator)
        self.stats.fallback_steps += 1
        return block

    def speculate(self, draft: Draft, block_step: int, ends):
        """Draft the next round from the assumed outcome of this one (see :mod:`simsd.optimistic`);
        returns a :class:`Speculation` or None."""
        out = assumed_outcome(draft, block_step, self.mask_id, ends)
        if out is None:
            return None
        block, step, committed = out
        cached = self.row.cached["draft"]
        if committed is not None:
            yield self.row.commit("draft", committed.to(self.row.devices["draft"]))
        proposal = yield from self.propose(block, step)
        self.stats.speculations += 1
        return Speculation(block, step, proposal, cached, committed)

    def take(self, spec: Speculation | None, block: torch.Tensor, block_step: int) -> Draft | None:
        """The part of a speculation that is valid for the actual round start, if any."""
        if spec is None:
            return None
        j = reconcile(spec, block, block_step)
        if j is None:
            return None
        self.stats.speculations_kept += 1
        return salvage(spec.draft, j).to(block.device)

    def program(self, tail: list):
        """The row's decoding; returns ``(generated, blocks)``.

        With ``optimistic``, the next round's draft runs between launching the verify forward
        and reading its logits (on another device it overlaps the target's forward).
        """
        cfg, spec, dec = self.cfg, self.dec.spec, self.dec
        B = cfg.block_length
        stops = set(dec.t.stop_ids)
        generated: list = []
        blocks = 0
        device = self.row.devices["target"]
        carried = None  # a Speculation for the next round
        while True:
            block = new_block(tail, B, self.mask_id, device)
            first_gen, tail, block_step = len(tail), [], 0

            def ends(full: torch.Tensor) -> bool:
                new = full[first_gen:].tolist()
                return bool(stops.intersection(new)) or len(generated) + len(new) >= cfg.max_new_tokens

            while bool((block == self.mask_id).any()):
                remaining = int((block == self.mask_id).sum())
                if spec.on_reject == "fallback" and remaining < dec.gamma:
                    carried = None
                    block = yield from self.target_step(block, block_step)
                    block_step += 1
                    continue
                draft = self.take(carried, block, block_step)
                carried = None
                if draft is None:
                    draft = yield from self.propose(block, block_step)
                self.stats.rounds += 1
                if spec.mode == "exact":
                    logits = yield self.exact_request(draft)
                else:
                    flush = self.row.flush("target")  # the paper layout has no place for it
                    if flush is not None:
                        yield flush
                    fwd, m_index = self.paper_request(block, draft)
                    logits = yield fwd
                    if self.dec.diagnostics is not None:
                        yield from self.compare_with_exact(draft, logits, m_index)
                if self.optimistic:  # before the verdict is read (the first host read of the logits)
                    carried = yield from self.speculate(draft, block_step, ends)
                if spec.mode == "exact":
                    block, taken, acc = self.judge_exact(draft, logits, block_step)
                else:
                    block, taken, acc = self.judge_paper(block, draft, logits, m_index)
                self.stats.accepted += acc
                block_step += taken
                if carried is not None and carried.committed is not None and not keep_commit(carried, block):
                    self.row.truncate("draft", carried.draft_cached)  # roll back the speculative commit
                    carried = None
            blocks += 1
            new = block[first_gen:].tolist()
            generated.extend(new)
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
