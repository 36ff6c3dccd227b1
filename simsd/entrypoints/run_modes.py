"""The columns of ``simsd bench`` and ``simsd eval`` (``--modes``): a label per way of decoding
the same prompts, each an :class:`~simsd.entrypoints.api.LLM` of one mode. Torch-free (the
command line checks ``--modes`` before torch loads)."""
from __future__ import annotations

from typing import NamedTuple

from ..config.speculative import SELF_DRAFT


class RunMode(NamedTuple):
    """What a column runs: the LLM's ``mode``; its ``paper_variant`` (None: the run's own,
    ``--paper-variant``); its ``draft`` (None: the run's own, ``--draft``; ``"self"``:
    self-speculation, no draft model)."""
    mode: str
    paper_variant: str | None = None
    draft: str | None = None


#: ``--modes`` labels -> what each column runs
RUN_MODES = {
    "vanilla": RunMode("vanilla"),
    "paper": RunMode("paper"),
    "paper-release": RunMode("paper", "release"),  # paper mode as the SimSD release runs it
    "exact": RunMode("exact"),
    "exact-self": RunMode("exact", draft=SELF_DRAFT),  # exact mode, the target proposing its own steps
}


def base_modes(labels: list) -> list:
    """The decoding modes of ``labels``, each once, in order."""
    return list(dict.fromkeys(RUN_MODES[label].mode for label in labels))


def needs_draft_model(labels: list, draft) -> bool:
    """Whether a column of ``labels`` runs a draft model (``draft``: the run's ``--draft``)."""
    from ..config.speculative import is_self_draft
    return any(RUN_MODES[label].mode != "vanilla" and RUN_MODES[label].draft is None and not is_self_draft(draft)
               for label in labels)
