"""CUDA-graph replay of a model's forwards over a static KV cache (docs/design.md §6).

:class:`GraphRunner` captures one graph per forward shape — ``(mask_mode, B, Lq, writes,
logits)`` — with static input buffers (ids, positions, labels, per-row ``num_write``) and a
static logits output, and replays it after copying the new inputs in. The cache lengths live
on the device (``cache.seqlens``) and advance inside the graph, so a replay needs no host
sync. Used by :class:`simsd.engine.batching.BatchEngine` with ``cuda_graphs=True``, which also
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
    replay: object
    ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    num_write: torch.Tensor | None
    out: torch.Tensor | None


def cuda_capture(fn, cache, device, pool):
    """Capture ``fn()`` (a forward over static buffers) as a CUDA graph.

    Warm-up runs on a side stream first (kernel compilation, workspaces); their cache writes
    land past the rows' lengths and the lengths are restored, so the cache is unchanged; the
    capture itself records without running. Returns ``(replay, out, pool)``: ``replay()`` reruns
    the graph, ``out`` is its static output (None when ``fn`` returns None).
    """
    lengths = cache.seqlens.clone()
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
            cache.seqlens.copy_(lengths)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out, graph.pool()


def eager_capture(fn, cache, device, pool):
    """A stand-in for :func:`cuda_capture` that replays by running ``fn`` eagerly and copying its
    result into the static output (tests of the buffer logic on machines without CUDA)."""
    lengths = cache.seqlens.clone()
    out = fn()
    cache.seqlens.copy_(lengths)  # like a capture, leave the cache as it was

    def replay():
        res = fn()
        if out is not None:
            out.copy_(res)
    return replay, out, pool


class GraphRunner:
    """Captures and replays ``model(ids, positions, labels, mode, cache, num_write, logits)``.

    ``cache`` is fixed for the runner's lifetime (its buffers are baked into the graphs).
    ``graphs`` counts captured shapes; ``replays`` counts replays. ``capture`` defaults to
    :func:`cuda_capture` (and then the model must pass :func:`check_graphable`).
    """

    def __init__(self, model, cache, capture=None):
        if capture is None:
            check_graphable(model)
            capture = cuda_capture
        self.model, self.cache, self.capture = model, cache, capture
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
        g.replay()
        self.replays += 1
        return g.out

    def _run(self, g: _Graph, mask_mode, want_logits):
        nw = g.num_write if g.num_write is not None else 0
        return self.model(g.ids, g.positions, g.labels, mask_mode, self.cache, nw,
                          slice(None) if want_logits else None)

    def _capture(self, ids, positions, labels, mask_mode, num_write, want_logits) -> _Graph:
        g = _Graph(None, ids.clone(), positions.clone(), labels.clone(),
                   num_write.clone() if isinstance(num_write, torch.Tensor) else None, None)
        g.replay, g.out, self._pool = self.capture(lambda: self._run(g, mask_mode, want_logits), self.cache,
                                                   ids.device, self._pool)
        return g
