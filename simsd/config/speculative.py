"""Speculative decoding's settings and their rules, in one place: :class:`SpecConfig` (a
request's SimSD settings), the draft's own settings (:func:`draft_settings`,
:func:`draft_config`) and the combinations refused (:data:`SPECULATIVE_RULES`), which the
engine's and the requests' checks (:mod:`simsd.config.engine`, :mod:`simsd.config.request`) and
the speculative decoder all run. Torch-free.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .fields import PAPER_VARIANTS, SETTINGS, check_threshold, parse_strategy
from .vocabulary import SPECULATIVE, Rule, check_fields, check_modes, check_rules, opt

__all__ = ["ALTERNATIVES", "LEFTMOST", "LOGIT_ALTERNATIVES", "MAX_ALTERNATIVES", "NGRAM", "PAPER_VARIANTS",
           "SELF_DRAFT", "SPECULATIVE_RULES", "SpecConfig", "draft_config", "draft_settings", "is_self_draft",
           "max_query_blocks", "parse_draft"]

#: ``rank`` of an alternative whose tokens are the row's history's predictions
#: (:mod:`simsd.speculative.ngram`) instead of the logits'
NGRAM = -1
#: ``skip`` of an alternative that reveals the leftmost MASK positions (as many as the step
#: reveals) instead of the most confident ones
LEFTMOST = -1
#: the alternatives a self-speculative tree may propose beside a step, in the order they are
#: added (:func:`simsd.speculative.tree.step_candidates`): ``(skip, rank)``, the strategy's choice
#: with its ``skip`` most confident positions left out (:data:`LEFTMOST`: the leftmost MASK
#: positions instead) and the ``rank``-th runner-up token at its most confident one, or (``rank``
#: :data:`NGRAM`) the history's prediction at each position it reveals. The logits' order is how
#: often each outcome was the target's next step, predicted from the logits one step older (the
#: bundled target, greedy, 8 held-out prompts: primary 46%, then 9.3%, 8.7%, 4.1%, 3.9%, 2.8% of
#: 389 steps; 23% had the token at rank 3 or below); the history's predictions come last (a draft
#: model's alternatives are the logits' only, :data:`LOGIT_ALTERNATIVES`)
ALTERNATIVES = ((1, 0), (0, 1), (1, 1), (2, 0), (0, 2), (0, NGRAM), (1, NGRAM), (2, NGRAM), (LEFTMOST, NGRAM))
#: the most alternatives beside a step
MAX_ALTERNATIVES = len(ALTERNATIVES)
#: the alternatives built from logits alone (the first ones)
LOGIT_ALTERNATIVES = sum(rank != NGRAM for _, rank in ALTERNATIVES)


def max_query_blocks(mode: str, gamma: int, self_draft: bool = False, width="auto") -> int:
    """Block copies in the longest forward of a row (the engine's cache margin): vanilla 2 (a
    folded commit and a block), a draft's exact or paper round ``gamma + 2`` (its steps, the bonus
    copy or the paper layout's slots, a folded commit; with a ``width`` N, at most N copies of its
    steps and their alternatives and a folded commit), a self-speculative round its widest tree
    (``width`` copies, or with ``"auto"`` the root and ``1 +`` :data:`MAX_ALTERNATIVES` per
    proposed step), a lookahead's finished block and next block, and a folded commit."""
    if mode == "vanilla":
        return 2
    if not self_draft:
        return gamma + 2 if width == "auto" else max(gamma + 2, int(width) + 1)
    return (1 + (1 + MAX_ALTERNATIVES) * gamma if width == "auto" else int(width)) + 3


#: the draft that is the target itself (``--draft self``, ``LLM(draft="self")``): self-speculation,
#: proposals from the target's own logits, no draft model (:mod:`simsd.speculative.self_draft`)
SELF_DRAFT = "self"


def is_self_draft(draft) -> bool:
    """Whether ``draft`` (a checkpoint, a path, or the string ``"self"``) asks for
    self-speculation (a ``Path`` never does: a checkpoint directory named ``self`` is ``./self``)."""
    return isinstance(draft, str) and draft == SELF_DRAFT


def parse_draft(value, name: str = "draft"):
    """The ``draft`` setting as kept: ``"self"`` (:data:`SELF_DRAFT`), another string as a
    ``Path``, a path or a checkpoint object as given."""
    if isinstance(value, str):
        return SELF_DRAFT if value == SELF_DRAFT else Path(value)
    return value


def draft_settings(strategy: str, threshold, draft_strategy, draft_threshold) -> tuple:
    """The draft's ``(strategy, threshold)``: its own when given; else the target's strategy, and
    the target's threshold only when the strategies are the same (a confidence threshold is
    not an entropy bound); None = the strategy's default. The draft threshold is checked
    against the draft strategy's range (:class:`ParamError`)."""
    d_strategy = parse_strategy(draft_strategy, "draft_strategy") if draft_strategy is not None else strategy
    check_threshold(d_strategy, draft_threshold, "draft_threshold")
    if draft_threshold is not None:
        return d_strategy, draft_threshold
    return d_strategy, (threshold if d_strategy == strategy else None)


def _release_gamma(s) -> str:
    return "gamma" if s.gamma is not None else "max_gamma" if s.max_gamma is not None else "on_reject"


def _optimistic(s) -> str:
    return (opt("optimistic", True) if s.optimistic
            else f"optimistic drafting, on by default with {opt('draft_device')} {s.apart}")


#: the draft settings that self-speculation has no use for (there is no draft model), each with
#: an example of the refusal (:attr:`~simsd.config.vocabulary.Rule.example`)
NO_DRAFT_MODEL = {"optimistic": ({"draft": SELF_DRAFT, "optimistic": True}, {}),
                  "draft_device": ({"draft": SELF_DRAFT, "draft_device": "cpu"}, {}),
                  "draft_strategy": ({"draft": SELF_DRAFT}, {"draft_strategy": "static"}),
                  "draft_threshold": ({"draft": SELF_DRAFT}, {"strategy": "dynamic", "draft_threshold": 0.5})}

#: The refused combinations of speculative settings (:class:`~simsd.config.vocabulary.Rule`),
#: read from whatever settings a layer holds (:func:`~simsd.config.vocabulary.check_rules`): an
#: engine's (:class:`~simsd.config.engine.EngineArgs`, with ``apart``: ``"draft != target"``
#: when the draft's device differs, else None), a request's against its engine
#: (:func:`~simsd.config.request.check_request`), a :class:`SpecConfig`, and the speculative
#: decoder's (its ``draft``, ``apart`` and a request's configs). A rule on a setting the layer
#: does not hold does not fire.
SPECULATIVE_RULES = (
    Rule(_release_gamma, lambda s: s.paper_variant == "release" and (s.gamma is not None or s.max_gamma is not None
                                                                    or s.on_reject == "fallback"),
         lambda s: f"{opt(_release_gamma(s))}: the release variant of paper mode ({opt('paper_variant', 'release')}) "
                   f"drafts the whole rest of the block every round (no gamma, no fallback)",
         ({"mode": "paper", "paper_variant": "release", "on_reject": "fallback"}, {})),
    Rule("paper_variant", lambda s: is_self_draft(s.draft) and s.mode == "paper" and s.paper_variant == "release",
         lambda s: f"{opt('draft', SELF_DRAFT)} runs paper mode as described (the release variant re-drafts the "
                   f"whole block with a fresh schedule)",
         ({"mode": "paper", "draft": SELF_DRAFT, "paper_variant": "release"}, {})),
) + tuple(
    Rule(name, lambda s, name=name: is_self_draft(s.draft) and getattr(s, name) not in (None, False),
         lambda s, name=name: f"{opt(name)}: {opt('draft', SELF_DRAFT)} has no draft model (the target proposes its "
                              f"own next steps with its own strategy)",
         example)
    for name, example in NO_DRAFT_MODEL.items()
) + (
    Rule("gamma", lambda s: None not in (s.gamma, s.block_length) and s.gamma > s.block_length,
         lambda s: f"{opt('gamma')} {s.gamma} exceeds the block length {s.block_length} (a block is finished in at "
                   f"most {s.block_length} steps; valid: 1 to {s.block_length})",
         ({}, {"gamma": 9})),
    Rule("gamma", lambda s: None not in (s.gamma, s.max_gamma) and s.gamma > s.max_gamma,
         lambda s: f"{opt('gamma')} {s.gamma} exceeds this LLM's {opt('max_gamma')} {s.max_gamma} (its caches hold "
                   f"the verify forwards of at most that many draft steps)",
         ({"max_gamma": 2}, {"gamma": 3})),
    Rule("on_reject", lambda s: s.mode in SPECULATIVE and s.on_reject == "fallback" and s.gamma == 1,
         lambda s: f"{opt('on_reject', 'fallback')} with {opt('gamma', 1)} never falls back (it finishes a block "
                   f"when fewer than gamma positions remain)",
         ({"on_reject": "fallback"}, {"gamma": 1})),
    Rule("fold_commit", lambda s: bool(s.fold_commit) and s.mode in SPECULATIVE and (
            s.optimistic or (s.optimistic is None and s.apart is not None)),
         lambda s: f"{opt('fold_commit')} is not combined with {_optimistic(s)} (its rollback needs explicit draft "
                   f"commits); pass {opt('optimistic', False)} or drop {opt('fold_commit')}",
         ({"fold_commit": True, "optimistic": True}, {})),
)


def draft_config(cfg, spec: SpecConfig):
    """The draft's decoding settings: ``cfg`` with the draft's strategy and threshold (see
    :class:`SpecConfig`).

    Raises:
        ParamError: a draft threshold outside the draft strategy's range.
    """
    strategy, threshold = draft_settings(cfg.strategy, cfg.threshold, spec.draft_strategy, spec.draft_threshold)
    return dataclasses.replace(cfg, strategy=strategy, threshold=threshold)


@dataclass
class SpecConfig:
    """``gamma``: draft steps verified per round (default: the block length).
    ``on_reject``: ``redraft`` (draft again for the remaining positions) or ``fallback`` (the
    paper: when fewer than ``gamma`` positions remain, the target finishes the block with vanilla
    denoising). ``rope_copy=False`` is the ablation of §4. ``optimistic``: draft the next round
    while the target verifies (:mod:`simsd.speculative.optimistic`); None = when draft and target are on
    different devices; never combined with ``cfg.fold_commit``, which raises).

    The draft's own settings: ``draft_strategy`` (default: the target's strategy) and
    ``draft_threshold`` (default: the target's ``threshold`` when the draft runs the same
    strategy, else the draft strategy's default, since a confidence threshold is not an
    entropy bound); the draft shares the target's steps schedule and sampling parameters.

    ``paper_variant`` (paper mode): ``described`` (the paper: acceptance in the draft's
    temporal order) or ``release`` (the SimSD release's loop, docs/design.md §4.3; it drafts
    the whole rest of the block every round, so it takes no ``gamma`` and no fallback).

    ``speculation_width`` (self-speculation, ``draft="self"``): the most block copies of a
    verify forward, or ``"auto"`` (:mod:`simsd.speculative.width`)."""
    mode: str = dataclasses.replace(SETTINGS["mode"], choices=SPECULATIVE).field("exact")
    gamma: int | None = SETTINGS["gamma"].field(None)
    on_reject: str = SETTINGS["on_reject"].field("redraft")
    rope_copy: bool = SETTINGS["rope_copy"].field(True)
    draft_strategy: str | None = SETTINGS["draft_strategy"].field(None)
    optimistic: bool | None = SETTINGS["optimistic"].field(None)
    draft_threshold: float | None = SETTINGS["draft_threshold"].field(None)
    paper_variant: str = SETTINGS["paper_variant"].field("described")
    speculation_width: object = SETTINGS["speculation_width"].field("auto")

    def __post_init__(self):
        check_fields(self)
        given = {}
        if self.paper_variant != "described":
            given["paper_variant"] = SETTINGS["paper_variant"]
        if self.speculation_width != "auto":
            given["speculation_width"] = SETTINGS["speculation_width"]
        check_modes(given, [self.mode])
        check_rules(SPECULATIVE_RULES, self)
