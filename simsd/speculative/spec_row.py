"""One request's SimSD rounds (draft, verify, accept, commit) as a :mod:`simsd.engine.batching` program.

A round reads as its steps: take the speculation carried over from the last round or draft
(:meth:`SpecRow.propose`), verify (the row's verifier, :mod:`simsd.speculative.verifiers`),
speculate the next round while the verdict is computed (optimistic drafting,
:mod:`simsd.speculative.optimistic`), read the verdict (:meth:`SpecRow.decide`). With
``on_reject="fallback"`` a block whose MASK count fell below ``gamma`` is finished by target
steps (:meth:`SpecRow.fallback_step`). See :mod:`simsd.speculative` for the modes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from simsd_kernels import TAU_INF

from ..config.speculative import LOGIT_ALTERNATIVES
from ..decoding.noise import PAPER_DRAFT, SAMPLE, NoiseKey
from ..decoding.program import BlockState, RowProgram
from ..decoding.step import Step
from ..engine.batching import Row
from .optimistic import Speculation, assumed_outcome, keep_commit, reconcile, salvage
from .tree import ProposalTree, masks_after, step_candidates
from .verifiers import ExactVerifier, Round, Verdict


class Stats:
    """A row's verification counters (docs/statistics.md):

    * ``proposed``: draft tokens put to the target, i.e. every token the draft revealed in every
      verified draft step, rejected steps included;
    * ``accepted``: the proposed tokens the target accepted; ``acceptance_rate`` = accepted /
      proposed (the field's definition);
    * ``target_tokens``: tokens the target chose itself (the correction at a rejection, its own
      steps in exact mode, fallback steps). ``accepted + target_tokens`` = every token decoded,
      the returned ones and those cut after a stop or the token budget;
    * ``rounds``, ``accepted_per_round`` = accepted / rounds, ``fallback_steps``, ``speculations``
      (optimistic drafts started), ``speculations_kept``;
    * ``lookahead_blocks``: blocks finished as a self-speculative round proposed them, by a round
      that also took the next block's first step; ``lookahead_commits``: those of them committed
      by that round (the finished block it wrote: no commit forward of their own; the others
      are committed as any finished block is).

    ``origins`` records, per decoded token, whether it came from the draft (True) or the
    target (False), so that the decoder can count the draft's share of the returned tokens.
    """

    def __init__(self):
        self.proposed = self.accepted = self.rounds = 0
        self.target_tokens = 0
        self.fallback_steps = 0
        self.speculations = self.speculations_kept = 0
        self.lookahead_blocks = self.lookahead_commits = 0
        self.origins: list = []

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "target_tokens": self.target_tokens, "rounds": self.rounds,
                "accepted_per_round": self.accepted / self.rounds if self.rounds else 0.0,
                "fallback_steps": self.fallback_steps, "speculations": self.speculations,
                "speculations_kept": self.speculations_kept, "lookahead_blocks": self.lookahead_blocks,
                "lookahead_commits": self.lookahead_commits}


@dataclass
class Draft:
    """One draft proposal, on the draft's device until :meth:`to` moves it.

    ``states[c] (L,)``: the block before draft step ``c`` (``c = 0..n-1``); ``final (L,)``: after
    the ``n`` steps; ``tau (L,)`` int64: 1-based reveal step, ``TAU_INF`` where not revealed;
    ``probs (L, V)``: the draft's sampling distribution at each position's reveal step (paper
    mode's rejection sampling; None when greedy and in exact mode); ``remaining``: MASK
    positions left in ``final`` (a host int, known without reading the device for the schedule
    strategies).
    """
    states: list
    final: torch.Tensor
    tau: torch.Tensor
    probs: torch.Tensor | None
    remaining: int
    #: ``final`` on the draft's device: reading it never waits for the target's device
    final_draft: torch.Tensor | None = None
    #: exact mode with alternatives: per draft step ``c``, ``(states, kinds)`` of the other
    #: outcomes proposed beside it (:func:`~simsd.speculative.tree.step_candidates`); None: a chain
    siblings: list | None = None

    @property
    def n(self) -> int:
        return len(self.states)

    def tree(self) -> ProposalTree:
        """The chain as exact verification's proposal tree (the final state its last node), with
        each step's alternatives as leaves beside the step's node (a leaf has MASK when the
        step's node does: the schedule reveals as many tokens whichever positions)."""
        chain = ProposalTree.chain(self.states, self.final, self.remaining, (self.tau <= self.n).sum())
        if not self.siblings:
            return chain
        states, parent, depth, copies = [chain.states], list(chain.parent), list(chain.depth), list(chain.copies)
        kind = [0] * chain.nodes
        for c, (alternatives, kinds) in enumerate(self.siblings):
            if not kinds:  # none applied (one MASK left: no other position)
                continue
            states.append(torch.stack(alternatives))
            parent += [c] * len(kinds)
            depth += [c + 1] * len(kinds)
            copies += [chain.copies[c + 1]] * len(kinds)
            kind += kinds
        return ProposalTree(torch.cat(states), parent, depth, copies, chain.proposed, kind)

    def to(self, device) -> "Draft":
        probs = None if self.probs is None else self.probs.to(device)
        siblings = None if self.siblings is None else [([s.to(device) for s in sts], kinds)
                                                       for sts, kinds in self.siblings]
        return Draft([s.to(device) for s in self.states], self.final.to(device), self.tau.to(device), probs,
                     self.remaining, self.final_draft, siblings)


class SpecRow(RowProgram):
    """One request's SimSD rounds as a :class:`~simsd.decoding.program.RowProgram`: its seed,
    its counters, its verifier and the draft / verify / commit logic. Methods that run forwards
    are generators (``yield`` a :class:`~simsd.engine.batching.Fwd`, receive the logits).

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
    def __init__(self, dec, plan, row: Row, seed: int, optimistic: bool = False, stop_ids=None, verifier_class=None):
        super().__init__(row, plan.cfg, dec.mask_id, dec.t.stop_ids if stop_ids is None else stop_ids, seed)
        self.dec, self.plan = dec, plan
        self.mode = plan.spec.mode
        self.progress = (f"{self.mode} round", "committed no token")
        self.verifier = (verifier_class or dec.verifier_class)(plan.cfg, plan.spec, dec.mask_id, seed)
        if dec.self_draft and plan.spec.speculation_width == "auto" and getattr(dec.t.model, "tp", (0, 1))[1] == 1:
            # the auto width weighs what the engine's target forwards cost (a fixed width reads no
            # timings); tensor-parallel ranks time their forwards differently and must run the same
            # rounds: no timings there
            cost = row.costs.get("target")
            self.verifier.draft.policy.cost = cost.want() if cost is not None else None
        #: alternatives beside each drafted step (exact mode with a draft model and a width past
        #: its chain; the schedule strategies, whose steps reveal a known count)
        self.alternatives = 0
        width = plan.spec.speculation_width
        if not dec.self_draft and width != "auto" and isinstance(self.verifier, ExactVerifier) and \
                plan.draft_cfg.strategy in ("sequential", "static"):
            self.alternatives = min(LOGIT_ALTERNATIVES, max(0, (int(width) - plan.gamma - 1) // plan.gamma))
        self.optimistic = optimistic
        self.round_index = 0  # rounds verified so far (keys paper mode's noise)
        self.carried = None  # a Speculation for the next round
        # (block, host, logits, committed, steps, accepted) of the next block after its first steps,
        # taken by a lookahead round (committed: the finished block was written by that round;
        # accepted: the positions it took from the history's predictions)
        self.ahead = None
        self.stats = Stats()

    def key(self, start: int, stream: int = SAMPLE, round_index: int = 0) -> NoiseKey:
        return NoiseKey(self.seed, start, stream, round_index)

    def draft_key(self, start: int, round_index: int) -> NoiseKey:
        """The draft's noise key: the target's (exact mode: coupled draws) or, for rejection
        sampling, a stream of its own that is fresh every round."""
        if not self.verifier.rejection_sampling:
            return self.key(start)
        return self.key(start, PAPER_DRAFT, round_index)

    # -- a block: rounds, or fallback steps ---------------------------------------------------
    def new_block(self, tail: list) -> BlockState:
        self.origin = [None] * self.cfg.block_length  # per position: True = from the draft, False = the target's
        ahead, self.ahead = self.ahead, None
        if self.dec.self_draft:
            self.verifier.draft.new_block(ahead is not None)
        if ahead is None:
            return super().new_block(tail)
        # the last round took this block's first step (a lookahead round: its logits are kept)
        block, host, logits, _, steps, proposed = ahead
        self.mark([self.mask_id] * len(host), host, proposed)
        blk = BlockState(block, host, self.layouts.start("target"), 0, steps, lp=self.block_logprobs())
        if blk.lp is not None:  # the first step's tokens, revealed from the lookahead copy's logits
            blk.lp.note(logits, block, block != self.mask_id)
        return blk

    def advance(self, blk: BlockState):
        """One round of the block, or a target step once it falls back (the paper's
        ``on_reject="fallback"``: fewer than ``gamma`` MASK left)."""
        if self.plan.spec.on_reject == "fallback" and blk.host.count(self.mask_id) < self.plan.gamma:
            yield from self.fallback_step(blk)
        else:
            yield from self.round(blk)

    def round(self, blk: BlockState):
        """Draft (or take the carried speculation), verify, speculate the next round (optimistic
        drafting: between launching the verify forward and reading its decision, so that on
        another device it overlaps the target's forward), read the verdict. Self-speculation
        proposes from the target's last verify logits instead, with no forward."""
        draft = self.take(blk)
        # self-speculation may take the next block's first step in this round (a lookahead round)
        lookahead = self.dec.self_draft and self.mode == "exact" and \
            len(self.generated) + self.cfg.block_length < self.cfg.max_new_tokens
        if draft is None and self.dec.self_draft and self.mode == "paper":
            draft = self.verifier.draft.chain(blk.block, blk.step, blk.host.count(self.mask_id), self.key(blk.start),
                                              Draft, not self.cfg.sampling.greedy)
            if draft is None:  # nothing to propose from yet: a target step that keeps its logits
                yield from self.self_step(blk)
                return
        elif draft is None and self.dec.self_draft:
            own = self.verifier.draft
            own.ngram.follow(self.row.prompt, self.generated, blk.first)
            draft = own.propose(blk.block, blk.step, blk.host.count(self.mask_id), self.key(blk.start), lookahead,
                                blk.host)
        elif draft is None:
            masks = blk.host.count(self.mask_id)
            draft = (yield from self.propose(blk.block, blk.step, masks, blk.start, self.round_index, self.history))
            draft = draft.to(self.row.devices["target"])
        rnd = Round(blk.block, blk.host, blk.step, blk.start, draft, self.round_index, lookahead=lookahead,
                    history=self.history)
        self.stats.rounds += 1
        logits = yield from self.verifier.verify(self.layouts, rnd)
        if self.optimistic:  # before the decision is read
            self.carried = yield from self.speculate(rnd, blk)
        verdict = self.verifier.judge(rnd, logits)
        self.round_index += 1
        self.decide(verdict, rnd, blk)
        self.drop_stale_speculation(blk)

    def fallback_step(self, blk: BlockState):
        """One vanilla target step (one host read: its new block)."""
        self.carried = None
        before = blk.host
        step = Step(blk.block, blk.step, self.cfg, self.mask_id, self.key(blk.start), keep_logits=blk.lp is not None,
                    history=self.history)
        self.stepped(blk, (yield self.layouts.denoise("target", blk.block, step)))
        blk.host = self.read([blk.block], blk)
        self.mark(before, blk.host)
        self.stats.fallback_steps += 1
        blk.step += 1

    def self_step(self, blk: BlockState):
        """Paper mode's self-speculation at a round without kept logits: one target step (one host
        read: its new block) whose logits the next round's proposal is drawn from; counted as a
        round without proposals."""
        before = blk.host
        step = Step(blk.block, blk.step, self.cfg, self.mask_id, self.key(blk.start), keep_logits=True,
                    history=self.history)
        out = yield self.layouts.denoise("target", blk.block, step)
        self.verifier.draft.logits = out[3]
        self.stepped(blk, out)
        blk.host = self.read([blk.block], blk)
        self.mark(before, blk.host)
        self.stats.rounds += 1
        blk.step += 1

    def finish_block(self, blk: BlockState) -> None:
        self.stats.origins.extend(self.origin[blk.first:])

    def commit(self, blk: BlockState):
        """Commit the finished block to both caches; the draft's is skipped when a kept
        speculation committed it already. Folded commits are not combined with optimistic
        drafting (its rollback assumes explicit draft commits)."""
        fold = self.cfg.fold_commit and not self.optimistic
        if self.ahead is not None and self.ahead[3]:
            return  # a lookahead round committed it (self-speculation: no draft cache)
        fwd = self.layouts.flush("target")  # the last block's folded commit, when a lookahead began and
        if fwd is not None:  # finished this one with no forward of its own
            yield fwd
        fwd = self.layouts.commit("target", blk.block, fold=fold)
        if fwd is not None:
            yield fwd
        if self.dec.self_draft:
            return  # no draft cache
        if self.carried is None or self.carried.committed is None:
            fwd = self.layouts.commit("draft", blk.block.to(self.row.devices["draft"]), fold=fold)
            if fwd is not None:
                yield fwd

    # -- draft ---------------------------------------------------------------------------
    def propose(self, block: torch.Tensor, block_step: int, masks: int, start: int, round_index: int,
                history=None):
        """Draft up to gamma steps from ``block`` (``masks`` MASK positions), the block at
        absolute position ``start`` after ``block_step`` steps, for round ``round_index``;
        returns a :class:`Draft`. ``history``: the row's token history before that block (the
        draft's steps apply the request's penalties as the target's do; None without penalties).
        Draft step ``c`` is block step ``block_step + c`` (its schedule
        entry and noise key), unless the verifier schedules it otherwise (:meth:`Verifier.draft_step`)."""
        dev = self.row.devices["draft"]
        dcfg = self.plan.draft_cfg
        state = block.to(dev)
        L = state.shape[0]
        tau = torch.full((L,), TAU_INF, dtype=torch.int64, device=dev)
        key = self.draft_key(start, round_index)
        keep_probs = not dcfg.sampling.greedy and self.verifier.rejection_sampling
        probs = torch.zeros(L, self.dec.d.config.vocab_size, device=dev) if keep_probs else None
        states, siblings = [], ([] if self.alternatives else None)
        counts_known = dcfg.strategy in ("sequential", "static")
        for c in range(self.plan.gamma):
            if masks == 0:
                break
            states.append(state)
            step_cfg, index = self.verifier.draft_step(dcfg, block_step, c, masks)
            out = yield self.layouts.denoise(
                "draft", state, Step(state, index, step_cfg, self.mask_id, key, keep_logits=bool(self.alternatives),
                                     history=history))
            new, revealed, p = out[:3]
            if self.alternatives:  # the step's other outcomes on the same logits and noise
                siblings.append(step_candidates(out[3], state, self.mask_id, step_cfg, index, out[4],
                                                range(1, self.alternatives + 1), masks, primary=(new, revealed)))
            state = new
            tau.masked_fill_(revealed, c + 1)
            if probs is not None:
                probs = torch.where(revealed[:, None], p.to(probs.dtype), probs)
            if counts_known:
                masks = masks_after(masks, step_cfg.tokens_for_step(index))
            else:
                masks = int((state == self.mask_id).sum())  # data-dependent reveal count
        return Draft(states, state, tau, probs, masks, state, siblings)

    # -- the verdict -----------------------------------------------------------------------
    def decide(self, verdict: Verdict, rnd: Round, blk: BlockState) -> None:
        """Read a round's decision on the host, in one transfer (the new block; exact mode: the
        deepest valid proposed state, paper mode: the draft's reveal steps; steps taken,
        accepted count) and move ``blk`` on: its new block (device tensor and host list) and
        steps. The counters go to ``stats``.

        Exact mode accepts the positions where the deepest valid proposed state differs from
        the round's block; paper mode the first ``accepted`` proposals in the verifier's
        acceptance order (:meth:`Verifier.acceptance_order`: the draft's temporal order, reveal
        step then position; position order in the release variant). The other positions
        revealed this round are the target's."""
        new, taken, acc = verdict.block, verdict.taken, verdict.accepted
        L = new.shape[0]
        if verdict.valid is not None:  # exact: accepted where the deepest valid proposal differs from the block
            tree = rnd.layout[0]
            known = not isinstance(tree.proposed, torch.Tensor)
            ahead = [] if verdict.next is None else [verdict.next]
            counts = [taken, acc, verdict.node] + ([] if known else [tree.proposed]) + \
                ([verdict.next_taken, verdict.next_accepted, verdict.next_node] if ahead else [])
            host = self.read([new, verdict.valid, *ahead, torch.stack(counts).to(new.dtype)], blk)
            block_host, valid = host[:L], host[L:2 * L]
            nxt, host = (host[2 * L:3 * L], host[3 * L:]) if ahead else (None, host[2 * L:])
            taken, acc, node = host[0], host[1], host[2]
            self.stats.proposed += tree.proposed if known else host[3]
            accepted = {i for i in range(L) if valid[i] != rnd.host[i]}
            if self.dec.self_draft:
                self.verifier.draft.observe(tree, node)
            if ahead:
                next_taken, next_acc, next_node = host[-3:]
                written = node == verdict.finished[0]
                if not written:  # the first proposed finished block was written to the cache: roll it back
                    self.row.truncate("target", self.row.cached["target"] - L)
                if node in verdict.finished:  # finished as proposed: the next block begun
                    chain = tree.ahead_states[next_node] if next_node else ()
                    self.ahead = (verdict.next, nxt, verdict.next_logits, written, next_taken,
                                  {i for i, t in enumerate(chain) if t != self.mask_id})
                    self.stats.lookahead_blocks += 1
                    self.stats.lookahead_commits += written
                    self.stats.accepted += next_acc  # the next block's steps the history predicted
                    if tree.ahead:
                        self.verifier.draft.policy.observe_ahead(tree.ahead[verdict.finished.index(node)], next_node)
        else:
            draft = rnd.draft
            host = self.read([new, draft.tau.to(new.dtype), torch.stack([taken, acc]).to(new.dtype)], blk)
            block_host, tau, taken, acc = host[:L], host[L:2 * L], host[2 * L], host[2 * L + 1]
            proposals = self.verifier.acceptance_order(tau, draft.n)
            self.stats.proposed += len(proposals)
            accepted = set(proposals[:acc])
        self.stats.accepted += acc
        if blk.lp is not None:  # the round's tokens, each from the logits that revealed it (Verdict.logits)
            blk.lp.note(verdict.logits, new, new != rnd.block)
        self.mark(rnd.host, block_host, accepted)
        blk.block, blk.host = new, block_host
        blk.step += taken

    def mark(self, before: list, after: list, from_draft=frozenset()) -> None:
        """Record who chose the positions revealed between ``before`` and ``after``."""
        for i, (a, b) in enumerate(zip(before, after)):
            if a == self.mask_id and b != self.mask_id:
                self.origin[i] = i in from_draft
                self.stats.target_tokens += i not in from_draft

    # -- optimistic drafting -------------------------------------------------------------
    def speculate(self, rnd: Round, blk: BlockState):
        """Draft the next round from the assumed outcome of this one (see :mod:`simsd.speculative.optimistic`);
        returns a :class:`Speculation` or None. Its noise keys are those of the round it is for,
        so a kept speculation is exactly the draft that round would compute."""
        out = assumed_outcome(rnd.draft, rnd.step, self.mask_id, lambda full: self.ends(full[blk.first:].tolist()))
        if out is None:
            return None
        block, step, committed = out
        cached = self.row.cached["draft"]
        if committed is not None:
            yield self.layouts.commit("draft", committed.to(self.row.devices["draft"]))
        masks = rnd.draft.remaining if committed is None else block.shape[0]
        next_start = rnd.start if committed is None else rnd.start + block.shape[0]
        history = self.history
        if history is not None and committed is not None:  # a draft of the next block: this one is output
            history = history.after(committed)
        proposal = yield from self.propose(block, step, masks, next_start, self.round_index + 1, history)
        self.stats.speculations += 1
        return Speculation(block, step, proposal, cached, committed)

    def take(self, blk: BlockState) -> Draft | None:
        """The part of the carried speculation that is valid for the round starting at ``blk``,
        if any (on the target's device); the speculation is used up."""
        spec, self.carried = self.carried, None
        if spec is None:
            return None
        j = reconcile(spec, blk.host, blk.step)
        if j is None:
            return None
        self.stats.speculations_kept += 1
        return salvage(spec.draft, j).to(self.row.devices["target"])

    def drop_stale_speculation(self, blk: BlockState) -> None:
        """A speculation that committed an assumed finished block to the draft cache stands only
        if the target finished exactly that block: otherwise roll the commit back, drop it."""
        spec = self.carried
        if spec is not None and spec.committed is not None and not keep_commit(spec, blk.host):
            self.row.truncate("draft", spec.draft_cached)
            self.carried = None

    # -- statistics ----------------------------------------------------------------------
    def stats_for(self, n: int, seconds: float) -> dict:
        """Vanilla's statistics (:meth:`RowProgram.stats_for`) and the SimSD counters (docs/statistics.md,
        "Statistics"): ``from_draft`` (returned tokens that came from the draft),
        ``draft_share``, ``draft_forwards``, ``draft_forwards_per_token``,
        ``draft_query_tokens_per_forward``, ``gamma``, ``tree_reads`` (self-speculation: the
        rounds whose grown tree was read back, :meth:`~simsd.speculative.self_draft.SelfDraft.propose`;
        0 otherwise) and :class:`Stats`."""
        from_draft = sum(1 for o in self.stats.origins[:n] if o)
        fw = self.row.forwards.get("draft", 0)
        return {**super().stats_for(n, seconds), "from_draft": from_draft,
                "draft_share": from_draft / n if n else 0.0, "draft_forwards": fw,
                "draft_forwards_per_token": fw / max(n, 1),
                "draft_query_tokens_per_forward": self.row.query_tokens.get("draft", 0) / max(fw, 1),
                "gamma": self.plan.gamma, "tree_reads": getattr(getattr(self.verifier, "draft", None), "reads", 0),
                **self.stats.as_dict()}
