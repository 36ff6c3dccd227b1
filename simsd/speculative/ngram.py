"""Prompt lookup: a row's next tokens predicted from its own history (docs/design.md §4.4).

Self-speculation's proposals come from logits one step old; a step whose token was far down
those logits is out of their reach. Text repeats itself (code's names, a formula's terms, a
model's own loops), and the SimSD paper lets reference tokens come "from previously decoded
trajectories": :class:`NgramIndex` predicts a position's token as the token that followed the
latest earlier occurrence of the ``n`` tokens before it (the longest ``n`` from ``max_n`` down to
``min_n`` that occurred), as vLLM's ``ngram`` speculative method (prompt lookup decoding) does
for left-to-right models. A block diffusion step reveals positions in any order, so
:meth:`NgramIndex.fill` predicts every MASK position of a block left to right, each from the
history, the block's known tokens and the predictions before it; the proposal tree puts them at
the positions the strategy would reveal (:func:`~simsd.speculative.tree.step_candidates`). A
prediction is a proposal like any other: exact verification keeps the output vanilla's.

Host work only: a dict from each ``n``-gram of the history to the index after its latest
occurrence, extended as blocks are committed (O(1) per token and lookup). Measured on this
project's CPU machine: indexing a 32768-token prompt of distinct-ish tokens takes ~0.08 s (once
per request, at its first round) and ~12 MB of host memory (three keys per token; text that
repeats itself needs fewer); a block's predictions ~2 us.
"""
from __future__ import annotations


class NgramIndex:
    """The ``n``-grams of one row's token history (module doc).

    Args:
        max_n, min_n: the longest and shortest context matched (``1 <= min_n <= max_n``).

    Raises:
        ValueError: ``min_n`` or ``max_n`` out of range.
    """

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list = []
        self.after: dict = {}  # n-gram tuple -> index of the token that followed its latest occurrence

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Append ``tokens`` (ids) to the history."""
        for t in tokens:
            i = len(self.tokens)  # the new token follows the n-grams ending at i - 1
            for n in range(self.min_n, self.max_n + 1):
                if i >= n:
                    self.after[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(int(t))

    def follow(self, prompt: list, generated: list, first: int = 0) -> None:
        """Index what a row holds before its current block, the new tokens only: its ``prompt``
        ids but the last ``first`` (the prompt's tail inside the first decode block), then its
        ``generated`` ids (whole blocks; the prompt's tail is theirs once its block is done).

        Raises:
            ValueError: fewer tokens than indexed already (a row's history only grows)."""
        before = len(prompt) - first  # the whole prompt once the first block is done (first = 0)
        if len(self.tokens) > before + len(generated):
            raise ValueError(f"a row's history of {before + len(generated)} tokens is shorter than the "
                             f"{len(self.tokens)} indexed")
        if len(self.tokens) < before:
            self.extend(prompt[len(self.tokens):before])
        if len(self.tokens) >= len(prompt):
            self.extend(generated[len(self.tokens) - len(prompt):])

    def predict(self, context: list):
        """The token after ``context`` (its last tokens matched, the longest first), or None."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            at = self.after.get(tuple(context[-n:]))
            if at is not None:
                return self.tokens[at]
        return None

    def fill(self, block: list, mask_id: int, before=()) -> list:
        """A prediction of every MASK position of ``block`` (host ids, after the history and then
        ``before``: ids of a block assumed in between, ``mask_id`` where unknown), left to right:
        each from the history, the block's tokens before it and the predictions there; ``mask_id``
        where there is none (the positions after it predicted without it)."""
        context = self.tokens[-self.max_n:]
        for t in before:
            context = [] if t == mask_id else (context + [t])[-self.max_n:]
        out = []
        for t in block:
            if t == mask_id:
                t = self.predict(context)
                out.append(mask_id if t is None else t)
                context = [] if t is None else context + [t]
            else:
                out.append(t)
                context = context + [t]
            context = context[-self.max_n:]
        return out
