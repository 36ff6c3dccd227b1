"""SDAR's forward layouts of one engine row, and its folded commits (docs/design.md §3, §6).

:class:`RowLayouts` turns a row program's intent ("denoise this block", "commit it", "verify
these copies") into the :class:`~simsd.engine.batching.Fwd` requests the engine runs: the
positions after the row's cached tokens, the ``(kind, tau, grp)`` labels of the mask rule
(:mod:`simsd_kernels.mask_rule`), the mask mode, how many tokens are written and which logits
come back. It also holds the row's *folded* commits: with ``fold_commit`` a finished block is
not committed by a forward of its own but kept pending, and the model's next denoise or exact
verification writes its K/V first (the same K/V a separate commit forward writes). The engine
sees the requests and the rows' cached lengths only.
"""
from __future__ import annotations

from typing import Sequence

import torch

from simsd_kernels import KIND_KNOWN, SHARED_GRP

from ..engine.batching import Fwd, Row

#: the label of a known token that sees every token of its forward (denoise, commit)
KNOWN = (KIND_KNOWN, 0, 0)


def exact_layout(states: torch.Tensor, start: int):
    """Query tokens of the exact verification forward: copy ``c`` is ``states[c] (L,)``
    (``states``: ``(n, L)``, or a list of ``(L,)``).

    Each copy sits at the block's true positions and sees the cache and itself only
    (``exact`` mask, ``grp = c``), so its logits equal a vanilla denoise forward on that state.
    Returns ``ids (n*L,)`` on the device, ``positions``: ``n*L`` host ints and ``labels``:
    ``n*L`` host ``(kind, tau, grp)`` triples.
    """
    if isinstance(states, (list, tuple)):
        states = torch.stack(states)
    n, L = states.shape
    positions = list(range(start, start + L)) * n
    labels = [(KIND_KNOWN, 0, c) for c in range(n) for _ in range(L)]
    return states.reshape(n * L), positions, labels


class RowLayouts:
    """The forward requests of one request on engine row ``row`` (a
    :class:`~simsd.engine.batching.Row`: its index, devices and cached lengths per model).

    ``pending``: model -> the finished block ``(L,)`` whose commit is folded into that model's
    next request (:meth:`commit` with ``fold=True``); a fresh request starts with none.
    """

    def __init__(self, row: Row):
        self.row = row
        self.pending: dict = {}

    def start(self, model: str) -> int:
        """Absolute position of the current block of ``model`` (after a pending commit)."""
        prev = self.pending.get(model)
        return self.row.cached[model] + (0 if prev is None else prev.shape[0])

    def denoise(self, model: str, block: torch.Tensor, step=None) -> Fwd:
        """Denoise forward of ``block (L,)``: bidirectional over the cache and the block, read-only
        (with a pending commit: :meth:`commit_and_denoise`). ``step``: see :class:`Fwd`."""
        prev = self.pending.pop(model, None)
        if prev is not None:
            return self.commit_and_denoise(model, prev, block, step)
        L = block.shape[0]
        return Fwd(model, block, self.row.positions(model, L), [KNOWN] * L, "bidirectional", step=step)

    def exact(self, model: str, ids: torch.Tensor, positions: Sequence[int], labels: list, write: int = 0,
              hidden: int = 0) -> Fwd:
        """Exact verification forward of the layout ``ids (L,)``, ``positions`` and ``labels``
        (host; one copy per verified state, :func:`exact_layout`
        at :meth:`start`); a pending commit joins as the shared prefix (``grp = SHARED_GRP``)
        and is written. ``write``: the layout's first tokens also written after it (a proposed
        finished block's commit copy, :mod:`simsd.speculative.self_draft`; the caller rolls the
        cache back if the block is not finished so); ``hidden``: the next tokens, neither written
        nor given logits (other proposed finished blocks, seen by their next blocks only). The
        logits are those of the rest."""
        prev = self.pending.pop(model, None)
        P = 0 if prev is None else prev.shape[0]
        first = P + write + hidden
        logits = slice(first, None) if first else slice(None)
        if prev is None:
            return Fwd(model, ids, positions, labels, "exact", num_write=write, logits=logits)
        return Fwd(model, torch.cat([prev, ids]), list(self.row.positions(model, P)) + list(positions),
                   [(KIND_KNOWN, 0, SHARED_GRP)] * P + labels, "exact", num_write=P + write, logits=logits)

    def commit(self, model: str, block: torch.Tensor, fold: bool = False) -> Fwd | None:
        """Commit forward: the clean block's K/V are stored (no logits). ``fold``: defer it to
        the model's next request and return None. Raises ``RuntimeError`` if another commit of
        ``model`` is pending."""
        if model in self.pending:
            raise RuntimeError(f"row {self.row.index}: a commit of {model} is already pending")
        if fold:
            self.pending[model] = block
            return None
        L = block.shape[0]
        return Fwd(model, block, self.row.positions(model, L), [KNOWN] * L, "bidirectional", num_write=L,
                   logits=None)

    def flush(self, model: str) -> Fwd | None:
        """The pending commit of ``model`` as its own forward (for requests that cannot fold it)."""
        prev = self.pending.pop(model, None)
        return None if prev is None else self.commit(model, prev)

    def commit_and_denoise(self, model: str, block: torch.Tensor, next_block: torch.Tensor, step=None) -> Fwd:
        """The commit of ``block`` folded into the first denoise forward of ``next_block``
        (block-causal over the pair); the logits are those of ``next_block``."""
        L = block.shape[0]
        return Fwd(model, torch.cat([block, next_block]), self.row.positions(model, 2 * L),
                   [KNOWN] * L + [(KIND_KNOWN, 0, 1)] * L, "block_causal", num_write=L, logits=slice(L, 2 * L),
                   step=step)
