"""SimSD speculative decoding: a draft dLLM proposes, the target verifies in one forward.

Modes (docs/design.md §4):

* ``paper``: the paired ``[leftover | D | M]`` layout with RoPE copy and the four-quadrant
  temporal mask; greedy matching or rejection sampling in the draft's temporal order
  (``paper_variant="described"``, the paper), or as the SimSD release's code does it
  (``paper_variant="release"``: position order, the accepted prefix plus the target's token,
  the rest re-drafted with a fresh schedule, no bonus token; :class:`~simsd.speculative.verifiers.ReleaseVerifier`).
* ``exact``: one block copy per verified draft step (§4.1, §4.2); each draft step is accepted
  only if it equals the target's own decision at that state (positions and tokens; under
  sampling with the same keyed noise as vanilla decoding, :mod:`simsd.decoding.noise`), so the
  output is token-identical to vanilla decoding with the target and the same seed, for any
  draft, strategy and temperature (given equal logits: see ``SDARForCausalLM.invariant``). A
  last "bonus" copy of the draft's final state lets the target take one more step of its own
  when every draft step is accepted and the block is not full.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.speculative import (
    SELF_DRAFT,
    SPECULATIVE_RULES,
    SpecConfig,
    draft_config,
    is_self_draft,
    max_query_blocks,
)
from ..config.vocabulary import SPECULATIVE, check_rules
from ..decoding.config import BatchResult, DecodeConfig, GenerationResult, check_prompt
from ..decoding.program import generate_batch, row_seeds
from ..engine.batching import BatchEngine, round_capacity
from .self_draft import SelfExactVerifier, SelfPaperVerifier
from .spec_row import SpecRow
from .verifiers import PAPER_VERIFIERS, VERIFIERS

MODES = SPECULATIVE
#: paper mode as the paper describes it, or as the SimSD release's code runs it (the verifier of each)
PAPER_VARIANTS = tuple(PAPER_VERIFIERS)


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


@dataclass(frozen=True)
class SpecPlan:
    """One request's speculative settings, checked (:meth:`SpeculativeDecoder.plan_for`):
    ``cfg`` (the target's decoding settings), ``spec``, ``draft_cfg`` (the draft's,
    :func:`draft_config`) and ``gamma`` (draft steps verified per round: ``spec.gamma`` or the
    block length)."""
    cfg: DecodeConfig
    spec: SpecConfig
    draft_cfg: DecodeConfig
    gamma: int


class SpeculativeDecoder:
    """Decodes prompts with a draft and a target checkpoint (see module doc); each prompt's
    round state lives in its own :class:`SpecRow` (a row program the scheduler drives).
    ``draft="self"`` (:data:`~simsd.config.speculative.SELF_DRAFT`): self-speculation, the target
    proposes its own next steps from its verify logits (:mod:`simsd.speculative.self_draft`;
    exact mode; no draft model, no draft forward).

    ``cfg`` and ``spec`` are the decoder's settings (:attr:`plan`); the engine-wide ones
    (``cfg.fold_commit``, ``spec.mode``, ``spec.paper_variant``, ``spec.optimistic``) hold for every
    row, and a row may decode with other request settings (:meth:`plan_for`, :meth:`new_row`):
    :class:`simsd.LLM` keeps one decoder for all its requests.

    ``verifier_class``: the rows' verifier, ``verifier_class(cfg, spec, mask_id, seed)``
    (default: the mode's, :data:`simsd.speculative.verifiers.VERIFIERS`); a subclass replaces a
    rule (``simsd bench``'s comparison with exact mode, ``bench/bench_coupling.py``).

    Raises:
        ValueError: a pair that does not share the tokenizer (:func:`check_pair`, unless
            ``check=False``: the caller checked it); :class:`ParamError` for refused settings
            (``gamma`` past the block length, ``fold_commit`` with optimistic drafting).
    """

    def __init__(self, target, draft, cfg: DecodeConfig, spec: SpecConfig, check: bool = True):
        self.self_draft = is_self_draft(draft)
        if self.self_draft:
            draft = None
        elif check:
            check_pair(target, draft)
        self.t, self.d = target, draft
        t = target.model.device
        d = t if draft is None else draft.model.device
        self.apart = f"{d} != {t}" if d != t else None  # the draft's device, for the fold_commit rule
        self.mask_id = target.mask_token_id
        if self.self_draft:
            self.verifier_class = SelfPaperVerifier if spec.mode == "paper" else SelfExactVerifier
        else:
            self.verifier_class = PAPER_VERIFIERS[spec.paper_variant] if spec.mode == "paper" else VERIFIERS[spec.mode]
        self.plan = self.plan_for(cfg, spec)

    def plan_for(self, cfg: DecodeConfig, spec: SpecConfig) -> SpecPlan:
        """The checked :class:`SpecPlan` of a request's settings (:class:`ParamError`: a ``gamma``
        past the block length, a draft threshold out of the draft strategy's range, a draft
        setting with ``draft="self"``)."""
        check_rules(SPECULATIVE_RULES, spec, cfg, {"draft": SELF_DRAFT if self.self_draft else None,
                                                   "apart": self.apart})
        return SpecPlan(cfg, spec, draft_config(cfg, spec), spec.gamma or cfg.block_length)

    def generate(self, prompt_ids: list) -> GenerationResult:
        return self.generate_batch([prompt_ids]).results[0]

    def optimistic(self) -> bool:
        """Whether rows draft optimistically (``spec.optimistic``, or: draft and target on
        different devices)."""
        if self.self_draft:
            return False
        if self.plan.spec.optimistic is None:
            return self.t.model.device != self.d.model.device
        return self.plan.spec.optimistic

    def new_row(self, row, seed: int, stop_ids=None, plan: SpecPlan | None = None,
                verifier_class=None) -> SpecRow:
        """The row program (:class:`SpecRow`) of engine row ``row``, sampling with the keyed
        noise of row seed ``seed``; ``stop_ids``: default the target's; ``plan``: the request's
        settings (default: the decoder's); ``verifier_class``: default the decoder's."""
        return SpecRow(self, plan or self.plan, row, seed, self.optimistic(), stop_ids,
                       verifier_class or self.verifier_class)

    def generate_batch(self, prompts: list, first_index: int = 0, cuda_graphs: bool = False,
                       seeds: list | None = None) -> BatchResult:
        """Decode ``prompts`` together with independent progress; row ``i`` samples with the
        keyed noise of :mod:`simsd.decoding.noise` under the row seed ``seeds[i]``, by default
        ``cfg.seed + first_index + i`` (as :func:`vanilla_generate_batch`: exact mode gives the
        same tokens as vanilla decoding with the same seed). One engine per call (captured CUDA
        graphs are reused by :class:`simsd.LLM`, which keeps its engine)."""
        cfg = self.plan.cfg
        block_length = cfg.block_length
        capacities = [check_prompt(p, self.t.config, cfg.max_new_tokens, block_length, self.mask_id)
                      for p in prompts]
        models = {"target": self.t.model}
        if self.d is not None:
            for p in prompts:
                check_prompt(p, self.d.config, cfg.max_new_tokens, block_length, self.mask_id)
            models["draft"] = self.d.model
        margin = max_query_blocks(self.plan.spec.mode, self.plan.gamma, self.self_draft,
                                  self.plan.spec.speculation_width) * block_length
        engine = BatchEngine(models, block_length, len(prompts), round_capacity(max(capacities)), margin,
                             cuda_graphs=cuda_graphs)
        seeds = row_seeds(cfg, len(prompts), first_index, seeds)
        return generate_batch(engine, prompts, capacities, lambda row, i: self.new_row(row, seeds[i]))


def speculative_generate(target, draft, prompt_ids: list, cfg: DecodeConfig, spec: SpecConfig) -> GenerationResult:
    """Decode ``prompt_ids`` with SimSD (``spec.mode`` = ``paper`` or ``exact``; paper mode as
    described or as released, ``spec.paper_variant``).

    ``target``/``draft`` are :class:`simsd.models.loading.Checkpoint` objects sharing a tokenizer.
    ``stats`` adds to vanilla's (see :class:`simsd.speculative.spec_row.Stats` and docs/statistics.md,
    "Statistics"): ``proposed`` (every token the draft revealed in every verified step),
    ``accepted``, ``acceptance_rate`` (accepted / proposed), ``target_tokens`` (chosen by the
    target; ``accepted + target_tokens = new_tokens + cut_tokens``), ``from_draft`` (returned
    tokens that came from the draft, at most ``new_tokens``), ``draft_share`` (from_draft /
    new_tokens), ``rounds, accepted_per_round, draft_forwards, fallback_steps``.

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
