"""What a model's forward costs on its device, as the engine sees it (docs/design.md §6).

:class:`ForwardCost` keeps the last forwards' wall times (the model's forward and the denoising
steps run on its logits) against their query tokens (every row of the forward, padding
included) and fits ``t(q) = a + b q`` by least squares: a GPU's flat
cost (``b`` near 0: the weights are read once whatever the width) and a CPU's growing one come
out of the same fit. On the CPU a forward is timed with the host clock (the work is done when
the call returns); on a GPU with a pair of CUDA events around it, read only once the events have
completed (a later host read of the decision has waited for them), so timing adds no wait.
Forwards are timed only once something reads the fit (:meth:`ForwardCost.want`: a row whose
speculation width is ``auto``); otherwise :meth:`~ForwardCost.start` and
:meth:`~ForwardCost.stop` do nothing, so a run that never asks costs no events or clock reads.
"""
from __future__ import annotations

import time
from collections import deque

import torch

#: forwards the fit looks at (the most recent)
WINDOW = 64


class ForwardCost:
    """Running cost of one model's forwards (module doc)."""

    def __init__(self, window: int = WINDOW):
        self.samples: deque = deque(maxlen=window)  # (query tokens, seconds)
        self.pending: deque = deque()  # CUDA: (start event, end event, query tokens)
        self.rows = 1  # rows of the last forward
        self.wanted = False  # time the forwards (want())

    def want(self) -> "ForwardCost":
        """Time the forwards from now on (a reader of :meth:`fit` is there); returns ``self``."""
        self.wanted = True
        return self

    def start(self, device):
        """A token for :meth:`stop`, taken just before the forward on ``device`` (None while
        nothing wants the timings)."""
        if not self.wanted:
            return None
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started, tokens: int, rows: int) -> None:
        """The forward started at ``started`` (:meth:`start`) ran ``tokens`` query tokens over
        ``rows`` rows (nothing when ``started`` is None)."""
        if started is None:
            return
        self.rows = rows
        if isinstance(started, float):
            self.samples.append((tokens, time.perf_counter() - started))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((started, end, tokens))
        while len(self.pending) > 4 * WINDOW:  # never read: keep the newest
            self.pending.popleft()

    def _resolve(self) -> None:
        while self.pending and self.pending[0][1].query():
            start, end, tokens = self.pending.popleft()
            self.samples.append((tokens, start.elapsed_time(end) / 1e3))

    def fit(self) -> tuple | None:
        """``(a, b)`` seconds of ``t(q) = a + b q`` over the recent forwards, or None until forwards
        of two widths are known. ``b`` is kept >= 0 (a forward never costs less for more tokens)."""
        self._resolve()
        if len({q for q, _ in self.samples}) < 2:
            return None
        n = len(self.samples)
        mq = sum(q for q, _ in self.samples) / n
        mt = sum(t for _, t in self.samples) / n
        var = sum((q - mq) ** 2 for q, _ in self.samples)
        b = max(0.0, sum((q - mq) * (t - mt) for q, t in self.samples) / var)
        return max(mt - b * mq, 0.0), b
