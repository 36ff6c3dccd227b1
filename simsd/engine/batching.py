"""Batched decoding with independent per-row progress (docs/design.md §6).

Each request (batch row) runs its decoding logic as a Python generator (a *program*) that
yields :class:`Fwd` requests — "run these query tokens of mine through model X over my cache"
— and receives the logits back. :class:`BatchEngine` collects the pending requests of all
rows, runs the requests that can share a forward as **one batched forward** over a static
cache with per-row lengths, and sends each row its own logits. A single run is the same
program driven by a one-row engine, so a row's tokens never depend on its neighbours.

Requests of different lengths share a forward through padding slots that no real token can
see under the forward's mask mode (``mask_rule.allowed``):

* ``exact``: pad ``grp = 2**30`` (real copies have ``0 <= grp < 2**30``; ``grp = -1`` is the
  shared prefix that holds a folded commit);
* ``paper``: pad = M slot with ``tau = 0`` (D and M slots have ``tau >= 1``, known slots see
  known slots only);
* ``block_causal``: pad ``grp = 2**30`` (after every real group);
* ``bidirectional`` requests carry all-zero labels, which mean "everything visible" under
  every mode, so they join a forward of any mode (and one that needs padding runs as
  ``exact``).

Rows that have no request in a forward but sit between rows that do get a dummy read-only
query; the forward covers the contiguous row range of its requests (a view of the cache).
Per-row cache writes use ``num_write`` as a ``(B,)`` tensor (see :meth:`simsd.models.model.SDARForCausalLM.forward`),
so the caches have a margin of the longest query past their capacity.

``static_shapes`` (implied by ``cuda_graphs``): every forward covers all rows and query lengths
are rounded up to a multiple of the block length, so a few shapes serve a whole run; with
``cuda_graphs`` each shape is captured once and replayed (:mod:`simsd.engine.graphs`).

The engine knows forwards, caches and rows, not decoding rules: a request's denoising step is
an object with a ``run_batch(steps, logits)`` static method (:class:`simsd.decoding.step.Step`)
that the engine calls once per forward for the requests that carry one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from simsd_kernels import KIND_MASK, SHARED_GRP

from ..models.model import labels_for
from .host_sync import to_device
from .memory import check_engine_memory

#: cache capacities are rounded up to a multiple of this (eager and graph engines alike)
CAPACITY_QUANTUM = 256


def round_capacity(capacity: int) -> int:
    """The capacity an engine allocates for ``capacity`` tokens: the next multiple of
    :data:`CAPACITY_QUANTUM`. Eager and graph engines use the same rounding because the
    attention kernels choose their split-KV plan from the cache capacity (not the device-side
    lengths, so that graphs stay valid): equal capacities give equal split counts, hence equal
    summation orders, and graph replay can be compared with eager bit for bit."""
    return -(-capacity // CAPACITY_QUANTUM) * CAPACITY_QUANTUM


PAD_LABEL = {"bidirectional": (0, 0, 0), "exact": (0, 0, 1 << 30), "paper": (KIND_MASK, 0, 0),
             "block_causal": (0, 0, 1 << 30)}


@dataclass
class Fwd:
    """One row's forward request.

    ``ids, positions (L,) int64``, ``labels (L, 3) int32`` (see :mod:`simsd_kernels.mask_rule`),
    ``mask_mode``; the first ``num_write`` tokens are written to the row's cache. ``logits``: which
    tokens' logits to return (a slice, or None for none). ``count``: counted as a forward of the
    row (diagnostic forwards are not). ``step``: a denoising step
    to apply to the logits, whose result the row receives instead (an object with a static
    ``run_batch(steps, logits) -> results``, e.g. :class:`simsd.decoding.step.Step`).
    """
    model: str
    ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    mask_mode: str
    num_write: int = 0
    logits: slice | None = field(default_factory=lambda: slice(None))
    count: bool = True
    step: object | None = None


@dataclass
class Row:
    """Host-side view of one batch row: its cached length and forward count per model.

    A finished block's commit may be *folded* (``commit(model, block, fold=True)`` returns None
    and keeps the block in ``pending``): the model's next denoise or exact-verification request
    then writes the block's K/V first (the same K/V as a separate commit forward's).
    """
    index: int
    devices: dict
    block_length: int
    cached: dict = field(default_factory=dict)
    forwards: dict = field(default_factory=dict)
    prefill_forwards: int = 0
    caches: dict = field(default_factory=dict)
    pending: dict = field(default_factory=dict)

    def start(self, model: str) -> int:
        """Absolute position of the current block of ``model`` (after a pending commit)."""
        prev = self.pending.get(model)
        return self.cached[model] + (0 if prev is None else prev.shape[0])

    def truncate(self, model: str, length: int) -> None:
        """Roll ``model``'s cache of this row back to ``length`` tokens (later slots are then
        unread and overwritten by the next write)."""
        if not 0 <= length <= self.cached[model]:
            raise ValueError(f"cannot truncate row {self.index} of {model} from {self.cached[model]} to {length}")
        self.cached[model] = length
        self.caches[model].seqlens[self.index] = length

    def positions(self, model: str, n: int) -> torch.Tensor:
        c = self.cached[model]
        return torch.arange(c, c + n, device=self.devices[model])

    def denoise(self, model: str, block: torch.Tensor, step=None) -> Fwd:
        """Denoise forward of ``block (L,)``: bidirectional over the cache and the block, read-only
        (with a pending commit: :meth:`commit_and_denoise`). ``step``: see :class:`Fwd`."""
        prev = self.pending.pop(model, None)
        if prev is not None:
            return self.commit_and_denoise(model, prev, block, step)
        L = block.shape[0]
        return Fwd(model, block, self.positions(model, L), labels_for(L, self.devices[model])[0], "bidirectional",
                   step=step)

    def exact(self, model: str, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> Fwd:
        """Exact verification forward of the layout ``ids, positions (1, L)``, ``labels (1, L, 3)``
        (one copy per verified state, :func:`simsd.speculative.verification.exact_layout` at
        :meth:`start`); a pending commit joins as the shared prefix (``grp = SHARED_GRP``) and
        is written. The logits are those of the copies."""
        dev = self.devices[model]
        prev = self.pending.pop(model, None)
        if prev is None:
            return Fwd(model, ids[0], positions[0], labels[0], "exact")
        P = prev.shape[0]
        return Fwd(model, torch.cat([prev, ids[0]]), torch.cat([self.positions(model, P), positions[0]]),
                   torch.cat([labels_for(P, dev, grp=SHARED_GRP)[0], labels[0]]), "exact", num_write=P,
                   logits=slice(P, None))

    def commit(self, model: str, block: torch.Tensor, fold: bool = False) -> Fwd | None:
        """Commit forward: the clean block's K/V are stored (no logits). ``fold``: defer it to
        the model's next request and return None. Raises if another commit is pending."""
        if model in self.pending:
            raise RuntimeError(f"row {self.index}: a commit of {model} is already pending")
        if fold:
            self.pending[model] = block
            return None
        L = block.shape[0]
        return Fwd(model, block, self.positions(model, L), labels_for(L, self.devices[model])[0], "bidirectional",
                   num_write=L, logits=None)

    def flush(self, model: str) -> Fwd | None:
        """The pending commit of ``model`` as its own forward (for requests that cannot fold it)."""
        prev = self.pending.pop(model, None)
        return None if prev is None else self.commit(model, prev)

    def commit_and_denoise(self, model: str, block: torch.Tensor, next_block: torch.Tensor,
                           step=None) -> Fwd:
        """The commit of ``block`` folded into the first denoise forward of ``next_block``
        (block-causal over the pair); the logits are those of ``next_block``."""
        L = block.shape[0]
        dev = self.devices[model]
        grp = (torch.arange(2 * L, device=dev) >= L).int()
        return Fwd(model, torch.cat([block, next_block]), self.positions(model, 2 * L),
                   labels_for(2 * L, dev, grp=grp)[0], "block_causal", num_write=L, logits=slice(L, 2 * L),
                   step=step)


def _aligned_prefill(model, cache, prompt_ids: list, block_length: int) -> tuple[list, int]:
    aligned = (len(prompt_ids) // block_length) * block_length
    if aligned:
        dev = model.device
        ids = to_device([prompt_ids[:aligned]], dev)
        pos = torch.arange(aligned, device=dev)[None]
        model(ids, pos, labels_for(aligned, dev, grp=pos // block_length), "block_causal", cache, num_write=aligned,
              logits_slice=None)
    return list(prompt_ids[aligned:]), aligned


class BatchEngine:
    """Drives row programs over one static cache per model.

    Args:
        models: name -> :class:`SDARForCausalLM` (e.g. ``{"target": t, "draft": d}``).
        block_length: the block length (tokens per block).
        batch_size: rows.
        capacity: tokens a row may commit (see :func:`simsd.decoding.config.check_prompt`).
        margin: the longest query a forward may carry (the per-row write margin).

        cuda_graphs: replay forwards as CUDA graphs (CUDA devices, triton/cuda backend); the
            first replay of each shape is checked against eager (:mod:`simsd.engine.graphs`),
            and a mismatch turns the engine's graphs off with a warning.
        static_shapes: fixed forward shapes (default: ``cuda_graphs``); an eager engine with
            static shapes runs exactly the computation the graphs replay.
        capture: the capture function of the graph runners (default
            :func:`simsd.engine.graphs.cuda_capture`; tests pass ``eager_capture``).

    The caches hold ``capacity + margin`` tokens per row (:func:`engine_for`, which the decoders
    use, rounds ``capacity`` with :func:`round_capacity` first).

    ``forwards[name]`` counts the batched forwards run per model (prefill excluded).

    Raises:
        ValueError: ``cuda_graphs`` on a model that cannot be captured (see :mod:`simsd.engine.graphs`);
            caches and workspace that would not fit the free memory
            (:func:`simsd.engine.memory.check_engine_memory`).
    """

    def __init__(self, models: dict, block_length: int, batch_size: int, capacity: int, margin: int,
                 cuda_graphs: bool = False, static_shapes: bool | None = None, capture=None):
        self.models = models
        self.block_length = block_length
        self.capacity = capacity
        self.static = cuda_graphs if static_shapes is None else static_shapes
        check_engine_memory(models, batch_size, capacity, margin)
        self.caches = {n: m.new_cache(batch_size, capacity + margin) for n, m in models.items()}
        for cache in self.caches.values():
            cache.check_lengths = False  # the engine checks lengths on the host (no device read)
        self.graphs = {}
        if cuda_graphs:
            from .graphs import GraphRunner
            state = {"disabled": None}  # one mismatch turns off the graphs of every model
            self.graphs = {n: GraphRunner(m, self.caches[n], capture=capture, state=state)
                           for n, m in models.items()}
        self.reset()

    def reset(self) -> None:
        """Empty the caches and the row counters (captured graphs stay valid)."""
        for cache in self.caches.values():
            cache.reset()
        self.rows = [self._new_row(i) for i in range(self.caches[next(iter(self.caches))].batch_size)]
        self.forwards = {n: 0 for n in self.models}

    def _new_row(self, index: int) -> Row:
        devices = {n: m.device for n, m in self.models.items()}
        return Row(index, devices, self.block_length, {n: 0 for n in self.models}, {n: 0 for n in self.models},
                   caches=self.caches)

    def release(self, index: int) -> Row:
        """Empty row ``index`` for a new request (continuous batching, :mod:`simsd.engine.scheduler`):
        its cache lengths go to 0 (the stale K/V past them is never read) and it gets a fresh
        :class:`Row` (counters at 0, no pending commit), which is returned."""
        for cache in self.caches.values():
            cache.seqlens[index] = 0
        self.rows[index] = self._new_row(index)
        return self.rows[index]

    def synchronize(self) -> None:
        """Wait for the work queued on the models' CUDA devices (nothing on the CPU)."""
        for dev in {m.device for m in self.models.values()}:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

    def prefill(self, index: int, prompt_ids: list) -> list:
        """Prefill row ``index`` in every model (separately per row); returns the prompt tail."""
        row = self.rows[index]
        tail = prompt_ids
        for name, model in self.models.items():
            cache = self.caches[name].rows(index, index + 1)
            tail, aligned = _aligned_prefill(model, cache, prompt_ids, self.block_length)
            row.cached[name] = aligned
        row.prefill_forwards = 1 if len(prompt_ids) >= self.block_length else 0
        return tail

    def max_requests(self) -> int:
        """An upper bound on the forward requests of a row program that makes progress: every
        request of a round either commits a token or belongs to a round that does (at most
        ``2 block_length + 8`` requests per committed token, optimistic drafts included), over the capacity."""
        return (self.capacity + self.block_length) * (2 * self.block_length + 8) + 64

    def run(self, programs: list) -> list:
        """Run one program per row (``programs[i]`` for row ``i``) until all return; returns
        their return values. Draft forwards run before target ones so that the target's
        forwards batch as many rows as possible.

        Raises:
            RuntimeError: a program issued more than :meth:`max_requests` requests (it makes no
                progress; the loop would not end).
        """
        pending, results = {}, [None] * len(programs)
        served, limit = [0] * len(programs), self.max_requests()
        for i, prog in enumerate(programs):
            self._advance(i, prog, None, pending, results)
        while pending:
            name, mode, rows = self.pick(pending)
            outs = self._forward(name, mode, {i: pending[i][1] for i in rows})
            for i in rows:
                served[i] += 1
                if served[i] > limit:
                    raise RuntimeError(f"row {i}: {served[i]} forward requests without finishing (a program that "
                                       f"progresses needs at most {limit} for {self.capacity} tokens)")
                self._advance(i, pending.pop(i)[0], outs[i], pending, results)
        return results

    def pick(self, pending: dict) -> tuple:
        """The next forward among ``pending`` (``{row: (program, Fwd)}``): ``(model, mask_mode,
        rows)`` of the largest group that can share a forward, draft groups first."""
        return max(self._groups(pending), key=lambda g: (g[0] != "target", len(g[2])))

    def forward(self, name: str, mode: str, reqs: dict) -> dict:
        """Run the requests ``reqs`` (``{row: Fwd}``, one group of :meth:`pick`) as one batched
        forward of model ``name``; returns ``{row: logits or step result or None}``.

        Raises:
            ValueError: a write past a row's cache capacity (checked before the forward).
        """
        return self._forward(name, mode, reqs)

    @staticmethod
    def _advance(i, prog, value, pending, results):
        try:
            pending[i] = (prog, prog.send(value))
        except StopIteration as stop:
            results[i] = stop.value

    @staticmethod
    def _groups(pending) -> list:
        """``(model, mode, rows)`` of requests that can share a forward."""
        groups: dict = {}
        for i, (_, req) in sorted(pending.items()):
            groups.setdefault((req.model, req.mask_mode), []).append(i)
        for (name, mode) in list(groups):  # bidirectional requests join the model's other group
            if mode == "bidirectional":
                other = next((k for k in groups if k[0] == name and k[1] != "bidirectional"), None)
                if other is not None:
                    groups[other] = sorted(groups[other] + groups.pop((name, mode)))
        return [(n, m, rows) for (n, m), rows in groups.items()]

    def _forward(self, name: str, mode: str, reqs: dict) -> dict:
        model, dev = self.models[name], self.models[name].device
        a, b = min(reqs), max(reqs) + 1
        Lq = max(r.ids.shape[0] for r in reqs.values())
        if self.static:
            a, b = 0, len(self.rows)
            Lq = -(-Lq // self.block_length) * self.block_length
        if mode == "bidirectional" and any(r.ids.shape[0] != Lq for r in reqs.values()):
            mode = "exact"
        ids = torch.zeros(b - a, Lq, dtype=torch.int64, device=dev)
        pos = torch.zeros(b - a, Lq, dtype=torch.int64, device=dev)
        labels = torch.empty(b - a, Lq, 3, dtype=torch.int32, device=dev)
        for channel, value in enumerate(PAD_LABEL[mode]):  # scalar fills: no host-to-device copy
            labels[..., channel] = value
        nw = [0] * (b - a)
        for i, r in reqs.items():
            L = r.ids.shape[0]
            ids[i - a, :L] = r.ids
            pos[i - a, :L] = r.positions
            pos[i - a, L:] = r.positions[-1]
            labels[i - a, :L] = r.labels
            nw[i - a] = r.num_write
        per_row = len(set(nw)) > 1 or (self.static and any(nw))
        written = Lq if per_row else nw[0]  # per-row writes store all Lq tokens of every row
        for i in range(a, b) if written else ():  # checked on the host, where the lengths are known
            room = self.caches[name].max_len - self.rows[i].cached[name]
            if written > room:
                raise ValueError(f"KV cache overflow in row {i} of {name}: {written} tokens written, "
                                 f"{room} free slots")
        num_write = to_device(nw, dev, torch.int32) if per_row else nw[0]
        want = any(r.logits is not None for r in reqs.values())
        if name in self.graphs:
            logits = self.graphs[name](ids, pos, labels, mode, num_write, want)
        else:
            logits = model(ids, pos, labels, mode, self.caches[name].rows(a, b), num_write,
                           slice(None) if want else None, unit=self.block_length)
        self.forwards[name] += 1
        outs = {}
        for i, r in reqs.items():
            row = self.rows[i]
            row.cached[name] += r.num_write
            row.forwards[name] += int(r.count)
            if r.logits is not None:
                out = logits[i - a, : r.ids.shape[0]][r.logits]
                outs[i] = out.clone() if self.graphs else out  # graph outputs are overwritten by replays
            else:
                outs[i] = None
        self._steps(reqs, outs)
        return outs

    @staticmethod
    def _steps(reqs: dict, outs: dict) -> None:
        """Replace the logits of requests that carry a step by the step's result (all steps of
        the forward in one ``run_batch`` call, see :class:`Fwd`)."""
        rows = [i for i, r in reqs.items() if r.step is not None]
        if rows:
            results = type(reqs[rows[0]].step).run_batch([reqs[i].step for i in rows], [outs[i] for i in rows])
            for i, result in zip(rows, results):
                outs[i] = result


_POOL: dict = {}


def engine_for(models: dict, block_length: int, batch_size: int, capacity: int, margin: int,
               cuda_graphs: bool = False, capture=None) -> BatchEngine:
    """A :class:`BatchEngine` for these arguments. Without graphs a fresh one; with graphs one
    kept per ``(models, block_length, batch_size, margin)`` and reset, so that its captured
    graphs are reused across calls (replaced by a larger one when ``capacity`` grows).
    Capacities are rounded up with :func:`round_capacity` in both cases."""
    capacity = round_capacity(capacity)
    if not cuda_graphs:
        return BatchEngine(models, block_length, batch_size, capacity, margin)
    key = (tuple((n, id(m)) for n, m in sorted(models.items())), block_length, batch_size, margin)
    engine = _POOL.get(key)
    if engine is None or engine.capacity < capacity:
        _POOL.pop(key, None)
        engine = _POOL[key] = BatchEngine(models, block_length, batch_size, capacity, margin,
                                          cuda_graphs=True, capture=capture)
    engine.reset()
    return engine


@dataclass
class BatchResult:
    """``results[i]``: the generation result (:class:`~simsd.decoding.config.GenerationResult`) of
    prompt ``i``; ``stats``:
    ``batch_size, new_tokens, decode_seconds, tokens_per_second`` (all rows' tokens over the
    batch's decode time, prefill excluded) and ``batched_forwards`` per model."""
    results: list
    stats: dict
