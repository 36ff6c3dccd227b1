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

from .decoding import (DecodeConfig, GenerationResult, SequenceRunner, Timer, check_prompt, denoise_step, finish,
                       without_mask_token)
from .sampling import filtered_probs
from .vanilla import new_block
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
    """Decodes one prompt with a draft and a target checkpoint (see module doc)."""

    def __init__(self, target, draft, cfg: DecodeConfig, spec: SpecConfig):
        check_pair(target, draft)
        self.t, self.d, self.cfg, self.spec = target, draft, cfg, spec
        self.draft_cfg = dataclasses.replace(cfg, strategy=spec.draft_strategy or cfg.strategy)
        self.gamma = spec.gamma or cfg.block_length
        self.mask_id = target.mask_token_id
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.stats = Stats()
        self.diagnostics = None  # dict: compare paper verification with exact (simsd bench)

    # -- draft ---------------------------------------------------------------------------
    def propose(self, block: torch.Tensor, block_step: int) -> Draft:
        dev = self.d.model.device
        state = block.to(dev)
        L = state.shape[0]
        tau = torch.full((L,), TAU_INF, dtype=torch.int64)
        probs = torch.zeros(L, self.d.config.vocab_size)
        states = []
        for c in range(self.gamma):
            if not bool((state == self.mask_id).any()):
                break
            states.append(state.to(block.device))
            logits = self.draft_runner.denoise_logits(state)
            state, revealed, p = denoise_step(logits, state, self.mask_id, self.draft_cfg, block_step + c,
                                              self.generator)
            rev = revealed.cpu()
            tau[rev] = c + 1
            probs[rev] = p.cpu()[rev]
        return Draft(states, state.to(block.device), tau, probs)

    # -- target verification -------------------------------------------------------------
    def verify_exact(self, draft: Draft, block_step: int):
        """Returns ``(new_block, steps_taken, accepted_tokens)``."""
        states = list(draft.states)
        bonus = bool((draft.final == self.mask_id).any())
        if bonus:
            states.append(draft.final)
        logits = self.target_runner.exact_logits(states)
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
        self.target_runner.flush()  # the paper layout has no place for a folded commit
        start = self.target_runner.cached
        ids, pos, lab, m_index = paper_layout(block, known, draft.final, draft.tau.to(block.device), start,
                                              self.mask_id, self.spec.rope_copy)
        logits = self.target_runner.forward(ids, pos, lab, "paper")[0]
        if self.diagnostics is not None:
            self.compare_with_exact(draft, logits, m_index)
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

    def compare_with_exact(self, draft: Draft, paper_logits, m_index) -> None:
        """Diagnostics (``simsd bench``): paper vs exact verification distributions, untimed and
        not counted as a target forward."""
        ids, pos, lab = exact_layout(draft.states, self.target_runner.cached)
        runner = self.target_runner
        exact = runner.model(ids, pos, lab, "exact", runner.cache)[0].view(draft.n, draft.final.shape[0], -1)
        for p in torch.nonzero(draft.tau <= draft.n).flatten().tolist():
            e = torch.log_softmax(without_mask_token(exact[int(draft.tau[p]) - 1, p], self.mask_id).double(), -1)
            a = torch.log_softmax(without_mask_token(paper_logits[int(m_index[p])], self.mask_id).double(), -1)
            self.diagnostics["agree"] += int(e.argmax() == a.argmax())
            self.diagnostics["kl"] += float((e.exp() * (e - a)).nan_to_num().sum())
            self.diagnostics["total"] += 1

    # -- main loop -----------------------------------------------------------------------
    def target_step(self, block: torch.Tensor, block_step: int) -> torch.Tensor:
        logits = self.target_runner.denoise_logits(block)
        block, _, _ = denoise_step(logits, block, self.mask_id, self.cfg, block_step, self.generator)
        self.stats.fallback_steps += 1
        return block

    def generate(self, prompt_ids: list) -> GenerationResult:
        cfg = self.cfg
        B = cfg.block_length
        capacity = check_prompt(prompt_ids, self.t.config, cfg.max_new_tokens, B)
        check_prompt(prompt_ids, self.d.config, cfg.max_new_tokens, B)
        self.target_runner = SequenceRunner(self.t.model, B, capacity)
        self.draft_runner = SequenceRunner(self.d.model, B, capacity)
        stops = set(self.t.stop_ids)
        tail = self.target_runner.prefill(prompt_ids)
        self.draft_runner.prefill(prompt_ids)
        generated: list = []
        blocks = 0
        device = self.t.model.device
        with Timer(device) as timer:
            while True:
                block = new_block(tail, B, self.mask_id, device)
                first_gen, tail, block_step = len(tail), [], 0
                while bool((block == self.mask_id).any()):
                    remaining = int((block == self.mask_id).sum())
                    if self.spec.on_reject == "fallback" and remaining < self.gamma:
                        block = self.target_step(block, block_step)
                        block_step += 1
                        continue
                    draft = self.propose(block, block_step)
                    self.stats.rounds += 1
                    if self.spec.mode == "exact":
                        block, taken, acc = self.verify_exact(draft, block_step)
                    else:
                        block, taken, acc = self.verify_paper(block, draft)
                    self.stats.accepted += acc
                    block_step += taken
                blocks += 1
                new = block[first_gen:].tolist()
                generated.extend(new)
                if stops.intersection(new) or len(generated) >= cfg.max_new_tokens:
                    break
                self.target_runner.commit(block, fold=cfg.fold_commit)
                self.draft_runner.commit(block.to(self.d.model.device), fold=cfg.fold_commit)
        token_ids = finish(generated, self.t.stop_ids, cfg.max_new_tokens)
        n = len(token_ids)
        stats = {
            "mode": self.spec.mode,
            "new_tokens": n,
            "decode_seconds": timer.seconds,
            "tokens_per_second": n / timer.seconds if timer.seconds > 0 else float("nan"),
            "target_forwards": self.target_runner.forwards,
            "draft_forwards": self.draft_runner.forwards,
            "target_forwards_per_token": self.target_runner.forwards / max(n, 1),
            "draft_forwards_per_token": self.draft_runner.forwards / max(n, 1),
            "prefill_forwards": self.target_runner.prefill_forwards,
            "blocks": blocks,
            "gamma": self.gamma,
            **self.stats.as_dict(),
        }
        return GenerationResult(token_ids, stats)


def speculative_generate(target, draft, prompt_ids: list, cfg: DecodeConfig, spec: SpecConfig) -> GenerationResult:
    """Decode ``prompt_ids`` with SimSD (``spec.mode`` = ``paper`` or ``exact``).

    ``target``/``draft`` are :class:`simsd.loading.Checkpoint` objects sharing a tokenizer.
    ``stats`` adds to vanilla's: ``proposed, accepted, acceptance_rate`` (accepted / proposed
    draft tokens), ``rounds, accepted_per_round, draft_forwards, fallback_steps``.

    Raises:
        ValueError: mismatched draft/target vocabularies or mask ids, bad prompt, bad config.
    """
    return SpeculativeDecoder(target, draft, cfg, spec).generate(prompt_ids)
