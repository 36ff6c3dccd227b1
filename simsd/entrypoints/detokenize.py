"""Text of a growing generation: increments that never split a character, stop handling.

Byte-level BPE tokenizers (Qwen's, SDAR's) spread one multi-byte UTF-8 character over several
tokens; decoding a prefix that ends inside such a character gives U+FFFD. The increments of
:class:`IncrementalDetokenizer` hold text back until the character is complete, decoding a
short window of tokens around the new ones (the offsets scheme of vLLM's and transformers'
streamers, so that tokenizers that merge spaces across tokens decode right as well).

:class:`TextStream` adds what a request asks for: it cuts after the first stop id (kept in the
ids, its text not shown), at ``max_tokens``, and before the first stop string; text that may
be the start of a stop string is held back until it is known not to be one.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``push(ids) -> str``: the text the new ids complete (possibly empty)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list = []
        self.prefix_offset = 0  # decode from here (context for the tokens after read_offset)
        self.read_offset = 0    # text up to here has been returned

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def push(self, ids) -> str:
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def rest(self) -> str:
        """The text not returned yet (at the end of a generation, an incomplete character
        included as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]


class TextStream:
    """One request's output, token by token.

    Args:
        tokenizer: a transformers tokenizer, or None (ids only: ``text`` stays None).
        stop_ids: ids that end the generation (kept as its last id, their text not shown).
        stop: strings that end it (the text ends before the first; the ids end with the token
            that completed it).
        max_tokens: the most ids kept.

    ``push(ids)`` returns the new text to show; ``finish()`` the rest. ``token_ids``,
    ``text`` (the concatenation of everything returned), ``finish_reason`` (``stop`` /
    ``length`` / None while running) and ``stop_reason`` (the stop id or string) describe the
    output so far.
    """

    def __init__(self, tokenizer, stop_ids, stop=(), max_tokens: int = 2 ** 62):
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop_ids = set(stop_ids)
        self.stop = tuple(stop)
        self.max_tokens = max_tokens
        self.token_ids: list = []
        self.finish_reason: str | None = None
        self.stop_reason = None
        self._text = ""  # decoded text, complete characters only
        self._sent = 0   # characters of _text returned

    @property
    def text(self) -> str | None:
        return None if self.detok is None else self._text[:self._sent]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, ids) -> str:
        for t in ids:
            if self.finished:
                break
            self.token_ids.append(t)
            if t in self.stop_ids:
                self.finish_reason, self.stop_reason = "stop", t
                break
            if self.detok is not None:
                start = len(self._text)
                self._text += self.detok.push([t])
                if self._find_stop(start):
                    break
            if len(self.token_ids) >= self.max_tokens:
                self.finish_reason = "length"
        return self._emit(final=self.finished)

    def finish(self) -> str:
        """The text held back so far (the generation has ended); sets ``finish_reason`` to
        ``length`` when nothing else ended it."""
        if self.finish_reason is None:
            self.finish_reason = "length"
        return self._emit(final=True)

    def _find_stop(self, start: int) -> bool:
        if not self.stop:
            return False
        window = max(0, start - max(len(s) for s in self.stop) + 1)
        hits = [(self._text.find(s, window), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self._text = self._text[:i]
        self.finish_reason, self.stop_reason = "stop", s
        return True

    def _held(self) -> int:
        """Characters at the end of the text that may begin a stop string."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._text) - self._sent), held, -1):
                if self._text.endswith(s[:n]):
                    held = n
                    break
        return held

    def _emit(self, final: bool) -> str:
        if self.detok is None:
            return ""
        if final and not isinstance(self.stop_reason, str):  # (after a stop string the rest is dropped)
            self._text += self.detok.rest()  # an incomplete character at the very end
        end = len(self._text) if final else len(self._text) - self._held()
        out = self._text[self._sent:end]
        self._sent = max(self._sent, end)
        return out
