"""Speculative decoding's settings and their rules, in one place: :class:`SpecConfig` (a
request's SimSD settings), the draft's own settings (:func:`draft_settings`,
:func:`draft_config`) and the combinations refused (:func:`check_gamma`, :func:`check_release`,
:func:`check_fold_commit`). The engine's and the requests' checks (:mod:`simsd.config.engine`,
:mod:`simsd.config.request`) call these. Torch-free.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .fields import PAPER_VARIANTS, SETTINGS, check_threshold, parse_strategy
from .vocabulary import SPECULATIVE, ParamError, check_fields, check_modes, opt

__all__ = ["MAX_ALTERNATIVES", "PAPER_VARIANTS", "SELF_DRAFT", "SpecConfig", "check_fold_commit", "check_gamma",
           "check_release", "check_self_draft", "draft_config", "draft_settings", "is_self_draft", "max_query_blocks",
           "parse_draft"]

#: the most alternatives a self-speculative tree proposes beside a step (the next most confident
#: position, the next most likely token; :mod:`simsd.speculative.tree`)
MAX_ALTERNATIVES = 2


def max_query_blocks(mode: str, gamma: int, self_draft: bool = False, width="auto") -> int:
    """Block copies in the longest forward of a row (the engine's cache margin): vanilla 2 (a
    folded commit and a block), a draft's exact or paper round ``gamma + 2`` (its steps, the bonus
    copy or the paper layout's slots, a folded commit), a self-speculative round its widest tree
    (``width`` copies, or with ``"auto"`` the root and ``1 +`` :data:`MAX_ALTERNATIVES` per
    proposed step), a lookahead's finished block and next block, and a folded commit."""
    if mode == "vanilla":
        return 2
    if not self_draft:
        return gamma + 2
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


def check_self_draft(settings) -> None:
    """:class:`ParamError` for settings that self-speculation has no use for or does not run
    (``settings``: a :class:`SpecConfig`, the engine's or a request's settings; fields it lacks
    are not checked): vanilla mode, paper mode's release variant (it re-drafts the whole block
    with a fresh schedule), optimistic drafting (there is no draft to run ahead), the draft's own
    device, strategy or threshold (the proposals are the target's)."""
    mode = getattr(settings, "mode", "exact")
    if mode not in ("exact", "paper"):
        raise ParamError("mode", f"{opt('draft', SELF_DRAFT)} runs in exact or paper mode; got {opt('mode', mode)}")
    if mode == "paper" and getattr(settings, "paper_variant", "described") != "described":
        raise ParamError("paper_variant", f"{opt('draft', SELF_DRAFT)} runs paper mode as described (the release "
                                          f"variant re-drafts the whole block with a fresh schedule)")
    for name in ("optimistic", "draft_device", "draft_strategy", "draft_threshold"):
        value = getattr(settings, name, None)
        if value is not None and value is not False:
            raise ParamError(name, f"{opt(name)}: {opt('draft', SELF_DRAFT)} has no draft model (the target "
                                   f"proposes its own next steps with its own strategy)")


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


def check_gamma(gamma: int | None, block_length: int) -> None:
    """:class:`ParamError` when ``gamma`` draft steps cannot fit a block of ``block_length``."""
    if gamma is not None and gamma > block_length:
        raise ParamError("gamma", f"{opt('gamma')} {gamma} exceeds the block length {block_length} (a block is "
                                  f"finished in at most {block_length} steps; valid: 1 to {block_length})")


def check_release(variant: str, gamma: int | None, on_reject: str, gamma_name: str = "gamma") -> None:
    """:class:`ParamError` for paper mode's release variant with a ``gamma`` (``gamma_name``: the
    setting that gave it) or ``on_reject`` fallback: it drafts the whole rest of the block every
    round."""
    if variant != "release" or (gamma is None and on_reject != "fallback"):
        return
    name = gamma_name if gamma is not None else "on_reject"
    raise ParamError(name, f"{opt(name)}: the release variant of paper mode ({opt('paper_variant', 'release')}) "
                           f"drafts the whole rest of the block every round (no gamma, no fallback)")


def check_fold_commit(fold_commit: bool, optimistic: bool | None, devices: str | None = None) -> None:
    """:class:`ParamError` for ``fold_commit`` with optimistic drafting: ``optimistic`` True, or
    None (auto) with the draft on another device than the target (``devices``: ``"draft !=
    target"``, None: the same device); optimistic rollback needs explicit draft commits."""
    if not fold_commit or optimistic is False or (optimistic is None and devices is None):
        return
    why = (opt("optimistic", True) if optimistic
           else f"optimistic drafting, on by default with {opt('draft_device')} {devices}")
    raise ParamError("fold_commit", f"{opt('fold_commit')} is not combined with {why} (its rollback needs "
                                    f"explicit draft commits); pass {opt('optimistic', False)} or drop "
                                    f"{opt('fold_commit')}")


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
        check_release(self.paper_variant, self.gamma, self.on_reject)
