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

from ..decoding.config import DecodeConfig, GenerationResult, Timer, check_prompt, finish
from ..decoding.vanilla import batch_stats, row_seeds
from ..engine.batching import BatchResult, engine_for
from .spec_row import Draft, SpecRow, Stats  # noqa: F401  (re-exported)

MODES = ("paper", "exact")
#: a row's draft generator (on the draft's device) is seeded ``seed + DRAFT_SEED_OFFSET``
DRAFT_SEED_OFFSET = 1 << 20


@dataclass
class SpecConfig:
    """``gamma``: draft steps verified per round (default: the block length).
    ``on_reject``: ``redraft`` (draft again for the remaining positions) or ``fallback`` (the
    paper: when fewer than ``gamma`` positions remain, the target finishes the block with vanilla
    denoising). ``rope_copy=False`` is the ablation of §4. ``optimistic``: draft the next round
    while the target verifies (:mod:`simsd.speculative.optimistic`); None = when draft and target are on
    different devices."""
    mode: str = "exact"
    gamma: int | None = None
    on_reject: str = "redraft"
    rope_copy: bool = True
    draft_strategy: str | None = None
    optimistic: bool | None = None

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


class SpeculativeDecoder:
    """Decodes prompts with a draft and a target checkpoint (see module doc); each prompt's
    round state lives in its own :class:`SpecRow`, driven by a :class:`BatchEngine`."""

    def __init__(self, target, draft, cfg: DecodeConfig, spec: SpecConfig, check: bool = True):
        if check:  # ``check=False``: the caller checked this pair already (one decoder per request)
            check_pair(target, draft)
        self.t, self.d, self.cfg, self.spec = target, draft, cfg, spec
        self.draft_cfg = dataclasses.replace(cfg, strategy=spec.draft_strategy or cfg.strategy)
        self.gamma = spec.gamma or cfg.block_length
        if self.gamma > cfg.block_length:
            raise ValueError(f"gamma {self.gamma} exceeds the block length {cfg.block_length}")
        self.mask_id = target.mask_token_id
        self.diagnostics = None  # dict: compare paper verification with exact (simsd bench)

    def generate(self, prompt_ids: list) -> GenerationResult:
        return self.generate_batch([prompt_ids]).results[0]

    def optimistic(self) -> bool:
        """Whether rows draft optimistically (``spec.optimistic``, or: draft and target on
        different devices)."""
        if self.spec.optimistic is None:
            return self.t.model.device != self.d.model.device
        return self.spec.optimistic

    def new_row(self, row, seed: int, stop_ids=None) -> SpecRow:
        """The :class:`SpecRow` of engine row ``row`` sampling with generators seeded ``seed``
        (target, on its device) and ``seed + DRAFT_SEED_OFFSET`` (draft); ``stop_ids``: default
        the target's."""
        return SpecRow(self, row, torch.Generator(self.t.model.device).manual_seed(seed), self.optimistic(),
                       torch.Generator(self.d.model.device).manual_seed(seed + DRAFT_SEED_OFFSET), stop_ids)

    def row_stats(self, r: SpecRow, n: int, blocks: int, seconds: float) -> dict:
        """Statistics of row ``r`` after ``n`` returned tokens and ``blocks`` blocks in
        ``seconds`` of decoding (see :func:`speculative_generate`)."""
        fw = r.row.forwards
        return {
            "mode": self.spec.mode,
            "new_tokens": n,
            "decode_seconds": seconds,
            "tokens_per_second": n / seconds if seconds > 0 else float("nan"),
            "target_forwards": fw["target"],
            "draft_forwards": fw["draft"],
            "target_forwards_per_token": fw["target"] / max(n, 1),
            "draft_forwards_per_token": fw["draft"] / max(n, 1),
            "prefill_forwards": r.row.prefill_forwards,
            "blocks": blocks,
            "gamma": self.gamma,
            **r.stats.as_dict(),
        }

    def generate_batch(self, prompts: list, first_index: int = 0, cuda_graphs: bool = False,
                       seeds: list | None = None) -> BatchResult:
        """Decode ``prompts`` together with independent progress; row ``i`` samples with
        generators seeded ``seeds[i]``, by default ``cfg.seed + first_index + i`` (target, on
        its device; see :func:`vanilla_generate_batch`) and that plus ``DRAFT_SEED_OFFSET`` (draft)."""
        cfg = self.cfg
        B = cfg.block_length
        capacity = max(check_prompt(p, self.t.config, cfg.max_new_tokens, B) for p in prompts)
        for p in prompts:
            check_prompt(p, self.d.config, cfg.max_new_tokens, B)
        engine = engine_for({"target": self.t.model, "draft": self.d.model}, B, len(prompts), capacity,
                            (self.gamma + 2) * B, cuda_graphs)
        tails = [engine.prefill(i, p) for i, p in enumerate(prompts)]
        seeds = row_seeds(cfg, len(prompts), first_index, seeds)
        rows = [self.new_row(engine.rows[i], seeds[i]) for i in range(len(prompts))]
        with Timer(self.t.model.device) as timer:
            outs = engine.run([r.program(tail) for r, tail in zip(rows, tails)])
        results = []
        for r, (generated, blocks) in zip(rows, outs):
            token_ids = finish(generated, self.t.stop_ids, cfg.max_new_tokens)
            stats = self.row_stats(r, len(token_ids), blocks, timer.seconds)
            stats["batch_size"] = len(prompts)
            results.append(GenerationResult(token_ids, stats))
        return BatchResult(results, batch_stats(results, timer.seconds, engine.forwards))


def speculative_generate(target, draft, prompt_ids: list, cfg: DecodeConfig, spec: SpecConfig) -> GenerationResult:
    """Decode ``prompt_ids`` with SimSD (``spec.mode`` = ``paper`` or ``exact``).

    ``target``/``draft`` are :class:`simsd.models.loading.Checkpoint` objects sharing a tokenizer.
    ``stats`` adds to vanilla's: ``proposed, accepted, acceptance_rate`` (accepted / proposed
    draft tokens), ``rounds, accepted_per_round, draft_forwards, fallback_steps``.

    Raises:
        ValueError: mismatched draft/target vocabularies or mask ids, bad prompt, bad config.
    """
    return SpeculativeDecoder(target, draft, cfg, spec).generate(prompt_ids)


def speculative_generate_batch(target, draft, prompts: list, cfg: DecodeConfig, spec: SpecConfig,
                               first_index: int = 0, cuda_graphs: bool = False,
                               seeds: list | None = None) -> BatchResult:
    """Decode ``prompts`` together with SimSD, each with independent progress (rounds,
    acceptance, stop); see :meth:`SpeculativeDecoder.generate_batch`."""
    return SpeculativeDecoder(target, draft, cfg, spec).generate_batch(prompts, first_index, cuda_graphs, seeds)
