"""Speculative: SimSD, a draft dLLM proposes and the target verifies in one forward (docs/design.md §4).

Holds the decoder and its settings (``decoder``: ``paper`` (as described or as released) and
``exact`` modes, batches), one request's rounds as an engine program (``spec_row``: draft,
verify, accept, commit, fallback steps), the verifier of each mode (``verifiers``: a round's
verify forward and its verdict),
the verification layouts and verdicts (``verification``: the paired ``[leftover | D | M]``
layout with RoPE copy, the exact copies, greedy matching, rejection sampling, acceptance in
the draft's temporal order) and optimistic drafting with rollback (``optimistic``).

May import: :mod:`simsd.decoding`, :mod:`simsd.engine`, :mod:`simsd.models`,
:mod:`simsd_kernels`, torch. Never :mod:`simsd.entrypoints`.
"""
from .decoder import (
    MODES,
    PAPER_VARIANTS,
    SpecConfig,
    SpeculativeDecoder,
    speculative_generate,
    speculative_generate_batch,
)

__all__ = ["MODES", "PAPER_VARIANTS", "SpecConfig", "SpeculativeDecoder", "speculative_generate",
           "speculative_generate_batch"]
