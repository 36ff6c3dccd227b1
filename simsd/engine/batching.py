"""Batched decoding with independent per-row progress (docs/design.md §6).

Each request (batch row) runs its decoding logic as a Python generator (a *program*) that
yields :class:`Fwd` requests — "run these query tokens of mine through model X over my cache"
— and receives the logits back. The :class:`~simsd.engine.scheduler.Scheduler` drives the
programs (every way of decoding goes through it); :class:`BatchEngine` runs the requests that
can share a forward as **one batched forward** over a static cache with per-row lengths and
hands each row its own logits. A single run is the same program on a one-row engine, so a
row's tokens never depend on its neighbours.

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
Cache writes are per row: ``num_write`` is always a ``(B,)`` int32 tensor (see
:meth:`simsd.models.model.SDARForCausalLM.forward`), so every row of a forward writes all its
query tokens past its length and keeps its own count; the caches have a margin of the longest
query past their capacity.

A forward's inputs are built with few device operations: positions, labels and write counts
are host values (one copy each), the ids one concatenation, padding from constant tensors made
once per engine; the steps of all rows run as one batched step on the forward's logits.

``static_shapes`` (implied by ``cuda_graphs``): every forward covers all rows and query lengths
are rounded up to a multiple of the block length, so a few shapes serve a whole run; with
``cuda_graphs`` each shape is captured once and replayed (:mod:`simsd.engine.graphs`). The
engine calls the model itself (``model(ids, positions, labels, mode, cache, num_write, logits,
unit=block_length)``, :meth:`simsd.models.model.SDARForCausalLM.forward`): no wrapper between.

The engine knows forwards, caches and rows, not decoding rules: the layouts of a row's
forwards are built by the decoding (:class:`simsd.decoding.layouts.RowLayouts`), and a
request's denoising step is a :class:`BatchStep` (:class:`simsd.decoding.step.Step`) that the
engine runs once per forward for the requests that carry one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from simsd_kernels import KIND_KNOWN, KIND_MASK

from .costs import ForwardCost
from .host_sync import to_device
from .memory import check_engine_memory
from .pages import EnginePages

#: cache capacities are rounded up to a multiple of this (eager and graph engines alike)
CAPACITY_QUANTUM = 256
#: distinct forward labels / write counts an engine keeps on its devices (:meth:`BatchEngine._constant`)
CONSTANTS = 256
#: rounds a pending forward request may be passed over before its group goes first (:meth:`BatchEngine.pick`)
MAX_WAIT = 4


def round_capacity(capacity: int) -> int:
    """The capacity an engine allocates for ``capacity`` tokens: the next multiple of
    :data:`CAPACITY_QUANTUM`. Eager and graph engines use the same rounding because the
    attention kernels choose their split-KV plan from the cache capacity (not the device-side
    lengths, so that graphs stay valid): equal capacities give equal split counts, hence equal
    summation orders, and graph replay can be compared with eager bit for bit."""
    return -(-capacity // CAPACITY_QUANTUM) * CAPACITY_QUANTUM


#: the labels ``(kind, tau, grp)`` of a padding slot per mask mode (seen by no real token)
PAD_LABEL = {"bidirectional": (0, 0, 0), "exact": (0, 0, 1 << 30), "paper": (KIND_MASK, 0, 0),
             "block_causal": (0, 0, 1 << 30)}


class NonFiniteLogits(RuntimeError):
    """A forward gave a request non-finite (NaN or infinite) logits: decoding them would give
    garbage (a NaN's argmax is token 0), so the request fails instead. ``model``: ``"target"``
    or ``"draft"``; ``dtype``: the model's dtype name; ``block``, ``step``: the generated block
    (0-based) and the denoising step in it where it was seen. In float16 the cause is usually an
    overflow past 65504 (the message then suggests bfloat16, which has float32's range)."""

    def __init__(self, model: str, dtype: str, block: int, step: int):
        self.model, self.dtype, self.block, self.step = model, dtype, block, step
        hint = ("; float16 overflows past 65504: use bfloat16 (float32's range)" if dtype == "float16" else "")
        super().__init__(f"the {model} model ({dtype}) gave non-finite logits (NaN or inf) at generated block "
                         f"{block}, step {step}{hint}")


class BatchStep(Protocol):
    """What the engine needs of a request's denoising step (:class:`simsd.decoding.step.Step`):
    ``run_batch(steps, logits)`` applies every step of one forward, in order, to ``logits`` (their
    requests' logits, ``(N, L, V)`` or a shape that views as it) and returns one result per step,
    which the requests receive instead of their logits. ``states``: the block states the step
    covers (its share of ``N``)."""
    states: int

    @staticmethod
    def run_batch(steps: list, logits: torch.Tensor) -> list: ...


@dataclass
class Fwd:
    """One row's forward request.

    ``ids (L,)`` int64 on the model's device; ``positions``: ``L`` host ints (RoPE positions);
    ``labels``: ``L`` host ``(kind, tau, grp)`` triples (see :mod:`simsd_kernels.mask_rule`);
    ``tau``: None, or an ``(L,)`` int32 device tensor added to the ``tau`` labels (paper
    verification: the draft's reveal steps, known on the device only); ``mask_mode``; the first
    ``num_write`` tokens are kept in the row's cache. ``logits``: which tokens' logits to return
    (a slice, or None for none). ``count``: counted as a forward of the row (diagnostic forwards
    are not). ``step``: a denoising step to apply to the logits, whose result the row receives
    instead (a :class:`BatchStep`). ``prefill``: a chunk of the row's prompt
    (:meth:`BatchEngine.prefill`): run alone, eagerly, not counted.

    Positions and labels travel to the device with those of the forward's other rows in one
    copy each (host values: no device op per request).
    """
    model: str
    ids: torch.Tensor
    positions: Sequence[int]
    labels: list
    mask_mode: str
    num_write: int = 0
    logits: slice | None = field(default_factory=lambda: slice(None))
    count: bool = True
    step: BatchStep | None = None
    tau: torch.Tensor | None = None
    prefill: bool = False


@dataclass
class Row:
    """Host-side view of one batch row: its index, the models' devices, its cached length,
    forward count and query tokens (its own, padding excluded, summed over its counted forwards)
    per model, and its column of the engine's non-finite-logits flags. What a
    row's forwards carry (the layouts of denoising, commits and verification, and folded
    commits) is the decoding's (:class:`simsd.decoding.layouts.RowLayouts`).
    """
    index: int
    devices: dict
    cached: dict = field(default_factory=dict)
    forwards: dict = field(default_factory=dict)
    #: the prompt's prefill chunks run (one forward per model each; :meth:`BatchEngine.prefill`)
    prefill_forwards: int = 0
    caches: dict = field(default_factory=dict)
    query_tokens: dict = field(default_factory=dict)
    #: per model: the engine's :class:`~simsd.engine.costs.ForwardCost` (what a forward of a width costs)
    costs: dict = field(default_factory=dict)
    nonfinite: torch.Tensor | None = None
    dtypes: dict = field(default_factory=dict)
    #: the request's prompt ids (set by :meth:`BatchEngine.prefill`; the repetition penalty reads them)
    prompt: list = field(default_factory=list)
    #: the ids of the request's finished blocks after the prompt (its row program's ``generated``;
    #: with the prompt, the tokens of the committed cache slots)
    output: list = field(default_factory=list)
    #: the prompt's tokens found in the prefix cache (not prefilled; :mod:`simsd.engine.pages`)
    prefix_hit: int = 0

    def nonfinite_flags(self, device) -> torch.Tensor:
        """``(M,)`` bool on ``device``: per model (in the engine's order, ``dtypes``' keys), true
        once a forward gave this row a non-finite logit (see :meth:`BatchEngine.forward`); read
        on the host with the row's own decision (no read of its own), then passed to
        :meth:`check_finite`. ``nonfinite`` is the row's column of the engine's ``(M, batch)``
        float32 accumulator, NaN once a forward flagged it."""
        flags = self.nonfinite.to(device, non_blocking=True)
        return flags.ne(flags)

    def check_finite(self, flags: list, block: int, step: int) -> None:
        """Raise :class:`NonFiniteLogits` for the first model whose flag in ``flags`` (host ints
        read from :meth:`nonfinite_flags`) is set; ``block``, ``step``: where the row is."""
        for name, flag in zip(self.dtypes, flags):
            if flag:
                raise NonFiniteLogits(name, self.dtypes[name], block, step)

    def truncate(self, model: str, length: int) -> None:
        """Roll ``model``'s cache of this row back to ``length`` tokens (later slots are then
        unread and overwritten by the next write)."""
        if not 0 <= length <= self.cached[model]:
            raise ValueError(f"cannot truncate row {self.index} of {model} from {self.cached[model]} to {length}")
        self.cached[model] = length
        self.caches[model].seqlens[self.index] = length

    def positions(self, model: str, n: int) -> range:
        """The positions of the next ``n`` tokens of ``model`` after the cached ones (host)."""
        c = self.cached[model]
        return range(c, c + n)


class BatchEngine:
    """Runs the forward requests of row programs over one static cache per model.

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
        max_prefill_tokens: the most prompt tokens one prefill forward writes (a whole number
            of blocks; :meth:`prefill`), or None: no limit, a prompt's block-aligned part in one
            forward per model.
        page_size: the KV caches' page size in tokens (a whole number of blocks; a row's slots
            are ``capacity + margin`` rounded up to whole pages; default: one page per row).
        num_pages: a shared pool of this many pages per model instead of every row owning its
            ``capacity + margin`` slots: pages are taken as rows grow and returned when they end,
            requests are admitted by free pages (:class:`simsd.engine.pages.EnginePages`,
            ``pages``); None (default): the contiguous layout.
        prefix_caching: with a pool, share cached prompt pages between requests (the prefix
            cache of :mod:`simsd.engine.pages`).

    The caches hold ``capacity + margin`` tokens per row (callers round ``capacity`` with
    :func:`round_capacity` first), in every row's own pages or, with ``num_pages``, in a shared
    pool. The engine is driven by a
    :class:`~simsd.engine.scheduler.Scheduler`, which admits requests into rows
    (:meth:`release`, :meth:`prefill`), chooses each forward (:meth:`pick`) and runs it
    (:meth:`forward`). Whoever wants captured graphs reused keeps the engine (e.g.
    :class:`simsd.LLM`).

    ``forwards[name]`` counts the batched forwards run per model (prefill excluded),
    ``prefill_tokens[name]`` the prompt tokens its prefill forwards computed (a prefix cache hit
    computes none).

    Raises:
        ValueError: ``cuda_graphs`` on a model that cannot be captured (see :mod:`simsd.engine.graphs`);
            caches and workspace that would not fit the free memory
            (:func:`simsd.engine.memory.check_engine_memory`); ``max_prefill_tokens`` that is not
            a positive multiple of ``block_length``; ``prefix_caching`` without ``num_pages``.
        ParamError(page_size): a page size that is not a positive whole number of blocks.
    """

    def __init__(self, models: dict, block_length: int, batch_size: int, capacity: int, margin: int,
                 cuda_graphs: bool = False, static_shapes: bool | None = None, capture=None,
                 max_prefill_tokens: int | None = None, page_size: int | None = None,
                 num_pages: int | None = None, prefix_caching: bool = False):
        if prefix_caching and num_pages is None:
            raise ValueError("prefix caching shares the pages of a pool: give num_pages")
        if max_prefill_tokens is not None and (max_prefill_tokens < block_length
                                               or max_prefill_tokens % block_length):
            raise ValueError(f"max_prefill_tokens must be a positive multiple of the block length {block_length} "
                             f"(whole blocks per prefill forward), got {max_prefill_tokens}")
        self.models = models
        self.block_length = block_length
        self.capacity = capacity
        self.max_prefill_tokens = max_prefill_tokens
        self.static = cuda_graphs if static_shapes is None else static_shapes
        paging = {} if page_size is None and num_pages is None else \
            {"page_size": page_size, "num_pages": num_pages, "block_size": block_length}
        # a row's slots: whole pages (page_size need not divide capacity + margin)
        slots = capacity + margin if page_size is None else -(-(capacity + margin) // page_size) * page_size
        pool = None if num_pages is None else (num_pages + 1) * (page_size or slots)
        check_engine_memory(models, batch_size, capacity, margin, pool)
        self.caches = {n: m.new_cache(batch_size, slots, **paging) for n, m in models.items()}
        #: the shared pools' bookkeeping (None: every row owns its pages)
        self.pages = None if num_pages is None else EnginePages(self.caches, margin, prefix_caching)
        for cache in self.caches.values():
            cache.check_lengths = False  # the engine checks lengths on the host (no device read)
        self._views: dict = {}   # (model, a, b) -> the cache view of rows [a, b)
        self._zeros: dict = {}   # (n, device, dtype) -> zeros: padding ids and tau labels
        self._constants: dict = {}  # (device, values) -> labels and write counts seen before
        self._span_masks: dict = {}  # (device, R, Lq, spans) -> True where the requests asked for no logits
        # per model (rows of the names' order), per row: NaN once a forward gave the row a
        # non-finite logit, else 0 (device-side, on the first model's device); each model's row
        self.nonfinite = torch.zeros(len(models), batch_size, device=next(iter(models.values())).device)
        self._nonfinite_of = dict(zip(models, self.nonfinite))
        self._dtypes = {n: str(m.dtype).removeprefix("torch.") for n, m in models.items()}
        self.costs = {n: ForwardCost() for n in models}  # what a forward of a width costs here (kept over resets)
        self.graphs = {}
        if cuda_graphs:
            from .graphs import GraphRunner
            state = {"disabled": None}  # one mismatch turns off the graphs of every model
            self.graphs = {n: GraphRunner(m, self.caches[n], block_length, capture=capture, state=state)
                           for n, m in models.items()}
        self.reset()

    def reset(self) -> None:
        """Empty the caches and the row counters (captured graphs stay valid; a pool's rows give
        their pages back)."""
        for cache in self.caches.values():
            cache.reset()
            if cache.shared:
                for b in range(cache.batch_size):
                    cache.release(b)
        self.nonfinite.zero_()
        self.rows = [self._new_row(i) for i in range(self.caches[next(iter(self.caches))].batch_size)]
        self.forwards = {n: 0 for n in self.models}
        self.prefill_tokens = {n: 0 for n in self.models}

    def _new_row(self, index: int) -> Row:
        devices = {n: m.device for n, m in self.models.items()}
        return Row(index, devices, {n: 0 for n in self.models}, {n: 0 for n in self.models}, caches=self.caches,
                   nonfinite=self.nonfinite[:, index], dtypes=self._dtypes,
                   query_tokens={n: 0 for n in self.models}, costs=self.costs)

    def release(self, index: int, offer: bool = True) -> Row:
        """Empty row ``index`` for a new request (continuous batching, :mod:`simsd.engine.scheduler`):
        its cache lengths go to 0 (the stale K/V past them is never read) and it gets a fresh
        :class:`Row` (counters at 0), which is returned; with a pool its pages go back, and with
        the prefix cache and ``offer`` (False: a request that failed) its full pages of committed
        tokens (prompt and output) are offered to the cache first."""
        row = self.rows[index]
        if self.pages is not None and self.pages.prefix_caching and offer and row.prompt:
            self.pages.register_prefix(index, (row.prompt + row.output)[:min(row.cached.values())])
        for cache in self.caches.values():
            cache.release(index)
        self.nonfinite[:, index] = 0
        self.rows[index] = self._new_row(index)
        return self.rows[index]

    def synchronize(self) -> None:
        """Wait for the work queued on the models' CUDA devices (nothing on the CPU)."""
        for dev in {m.device for m in self.models.values()}:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

    def prefill(self, index: int, prompt_ids: list):
        """Row ``index``'s prefill as a program (a generator of :class:`Fwd`, as a row program's;
        the :class:`~simsd.engine.scheduler.Scheduler` runs its requests as rounds between the
        other rows' forwards): the block-aligned part of the prompt (``floor(P / L) * L`` tokens),
        block-causal, written to every model's cache in chunks of at most ``max_prefill_tokens``
        (whole blocks; None: one chunk), each chunk one forward per model in the engine's model
        order, no logits. ``row.prefill_forwards`` counts the chunks run. Returns the prompt tail
        (the rest, host ints; it opens the first decode block).

        Chunk boundaries are block boundaries, so a chunk's tokens see exactly what they see in
        one whole forward (the cache holds the earlier blocks): with shape-invariant numerics
        (``SDARForCausalLM.invariant``, unit = the block length) on the torch backend the cache
        holds the same bits whatever the chunk size (docs/exactness.md)."""
        row = self.rows[index]
        row.prompt = list(prompt_ids)
        L = self.block_length
        aligned = (len(prompt_ids) // L) * L
        chunk = self.max_prefill_tokens or max(aligned, 1)
        hit = row.prefix_hit = 0 if self.pages is None else self.pages.share_prefix(index, row.prompt[:aligned])
        for name in self.models:
            row.cached[name] = hit
        for start in range(hit, aligned, chunk):
            end = min(start + chunk, aligned)
            positions = range(start, end)
            labels = [(KIND_KNOWN, 0, p // L) for p in positions]
            for name, model in self.models.items():
                yield Fwd(name, to_device(prompt_ids[start:end], model.device), positions, labels, "block_causal",
                          num_write=end - start, logits=None, count=False, prefill=True)
            row.prefill_forwards += 1
        if self.pages is not None:
            self.pages.register_prefix(index, row.prompt[:aligned])
        return list(prompt_ids[aligned:])

    def max_requests(self) -> int:
        """An upper bound on the forward requests of a row program that makes progress: every
        request of a round either commits a token or belongs to a round that does (at most
        ``2 block_length + 8`` requests per committed token, optimistic drafts included), over
        the capacity, plus the prefill's (at most one per block and model)."""
        return ((self.capacity + self.block_length) * (2 * self.block_length + 8) + 64
                + len(self.models) * (self.capacity // self.block_length))

    def pick(self, pending: dict, waited: dict | None = None, held: frozenset = frozenset()) -> tuple:
        """The next forward among ``pending`` (``{row: (program, Fwd)}``): ``(model, mask_mode,
        rows)`` of, in this order of precedence,

        1. the group of the request that has waited longest (the lowest row among equals), once
           one has been passed over for :data:`MAX_WAIT` rounds (``waited``: ``{row: rounds its
           request has waited}``);
        2. the prefill chunk (:meth:`prefill`, a group of one row) of the lowest row not in
           ``held`` (the caller's rows that ran a chunk since the last decoding forward): the
           rows admitted together are prefilled before they decode together, and a long
           prompt's chunk forwards (one per model) alternate with the other rows' forwards;
        3. the largest group that can share a forward, draft groups first (so that the
           target's forwards batch as many rows as possible), a held row's chunk last.

        Rule 1 bounds every wait: a request that has waited ``MAX_WAIT`` rounds goes before
        every request that has waited less, so none waits more than ``MAX_WAIT + rows - 1``
        rounds. Which forward goes first changes no token (a row's tokens do not depend on its
        neighbours) and no row's forward count (each request is one forward of its row)."""
        groups = self._groups(pending)
        aged = [i for i, n in (waited or {}).items() if i in pending and n >= MAX_WAIT]
        if aged:
            oldest = min(aged, key=lambda i: (-waited[i], i))
            return next(g for g in groups if oldest in g[2])
        waits = {g[2][0] for g in groups if pending[g[2][0]][1].prefill and g[2][0] in held}
        chunk = next((g for g in groups if pending[g[2][0]][1].prefill and g[2][0] not in waits), None)
        if chunk is not None:
            return chunk
        return max(groups, key=lambda g: (g[2][0] not in waits, g[0] != "target", len(g[2])))

    @staticmethod
    def _groups(pending) -> list:
        """``(model, mode, rows)`` of requests that can share a forward (a prefill request alone:
        its forward runs one row, as wide as its chunk)."""
        groups: dict = {}
        for i, (_, req) in sorted(pending.items()):
            groups.setdefault((req.model, req.mask_mode, i if req.prefill else None), []).append(i)
        for key in list(groups):  # bidirectional requests join the model's other group
            name, mode, _ = key
            if mode == "bidirectional":
                other = next((k for k in groups if k[0] == name and k[1] != "bidirectional" and k[2] is None), None)
                if other is not None:
                    groups[other] = sorted(groups[other] + groups.pop(key))
        return [(n, m, rows) for (n, m, _), rows in groups.items()]

    def forward(self, name: str, mode: str, reqs: dict) -> dict:
        """Run the requests ``reqs`` (``{row: Fwd}``, one group of :meth:`pick`) as one batched
        forward of model ``name``; returns ``{row: logits or step result or None}``.

        The forward covers the rows ``[min(reqs), max(reqs)]`` (all rows with static shapes);
        each row writes all ``Lq`` query tokens into its cache and keeps its request's
        ``num_write`` of them (the model's per-row writes), so every covered row needs ``Lq``
        free slots (the engine's margin). A prefill chunk (``Fwd.prefill``, a group of its own)
        runs eagerly over its row alone, whatever ``static_shapes`` and ``cuda_graphs`` (a chunk
        of any width captures no graph), and is not counted in ``forwards`` nor timed in
        ``costs``.

        Raises:
            ValueError: a write past a row's cache capacity (checked before the forward).
            simsd.engine.pages.PagesExhausted: with a pool, too few free pages for the slots the
                forward writes (nothing run; the rows keep the pages they got).
        """
        model = self.models[name]
        prefill = any(r.prefill for r in reqs.values())
        if prefill and (len(reqs) > 1 or not all(r.prefill for r in reqs.values())):
            raise ValueError(f"a prefill request runs alone, got a forward of rows {sorted(reqs)}")
        a, b = (0, len(self.rows)) if self.static and not prefill else (min(reqs), max(reqs) + 1)
        Lq = self._width(reqs)
        if mode == "bidirectional" and any(len(r.positions) != Lq for r in reqs.values()):
            mode = "exact"
        for i in range(a, b):  # checked on the host, where the lengths are known
            room = self.caches[name].max_len - self.rows[i].cached[name]
            if Lq > room:
                raise ValueError(f"KV cache overflow in row {i} of {name}: {Lq} tokens written, {room} free slots")
        self.reserve(name, reqs)
        ids, positions, labels, num_write = self._inputs(model.device, mode, reqs, a, b, Lq)
        want = any(r.logits is not None for r in reqs.values())
        started = None if prefill else self.costs[name].start(model.device)
        if name in self.graphs and not prefill:
            logits = self.graphs[name](ids, positions, labels, mode, num_write, want)
            if logits is not None:
                logits = logits.clone()  # a graph's output is overwritten by its next replay
        else:
            logits = model(ids, positions, labels, mode, self._view(name, a, b), num_write,
                           slice(None) if want else None, unit=self.block_length)
        self.forwards[name] += not prefill
        if prefill:
            self.prefill_tokens[name] += sum(r.num_write for r in reqs.values())
        if logits is not None:
            self._flag_nonfinite(name, logits, reqs, a)
        for i, r in reqs.items():
            row = self.rows[i]
            row.cached[name] += r.num_write
            row.forwards[name] += int(r.count)
            row.query_tokens[name] += len(r.positions) * int(r.count)
        outs = self._outputs(logits, reqs, a)
        self.costs[name].stop(started, (b - a) * Lq, len(reqs))  # the forward and its requests' steps
        return outs

    def _width(self, reqs: dict) -> int:
        """The query tokens per row of a forward of ``reqs``: the longest request's, rounded up to
        whole blocks with static shapes (a prefill chunk: its own)."""
        Lq = max(len(r.positions) for r in reqs.values())
        if self.static and not any(r.prefill for r in reqs.values()):
            Lq = -(-Lq // self.block_length) * self.block_length
        return Lq

    def reserve(self, name: str, reqs: dict) -> None:
        """With a pool: give every row of ``reqs`` (``{row: Fwd}``) the pages of model ``name``'s
        slots that a forward of them writes (its length plus the forward's width), as
        :meth:`forward` does first; nothing without a pool.

        Raises:
            simsd.engine.pages.PagesExhausted: the pool ran out (the rows keep what they got).
        """
        if self.pages is not None:
            Lq = self._width(reqs)
            self.pages.reserve(name, {i: self.rows[i].cached[name] + Lq for i in reqs})

    def _flag_nonfinite(self, name: str, logits: torch.Tensor, reqs: dict, a: int) -> None:
        """Set the non-finite flag of model ``name`` (device-side, no host read) for every row
        whose requested logits (its ``logits`` slice of ``logits (R, Lq, V)``) hold a NaN or an
        infinity; padding rows and positions are not looked at. A row sum is finite exactly when
        its logits are (finite float32 logits summed over ``V`` stay far below float32's range),
        and ``s - s`` is 0 for a finite ``s``, NaN otherwise: the row's flag accumulates zeros
        until a NaN makes it stick."""
        R, Lq = logits.shape[:2]
        spans = tuple((i - a, *r.logits.indices(len(r.positions))[:2]) for i, r in sorted(reqs.items())
                      if r.logits is not None)
        key = (logits.device, R, Lq, spans)
        mask = self._span_masks.get(key)
        if mask is None:
            host = torch.ones(R, Lq, dtype=torch.bool)
            for j, s, e in spans:
                host[j, s:e] = False
            mask = to_device(host, logits.device)
            if len(self._span_masks) < CONSTANTS:
                self._span_masks[key] = mask
        s = logits.sum(-1)
        bad = (s - s).masked_fill_(mask, 0).sum(-1)  # mask: True where the requests did NOT ask
        flags = self._nonfinite_of[name][a:a + R]
        flags += bad.to(flags.device, flags.dtype, non_blocking=True)

    def _view(self, name: str, a: int, b: int):
        """The cache of model ``name`` restricted to rows ``[a, b)`` (views made once)."""
        key = (name, a, b)
        view = self._views.get(key)
        if view is None:
            cache = self.caches[name]
            view = self._views[key] = cache if (a, b) == (0, cache.batch_size) else cache.rows(a, b)
        return view

    def _zeros_of(self, n: int, device, dtype=torch.int64) -> torch.Tensor:
        key = (n, device, dtype)
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = torch.zeros(n, dtype=dtype, device=device)
        return z

    def _inputs(self, device, mode: str, reqs: dict, a: int, b: int, Lq: int) -> tuple:
        """``ids, positions (R, Lq)`` int64, ``labels (R, Lq, 3)`` and ``num_write (R,)`` int32
        of rows ``[a, b)``: shorter requests padded with :data:`PAD_LABEL` slots, rows without a
        request given a read-only query of padding. Host values travel in one copy per tensor."""
        pad = PAD_LABEL[mode]
        with_tau = any(r.tau is not None for r in reqs.values())
        ids, positions, labels, num_write, taus = [], [], [], [], []
        for i in range(a, b):
            r = reqs.get(i)
            L = 0 if r is None else len(r.positions)
            if r is not None:
                ids.append(r.ids)
                if with_tau:
                    taus.append(r.tau if r.tau is not None else self._zeros_of(L, device, torch.int32))
            if L < Lq:
                ids.append(self._zeros_of(Lq - L, device))
                if with_tau:
                    taus.append(self._zeros_of(Lq - L, device, torch.int32))
            last = 0 if r is None else r.positions[-1]
            positions.append([*(() if r is None else r.positions), *[last] * (Lq - L)])
            labels.append(([] if r is None else r.labels) + [pad] * (Lq - L))
            num_write.append(0 if r is None else r.num_write)
        R = b - a
        if len(ids) == R:  # no padding
            ids = ids[0][None] if R == 1 else torch.stack(ids)
        else:
            ids = torch.cat(ids).view(R, Lq)
        if with_tau:
            labels = to_device(labels, device, torch.int32)
            labels[..., 1].add_(torch.cat(taus).view(R, Lq))
        elif any(r.prefill for r in reqs.values()):  # a prompt's chunk: not worth keeping
            labels = to_device(labels, device, torch.int32)
        else:
            labels = self._constant(labels, device)
        return ids, to_device(positions, device), labels, self._constant(num_write, device)

    def _constant(self, values: list, device) -> torch.Tensor:
        """``values`` (nested host ints) as an int32 tensor on ``device``: labels and write
        counts repeat from round to round (a denoise or commit forward of the same rows), so
        the first :data:`CONSTANTS` distinct ones are kept (never written to) and reused."""
        key = (device, repr(values))
        t = self._constants.get(key)
        if t is None:
            t = to_device(values, device, torch.int32)
            if len(self._constants) < CONSTANTS:
                self._constants[key] = t
        return t

    def _outputs(self, logits, reqs: dict, a: int) -> dict:
        """Each request's part of the forward's ``logits (R, Lq, V)``: its sliced logits, the
        result of its step (all steps of the forward in one ``run_batch`` call, see
        :class:`Fwd`) or None."""
        outs = {i: None for i in reqs}
        steps = [i for i, r in reqs.items() if r.step is not None]
        plain = [i for i, r in reqs.items() if r.logits is not None and r.step is None]
        if plain:
            rows = logits.unbind(0)
            for i in plain:
                outs[i] = self._span(rows[i - a], reqs[i])
        if steps:
            results = type(reqs[steps[0]].step).run_batch([reqs[i].step for i in steps],
                                                          self._step_logits(logits, reqs, steps, a))
            outs.update(zip(steps, results))
        return outs

    @staticmethod
    def _span(row_logits: torch.Tensor, r: Fwd) -> torch.Tensor:
        """``row_logits (Lq, V)`` cut to the request's ``logits`` slice of its own tokens."""
        s, e, _ = r.logits.indices(len(r.positions))
        return row_logits if (s, e) == (0, row_logits.shape[0]) else row_logits[s:e]

    def _step_logits(self, logits: torch.Tensor, reqs: dict, steps: list, a: int) -> torch.Tensor:
        """The sliced logits of the requests that carry a step, in order: ``(len(steps), T, V)``
        when they share their span of ``T`` tokens (one view of the forward's logits, or one
        selection), else their spans concatenated, ``(sum of T, V)``."""
        spans = [reqs[i].logits.indices(len(reqs[i].positions))[:2] for i in steps]
        if len(set(spans)) > 1:
            rows = logits.unbind(0)
            return torch.cat([rows[i - a][s:e] for i, (s, e) in zip(steps, spans)])
        if steps != list(range(a, a + logits.shape[0])):
            lo, hi = steps[0] - a, steps[-1] - a + 1
            if steps == list(range(steps[0], steps[-1] + 1)):
                logits = logits[lo:hi]
            else:
                logits = logits.index_select(0, to_device([i - a for i in steps], logits.device))
        s, e = spans[0]
        return logits if (s, e) == (0, logits.shape[1]) else logits[:, s:e]
