"""CUDA-graph replay of a model's forwards over a static KV cache (docs/design.md §6).

:class:`GraphRunner` captures one graph per forward shape — ``(mask_mode, B, Lq, logits)`` —
with static input buffers (ids, positions, labels, per-row ``num_write``) and a static logits
output, and replays it after copying the new inputs in. The cache lengths live
on the device (``cache.seqlens``) and advance inside the graph, so a replay needs no host
sync. Used by :class:`simsd.engine.batching.BatchEngine` with ``cuda_graphs=True``, which also
fixes the shapes (all rows in every forward, query lengths rounded up to a multiple of the
block length), so a handful of graphs serve a whole run: the draft denoise step, the target
verify forwards (paper / exact, padded), vanilla denoise and commit.

Needs a capture-safe attention backend (``triton`` or ``cuda``: no host reads of the cache
lengths); the ``torch`` reference reads ``cache_seqlens.max()`` on the host and is refused. A
mixture-of-experts model also needs the ``triton`` fused-MoE kernels (the ``torch`` MoE path reads
the expert counts on the host): :func:`check_graphable` refuses it up front, with the reason.

Graphs prove themselves (docs/design.md §5): the first replay of each captured shape is compared
with the same forward run eagerly over the same buffers (logits and the K/V it wrote); a
mismatch beyond :data:`GRAPH_TOL` disables the graphs of every runner sharing the engine's
state for the rest of the run, with one :class:`GraphCheckWarning`, and the eager result is
used. Capture and replay run with the model's device as the current device.
"""
from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from simsd_kernels import MaskMode

#: graph vs eager: max |difference| <= GRAPH_TOL[dtype] * max(1, max |eager|) (a few units in the
#: last place of the largest value; equal kernels in equal order usually agree bit for bit)
GRAPH_TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


class GraphCheckWarning(RuntimeWarning):
    """A CUDA-graph replay differed from eager; graphs are off for the run."""


def check_graphable(model) -> None:
    """Raise ``ValueError`` when ``model`` cannot run under CUDA graphs here, before any capture.

    Asks the model what its attention runs on in each mask mode (at its dtype, head_dim and GQA
    group: :meth:`~simsd.models.model.SDARForCausalLM.attention_backend_class`), and resolves the
    fused-MoE backend of its mixture-of-experts layers (if any) at the model's dtype, which also
    runs the backends' self-checks before any capture. Refused: an attention backend that is not
    fused (the ``torch`` reference reads the cache lengths on the host) and the ``torch`` MoE path
    (it reads the expert counts on the host: a capture would fail in its first MoE layer); the
    message names the configuration and why the kernel backend is not used."""
    device = model.device
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"CUDA graphs need a CUDA device; the model is on {device}")
    for mode in MaskMode:
        backend = model.attention_backend_class(mode)
        if not backend.fused:
            raise ValueError(f"CUDA graphs need the triton or cuda attention backend for the {mode.name.lower()} mask "
                             f"mode ({model.dtype}, head_dim {model.config.head_dim}) on {device}; the model's "
                             f"attention runs on {backend.name!r}, which reads the cache lengths on the host")
    check_moe_graphable(model.modules(), device, model.dtype)


def check_moe_graphable(modules, device, dtype) -> None:
    """Raise ``ValueError`` when a mixture-of-experts layer among ``modules`` (an iterable of
    modules) would run the host-reading ``torch`` MoE path under a capture (:func:`check_graphable`)."""
    from simsd.models.moe import SparseMoeBlock
    from simsd_kernels.moe import moe_backend_choice
    blocks = [m for m in modules if isinstance(m, SparseMoeBlock)]
    for requested in dict.fromkeys(b.backend for b in blocks):
        name, why = moe_backend_choice(requested, device, dtype)
        if name == "torch":
            n = sum(b.backend == requested for b in blocks)
            raise ValueError(f"CUDA graphs need the triton fused-MoE backend for the model's {n} mixture-of-experts "
                             f"layers ({dtype} on {device}; MoE backend {requested!r}): {why}. The torch MoE path "
                             "reads the expert counts on the host, which a CUDA graph capture cannot; run without "
                             "CUDA graphs")


def device_of(device):
    """``torch.cuda.device(device)`` for a CUDA device, else a no-op context."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


@dataclass
class _Graph:
    replay: object
    ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    num_write: torch.Tensor
    out: torch.Tensor | None
    checked: bool = False


def cuda_capture(fn, cache, device, pool):
    """Capture ``fn()`` (a forward over static buffers) as a CUDA graph on ``device``.

    Warm-up runs on a side stream first (kernel compilation, workspaces, backend self-checks);
    their cache writes land past the rows' lengths and the lengths are restored, so the cache
    is unchanged. The device is synchronised before the capture (nothing of the warm-up, nor
    an NCCL collective, may still be in flight), and under torch.distributed the capture uses
    ``capture_error_mode="thread_local"`` so that the NCCL watchdog thread's event queries do
    not invalidate it; the capture itself records without running. Returns ``(replay, out,
    pool)``: ``replay()`` reruns the graph, ``out`` is its static output (None when ``fn``
    returns None).
    """
    device = torch.device(device)
    with torch.cuda.device(device):
        lengths = cache.seqlens.clone()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
                cache.seqlens.copy_(lengths)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream(device),
                              capture_error_mode="thread_local" if distributed else "global"):
            out = fn()
    return graph.replay, out, graph.pool()


_CAPTURE_STREAMS: dict = {}


def capture_stream(device: torch.device):
    """One capture stream per device. ``torch.cuda.graph``'s default capture stream is created
    once per process on whatever device is current then, so a second GPU (``--draft-device``)
    would capture on a stream of the first; its ``torch.cuda.stream`` context would even make
    that device current during the capture."""
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


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
    """Captures and replays the forward of ``model`` over ``cache`` (as the engine calls it).

    ``cache`` is fixed for the runner's lifetime (its buffers are baked into the graphs);
    ``unit``: the block length (see :meth:`~simsd.models.model.SDARForCausalLM.forward`).
    ``graphs`` counts captured shapes; ``replays`` counts replays. ``capture`` defaults to
    :func:`cuda_capture` (and then the model must pass :func:`check_graphable`). ``check``:
    compare the first replay of each shape with eager (module docstring); ``state`` (a dict
    shared by the runners of one engine) holds ``"disabled"``: None, or why graphs are off.
    ``checks`` lists ``(shape key, max |graph - eager|, tolerance)`` of the comparisons made.
    """

    def __init__(self, model, cache, unit: int, capture=None, check: bool = True, state: dict | None = None):
        if capture is None:
            check_graphable(model)
            capture = cuda_capture
        self.model, self.cache, self.unit, self.capture = model, cache, unit, capture
        self.check = check
        self.state = state if state is not None else {"disabled": None}
        self.state.setdefault("disabled", None)
        self.checks: list = []
        self._graphs: dict = {}
        self._pool = None
        self.replays = 0

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    @property
    def disabled(self):
        """None while graphs are in use, else the reason they were turned off."""
        return self.state["disabled"]

    def __call__(self, ids, positions, labels, mask_mode: str, num_write: torch.Tensor, want_logits: bool):
        """The model's forward over the runner's cache (``num_write``: a ``(B,)``
        int32 device tensor). Returns the graph's static logits ``(B, Lq, V)`` (overwritten by
        the next replay of this shape: copy what you keep) or None; once graphs are disabled,
        the eager forward's logits."""
        if self.disabled:
            return self.model(ids, positions, labels, mask_mode, self.cache, num_write,
                              slice(None) if want_logits else None, unit=self.unit)
        key = (mask_mode, tuple(ids.shape), want_logits)
        with device_of(ids.device):
            g = self._graphs.get(key)
            if g is None:
                g = self._graphs[key] = self._capture(ids, positions, labels, mask_mode, num_write, want_logits)
            g.ids.copy_(ids)
            g.positions.copy_(positions)
            g.labels.copy_(labels)
            g.num_write.copy_(num_write)
            if self.check and not g.checked:
                return self._checked_replay(g, key, mask_mode, want_logits)
            g.replay()
        self.replays += 1
        return g.out

    def _written(self, lengths, L: int):
        """The K/V of every layer in the ``L`` slots past ``lengths`` (what a writing forward wrote)."""
        cols = (lengths.to(torch.int64)[:, None] + torch.arange(L, device=lengths.device)[None]).clamp_max(
            self.cache.max_len - 1)
        return torch.stack([self.cache.slots(t, cols) for t in self.cache.k + self.cache.v])

    def _checked_replay(self, g, key, mask_mode, want_logits):
        """First replay of a shape: replay, then rerun the same forward eagerly from the same
        cache lengths (it rewrites the same slots) and compare outputs and written K/V."""
        lengths = self.cache.seqlens.clone()
        g.replay()
        self.replays += 1
        got = [g.out.clone()] if g.out is not None else []
        got.append(self._written(lengths, g.ids.shape[1]))
        self.cache.seqlens.copy_(lengths)
        eager = self._run(g, mask_mode, want_logits)
        want = [eager] if eager is not None else []
        want.append(self._written(lengths, g.ids.shape[1]))
        g.checked = True
        worst, tol = 0.0, 0.0
        for a, b in zip(got, want):
            ref = b.abs().max().item() if b.numel() else 0.0
            t = GRAPH_TOL.get(self.model.dtype, 1e-2) * max(1.0, ref)
            diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            if not diff <= t:  # NaN fails too
                worst, tol = diff, t
                break
            worst, tol = max(worst, diff), t
        self.checks.append((key, worst, tol))
        if not worst <= tol:
            self.state["disabled"] = (f"the first replay of {key} differs from eager by {worst:.3g} "
                                      f"(tolerance {tol:.3g})")
            warnings.warn(f"simsd: CUDA graph on {self.model.device}: {self.state['disabled']}; CUDA graphs are "
                          "disabled for this run", GraphCheckWarning, stacklevel=3)
            return eager
        return g.out

    def _run(self, g: _Graph, mask_mode, want_logits):
        """The model's forward on the graph's static inputs (all ``Lq`` logits or none)."""
        return self.model(g.ids, g.positions, g.labels, mask_mode, self.cache, g.num_write,
                          slice(None) if want_logits else None, unit=self.unit)

    def _capture(self, ids, positions, labels, mask_mode, num_write, want_logits) -> _Graph:
        g = _Graph(None, ids.clone(), positions.clone(), labels.clone(), num_write.clone(), None)
        g.replay, g.out, self._pool = self.capture(lambda: self._run(g, mask_mode, want_logits), self.cache,
                                                   ids.device, self._pool)
        return g
