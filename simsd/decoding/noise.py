"""Stateless sampling noise: a counter-based generator keyed by what a draw is for (docs/design.md §4.2).

Every random number of decoding is a pure function of its key, never of how many numbers were
drawn before: ``(seed, stream, round, position, step, token)``.

* ``seed``: the row's seed (the run's ``--seed`` plus the request's index in the prompt set);
* ``stream``: what the draw is for (:data:`SAMPLE`, :data:`PAPER_DRAFT`, :data:`ACCEPT`,
  :data:`RESIDUAL`); ``round``: the SimSD round (only paper mode's streams use it);
* ``position``: the absolute position of the token in the sequence;
* ``step``: the denoising step **within the block**, counted from the block's first step
  (a round that starts mid-block continues the count);
* ``token``: the vocabulary index.

Vanilla decoding, the draft and exact verification all sample token ``x`` at ``(position,
step)`` with the same :data:`SAMPLE` noise, so the target's step decision that exact mode
recomputes at a verified state is the one vanilla decoding takes there (same seed, any
temperature / top-k / top-p), and the draft agrees with it as often as the two models'
distributions allow (Gumbel-max coupling).

The generator is SplitMix64 (Steele, Lea & Flood 2014; the finaliser is Stafford's "Mix13")
with a state derived from the key: ``state = mix(mix(base + position * G) + step * G)`` with
``base = mix(mix(mix(seed) + stream * G) + round * G)`` (computed on the host), and the word of
token ``t`` is ``mix(state + (t + 1) * G)``, the ``t``-th output of SplitMix64 from ``state``
(``G = 0x9E3779B97F4A7C15``). Its top 23 bits ``k`` give the uniform ``(k + 0.5) / 2**23``
(:func:`word_uniform`): the odd multiples of ``2**-24``, from ``2**-24`` (word 0) to ``1 - 2**-24``
(the all-ones word), every one exact in float32 (24 significant bits), so a uniform is never
0 or 1 and ``-log(u)`` is a positive ``Exp(1)`` draw. (A 24-bit grid ``(w + 0.5) / 2**24`` needs 25
significant bits: float32 rounds its upper half to even and its top word to exactly 1.0, whose
``Exp(1)`` draw 0 wins the exponential race for any token of nonzero probability.) Everything
runs on the device with int64 torch ops
(wrapping multiplication, masked shifts for the logical right shift): no host reads, nothing
that a CUDA graph could not hold. ``tests/simsd/decoding/test_noise.py`` checks the words and
the uniforms against a pure-Python implementation, every grid value of the uniform, the
uniforms for bias, and that a token of tiny probability is (almost) never drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.host_sync import to_device

#: token sampling: vanilla decoding, the draft (exact mode) and exact verification share it
SAMPLE = 0
#: paper mode's draft sampling (keyed by the round too, so every round's draft is fresh)
PAPER_DRAFT = 1
#: paper mode: the uniform of the rejection-sampling acceptance test
ACCEPT = 2
#: paper mode: the draw from the residual distribution after a rejection
RESIDUAL = 3

_MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
#: bits of a word that make its uniform: float32's 24 significant bits hold ``k + 0.5`` for ``k < 2**23``
_BITS = 23


def _signed(x: int) -> int:
    """A 64-bit word as the int64 value with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int (the reference the tensor version is tested against)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _C1) & _MASK64
    z = ((z ^ (z >> 27)) * _C2) & _MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (``>>`` on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """:func:`mix64` on an int64 tensor, in place (multiplication wraps modulo 2**64)."""
    z.bitwise_xor_(_shr(z, 30)).mul_(_signed(_C1))
    z.bitwise_xor_(_shr(z, 27)).mul_(_signed(_C2))
    return z.bitwise_xor_(_shr(z, 31))


@dataclass(frozen=True)
class NoiseKey:
    """The key of a row's noise for one block: ``seed`` (the row's seed), ``start`` (absolute
    position of the block's first token), ``stream`` and ``round`` (see the module doc)."""
    seed: int
    start: int
    stream: int = SAMPLE
    round: int = 0

    def base(self) -> int:
        """The 64-bit word of ``(seed, stream, round)``, as an int64 value."""
        z = mix64(self.seed)
        z = mix64(z + self.stream * GOLDEN)
        return _signed(mix64(z + self.round * GOLDEN))


_TOKEN_WORDS: dict = {}


def _token_words(vocab: int, device) -> torch.Tensor:
    """``(t + 1) * G`` modulo 2**64 for ``t < vocab``, int64 on ``device`` (cached)."""
    key = (vocab, torch.device(device))
    words = _TOKEN_WORDS.get(key)
    if words is None:
        words = _TOKEN_WORDS[key] = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(GOLDEN)
    return words


def words(keys, steps, length: int, vocab: int, device) -> torch.Tensor:
    """The 64-bit words (int64) of ``len(keys)`` rows of ``length`` block positions.

    Args:
        keys: R :class:`NoiseKey` (host objects).
        steps: the step of each row: an int (all rows), R host ints, or an ``(R,)`` int64
            tensor on ``device``.
        length: block positions ``0..length-1`` (absolute position ``key.start + i``).
        vocab: tokens per position.

    Returns:
        ``(R, length, vocab)`` int64 on ``device`` (no host read; host values travel in one
        asynchronous copy).
    """
    R = len(keys)
    host = [k.base() for k in keys] + [k.start for k in keys]
    if not isinstance(steps, torch.Tensor):
        host += [int(steps)] * R if isinstance(steps, int) else [int(s) for s in steps]
    vals = to_device(host, device)
    base, start = vals[:R], vals[R:2 * R]
    steps = vals[2 * R:] if not isinstance(steps, torch.Tensor) else steps.to(device=device, dtype=torch.int64)
    pos = start[:, None] + torch.arange(length, device=device)
    state = mix64_(base[:, None] + pos * _signed(GOLDEN))
    state = mix64_(state + steps.reshape(R, 1) * _signed(GOLDEN))
    return mix64_(state[:, :, None] + _token_words(vocab, device))


def word_uniform(w: torch.Tensor) -> torch.Tensor:
    """The uniform of int64 words ``w`` (any shape): ``(k + 0.5) * 2**-23`` with ``k`` the top 23
    bits of the word, float32, exact: the odd multiples of ``2**-24`` in ``[2**-24, 1 - 2**-24]``."""
    return _shr(w, 64 - _BITS).to(torch.float32).add_(0.5).mul_(2.0 ** -_BITS)


def uniform(keys, steps, length: int, vocab: int, device) -> torch.Tensor:
    """Uniforms in ``(0, 1)`` (float32, :func:`word_uniform` of :func:`words`), shape
    ``(R, length, vocab)``; arguments as :func:`words`."""
    return word_uniform(words(keys, steps, length, vocab, device))


def step_noise(keys, steps, length: int, vocab: int, device) -> torch.Tensor:
    """The sampling noise of ``len(keys)`` blocks: ``Exp(1)`` draws ``-log(u)`` (float32,
    ``(R, length, vocab)``) for the exponential race of :func:`simsd.decoding.sampling.draw`,
    keyed by each block's :class:`NoiseKey` and denoising step (``steps``: an int, R ints, or an
    ``(R,)`` tensor on ``device``); arguments as :func:`words`."""
    return uniform(keys, steps, length, vocab, device).log_().neg_()
