"""CUDA-graph replay of a model's forwards over a static KV cache (DESIGN.md §6).

:class:`GraphRunner` captures one graph per forward shape — ``(mask_mode, B, Lq, writes,
logits)`` — with static input buffers (ids, positions, labels, per-row ``num_write``) and a
static logits output, and replays it after copying the new inputs in. The cache lengths live
on the device (``cache.seqlens``) and advance inside the graph, so a replay needs no host
sync. Used by :class:`simsd.batching.BatchEngine` with ``cuda_graphs=True``, which also
fixes the shapes (all rows in every forward, query lengths rounded up to a multiple of the
block length), so a handful of graphs serve a whole run: the draft denoise step, the target
verify forwards (paper / exact, padded), vanilla denoise and commit.

Needs a capture-safe attention backend (``triton`` or ``cuda``: no host reads of the cache
lengths); the ``torch`` reference reads ``cache_seqlens.max()`` on the host and is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from simsd_kernels.backends import resolve_backend


def check_graphable(model) -> None:
    """Raise ``ValueError`` when ``model`` cannot run under CUDA graphs here."""
    device = model.device
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"CUDA graphs need a CUDA device; the model is on {device}")
    backend = resolve_backend(model.attention_backend, device).name
    if backend == "torch":
        raise ValueError("CUDA graphs need the triton or cuda attention backend (the torch reference "
                         "reads the cache lengths on the host)")


@dataclass
class _Graph:
    graph: object
    ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    num_write: torch.Tensor | None
    out: torch.Tensor | None


class GraphRunner:
    """Captures and replays ``model(ids, positions, labels, mode, cache, num_write, logits)``.

    ``cache`` is fixed for the runner's lifetime (its buffers are baked into the graphs).
    ``graphs`` counts captured shapes; ``replays`` counts replays.
    """

    def __init__(self, model, cache):
        check_graphable(model)
        self.model, self.cache = model, cache
        self._graphs: dict = {}
        self._pool = None
        self.replays = 0

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def __call__(self, ids, positions, labels, mask_mode: str, num_write, want_logits: bool):
        """Same contract as the model forward with ``logits_slice = slice(None) | None``;
        ``num_write``: 0 or a ``(B,)`` int32 device tensor. Returns the graph's static logits
        ``(B, Lq, V)`` (overwritten by the next replay of this shape: copy what you keep) or None."""
        writes = isinstance(num_write, torch.Tensor)
        if not writes and num_write:
            raise ValueError("GraphRunner takes num_write as 0 or a (B,) device tensor")
        key = (mask_mode, tuple(ids.shape), writes, want_logits)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(ids, positions, labels, mask_mode, num_write, want_logits)
        g.ids.copy_(ids)
        g.positions.copy_(positions)
        g.labels.copy_(labels)
        if writes:
            g.num_write.copy_(num_write)
        g.graph.replay()
        self.replays += 1
        return g.out

    def _run(self, g: _Graph, mask_mode, want_logits):
        nw = g.num_write if g.num_write is not None else 0
        return self.model(g.ids, g.positions, g.labels, mask_mode, self.cache, nw,
                          slice(None) if want_logits else None)

    def _capture(self, ids, positions, labels, mask_mode, num_write, want_logits) -> _Graph:
        g = _Graph(torch.cuda.CUDAGraph(), ids.clone(), positions.clone(), labels.clone(),
                   num_write.clone() if isinstance(num_write, torch.Tensor) else None, None)
        # warm-up on a side stream (compiles kernels, allocates workspaces); its cache writes land
        # past the rows' lengths and the lengths are restored, so the cache is unchanged
        lengths = self.cache.seqlens.clone()
        side = torch.cuda.Stream(device=ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(g, mask_mode, want_logits)
                self.cache.seqlens.copy_(lengths)
        torch.cuda.current_stream(ids.device).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self._pool):
            g.out = self._run(g, mask_mode, want_logits)  # recorded, not run: the cache is untouched
        self._pool = g.graph.pool()
        return g
