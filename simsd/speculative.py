"""SimSD speculative decoding: a draft dLLM proposes, the target verifies in one forward.

Modes (DESIGN.md §4):

* ``paper``: the paired ``[leftover | D | M]`` layout with RoPE copy and the four-quadrant
  temporal mask; greedy matching or rejection sampling in the draft's temporal order.
* ``exact``: one block copy per verified draft step (§4.1); with greedy decoding each draft
  step is accepted only if it equals the target's own decision (positions and tokens), so the
  output is token-identical to vanilla decoding with the target for any draft. A last
  "bonus" copy of the draft's final state lets the target take one more step of its own
  when every draft step is accepted and the block is not full.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from simsd_kernels import TAU_INF

from .batching import BatchResult, engine_for, Fwd, Row
from .decoding import DecodeConfig, GenerationResult, Timer, check_prompt, denoise_step, finish, without_mask_token
from .sampling import filtered_probs
from .vanilla import batch_stats, new_block
from .verification import accept_token, exact_layout, paper_layout

MODES = ("paper", "exact")


@dataclass
class SpecConfig:
    """``gamma``: draft steps verified per round (default: the block length).
    ``on_reject``: ``redraft`` (draft again for the remaining positions) or ``fallback`` (the
    paper: when fewer than ``gamma`` positions remain, the target finishes the block with vanilla
    denoising). ``rope_copy=False`` is the ablation of §4."""
    mode: str = "exact"
    gamma: int | None = None
    on_reject: str = "redraft"
    rope_copy: bool = True
    draft_strategy: str | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"speculative mode must be one of {MODES}, got {self.mode!r}")
        if self.on_reject not in ("redraft", "fallback"):
            raise ValueError(f"on_reject must be 'redraft' or 'fallback', got {self.on_reject!r}")
        if self.gamma is not None and self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {self.gamma}")


def check_pair(target, draft) -> None:
    """Draft and target must share the tokenizer: same vocabulary size, mask id, vocabulary.

    Raises:
        ValueError: naming what differs.
    """
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"draft vocab_size {dv} != target vocab_size {tv}: they must share the tokenizer")
    if target.mask_token_id != draft.mask_token_id:
        raise ValueError(f"draft mask id {draft.mask_token_id} != target mask id {target.mask_token_id}")
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise ValueError(f"the draft's tokenizer ({draft.path}) differs from the target's ({target.path})")


class Stats:
    def __init__(self):
        self.proposed = self.accepted = self.rounds = 0
        self.fallback_steps = 0

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "rounds": self.rounds,
                "accepted_per_round": self.accepted / self.rounds if self.rounds else 0.0,
                "fallback_steps": self.fallback_steps}


@dataclass
class Draft:
    """One draft proposal: block states before each step, the final state, reveal steps, probs."""
    states: list          # states[c]: block before draft step c (c = 0..n-1)
    final: torch.Tensor   # block after the n draft steps
    tau: torch.Tensor     # (L,) 1-based reveal step, TAU_INF where not revealed
    probs: torch.Tensor   # (L, V) the draft's sampling distribution at each position's reveal step

    @property
    def n(self) -> int:
        return len(self.states)


class SpeculativeDecoder:
    """Decodes prompts with a draft and a target checkpoint (see module doc); each prompt's
    round state lives in its own :class:`SpecRow`, driven by a :class:`BatchEngine`."""

    def __init__(self, target, draft, cfg: DecodeConfig, spec: SpecConfig):
        check_pair(target, draft)
        self.t, self.d, self.cfg, self.spec = target, draft, cfg, spec
        self.draft_cfg = dataclasses.replace(cfg, strategy=spec.draft_strategy or cfg.strategy)
        self.gamma = spec.gamma or cfg.block_length
        self.mask_id = target.mask_token_id
        self.diagnostics = None  # dict: compare paper verification with exact (simsd bench)

    def generate(self, prompt_ids: list) -> GenerationResult:
        return self.generate_batch([prompt_ids]).results[0]

    def generate_batch(self, prompts: list, first_index: int = 0, cuda_graphs: bool = False) -> BatchResult:
        """Decode ``prompts`` together with independent progress; row ``i`` samples with a
        generator seeded ``cfg.seed + first_index + i`` (see :func:`vanilla_generate_batch`)."""
        cfg = self.cfg
        B = cfg.block_length
        capacity = max(check_prompt(p, self.t.config, cfg.max_new_tokens, B) for p in prompts)
        for p in prompts:
            check_prompt(p, self.d.config, cfg.max_new_tokens, B)
        engine = engine_for({"target": self.t.model, "draft": self.d.model}, B, len(prompts), capacity,
                            (self.gamma + 2) * B, cuda_graphs)
        tails = [engine.prefill(i, p) for i, p in enumerate(prompts)]
        rows = [SpecRow(self, engine.rows[i], torch.Generator().manual_seed(cfg.seed + first_index + i))
                for i in range(len(prompts))]
        with Timer(self.t.model.device) as timer:
            outs = engine.run([r.program(tail) for r, tail in zip(rows, tails)])
        results = []
        for r, (generated, blocks) in zip(rows, outs):
            token_ids = finish(generated, self.t.stop_ids, cfg.max_new_tokens)
            n = len(token_ids)
            fw = r.row.forwards
            stats = {
                "mode": self.spec.mode,
                "new_tokens": n,
                "decode_seconds": timer.seconds,
                "tokens_per_second": n / timer.seconds if timer.seconds > 0 else float("nan"),
                "target_forwards": fw["target"],
                "draft_forwards": fw["draft"],
                "target_forwards_per_token": fw["target"] / max(n, 1),
                "draft_forwards_per_token": fw["draft"] / max(n, 1),
                "prefill_forwards": r.row.prefill_forwards,
                "blocks": blocks,
                "gamma": self.gamma,
                **r.stats.as_dict(),
            }
            if len(prompts) > 1:
                stats["batch_size"] = len(prompts)
            results.append(GenerationResult(token_ids, stats))
        return BatchResult(results, batch_stats(results, timer.seconds, engine.forwards))


class SpecRow:
    """One request's SimSD rounds as a :mod:`simsd.batching` program: its generator, its
    counters, and the draft / verify / commit logic. Methods that run forwards are generators
    (``yield`` a :class:`Fwd`, receive the logits)."""

    def __init__(self, dec: SpeculativeDecoder, row: Row, generator: torch.Generator):
        self.dec, self.row, self.generator = dec, row, generator
        self.cfg, self.mask_id = dec.cfg, dec.mask_id
        self.stats = Stats()

    # -- draft ---------------------------------------------------------------------------
    def propose(self, block: torch.Tensor, block_step: int):
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
                                              self.generator)
            rev = revealed.cpu()
            tau[rev] = c + 1
            probs[rev] = p.cpu()[rev].to(probs.dtype)
        return Draft(states, state.to(block.device), tau, probs)

    # -- target verification -------------------------------------------------------------
    def verify_exact(self, draft: Draft, block_step: int):
        """Returns ``(new_block, steps_taken, accepted_tokens)``."""
        states = list(draft.states)
        bonus = bool((draft.final == self.mask_id).any())
        if bonus:
            states.append(draft.final)
        ids, pos, lab = exact_layout(states, self.row.cached["target"])
        logits = (yield Fwd("target", ids[0], pos[0], lab[0], "exact")).view(len(states), states[0].shape[0], -1)
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

    def verify_paper(self, block: torch.Tensor, draft: Draft):
        """Returns ``(new_block, steps_taken, accepted_tokens)``."""
        known = block != self.mask_id
        start = self.row.cached["target"]
        ids, pos, lab, m_index = paper_layout(block, known, draft.final, draft.tau.to(block.device), start,
                                              self.mask_id, self.dec.spec.rope_copy)
        logits = yield Fwd("target", ids[0], pos[0], lab[0], "paper")
        if self.dec.diagnostics is not None:
            yield from self.compare_with_exact(draft, logits, m_index)
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

    def program(self, tail: list):
        """The row's decoding; returns ``(generated, blocks)``."""
        cfg, spec, dec = self.cfg, self.dec.spec, self.dec
        B = cfg.block_length
        stops = set(dec.t.stop_ids)
        generated: list = []
        blocks = 0
        device = self.row.devices["target"]
        while True:
            block = new_block(tail, B, self.mask_id, device)
            first_gen, tail, block_step = len(tail), [], 0
            while bool((block == self.mask_id).any()):
                remaining = int((block == self.mask_id).sum())
                if spec.on_reject == "fallback" and remaining < dec.gamma:
                    block = yield from self.target_step(block, block_step)
                    block_step += 1
                    continue
                draft = yield from self.propose(block, block_step)
                self.stats.rounds += 1
                if spec.mode == "exact":
                    block, taken, acc = yield from self.verify_exact(draft, block_step)
                else:
                    block, taken, acc = yield from self.verify_paper(block, draft)
                self.stats.accepted += acc
                block_step += taken
            blocks += 1
            new = block[first_gen:].tolist()
            generated.extend(new)
            if stops.intersection(new) or len(generated) >= cfg.max_new_tokens:
                return generated, blocks
            yield self.row.commit("target", block)
            yield self.row.commit("draft", block.to(self.row.devices["draft"]))


def speculative_generate(target, draft, prompt_ids: list, cfg: DecodeConfig, spec: SpecConfig) -> GenerationResult:
    """Decode ``prompt_ids`` with SimSD (``spec.mode`` = ``paper`` or ``exact``).

    ``target``/``draft`` are :class:`simsd.loading.Checkpoint` objects sharing a tokenizer.
    ``stats`` adds to vanilla's: ``proposed, accepted, acceptance_rate`` (accepted / proposed
    draft tokens), ``rounds, accepted_per_round, draft_forwards, fallback_steps``.

    Raises:
        ValueError: mismatched draft/target vocabularies or mask ids, bad prompt, bad config.
    """
    return SpeculativeDecoder(target, draft, cfg, spec).generate(prompt_ids)


def speculative_generate_batch(target, draft, prompts: list, cfg: DecodeConfig, spec: SpecConfig,
                               first_index: int = 0, cuda_graphs: bool = False) -> BatchResult:
    """Decode ``prompts`` together with SimSD, each with independent progress (rounds,
    acceptance, stop); see :meth:`SpeculativeDecoder.generate_batch`."""
    return SpeculativeDecoder(target, draft, cfg, spec).generate_batch(prompts, first_index, cuda_graphs)
