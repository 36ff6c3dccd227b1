"""The attention backends' common class: one backend = one door class, one forward = one door.

    meta = prepare_attention(cache_seqlens, labels, positions, num_heads=..., num_kv_heads=...,
                             head_dim=..., dtype=..., cache_capacity=..., mask_mode=..., rope_theta=...)
    for layer in layers:
        out = meta.forward(q, k, v, k_cache[layer], v_cache[layer])   # write the new K/V, attend
    cache_seqlens += num_write                                        # the caller advances the rows

The shape of flash-attention's ``flash_attn_with_kvcache`` and vLLM's attention backends and
metadata. A backend is a subclass of :class:`AttentionMetadata`: the class says what the backend is
(its name, the dtypes and head dims it supports, where it is available, whether ``auto`` may choose
it) and an instance is one forward's door. :func:`~simsd_kernels.prepare.prepare_attention`
(``simsd_kernels/prepare.py``) validates the forward's inputs, resolves the backend (self-check
included, :func:`simsd_kernels.backends.resolve_backend`) and opens its door, which plans the
forward (the torch backend's host read, RoPE tables and SDPA calls; the fused backends' split plan)
-- once per forward, not per layer. Its :meth:`~AttentionMetadata.forward` (launching the backend's
kernels directly) then rotates the layer's new q and k once, writes the rotated k and v of all
``Lq`` new tokens at slots ``cache_seqlens[b] + i`` (slots past the capacity are skipped: the
caller keeps ``Lq`` free slots past every row's length, then advances each row by its own write
count) and attends. :meth:`AttentionMetadata.attend` is the same without the write
(:func:`simsd_kernels.temporal_attention`), :meth:`AttentionMetadata.append_kv` the write alone
(:func:`simsd_kernels.append_kv`).

Caches are page pools read and written through a ``block_table`` (:mod:`simsd_kernels.paging`:
``k_cache[block_table[b, s // page_size], s % page_size]`` holds row b's slot s); a door opened
without one reads ``(B, Lmax, Hkv, D)`` caches through the one-page-per-row table.

Under ``torch.compile`` the door is :class:`TracedAttention`: the backend is resolved when the op
runs, inside the custom ops of :mod:`simsd_kernels.custom_ops` (opaque to the compiler, with fake
implementations).
"""
from __future__ import annotations

import torch

from .mask_rule import MaskMode, parse_mask_mode
from .paging import check_block_table, identity_table, page_size_of

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(name, t, ndim, dtype=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def validate_forward_inputs(cache_seqlens, labels, positions, B: int | None = None, Lq: int | None = None):
    """Raise ``ValueError`` naming the argument unless ``labels (B, Lq, 3)`` int32, ``positions
    (B, Lq)`` int64 and ``cache_seqlens (B,)`` int32 fit and share a device (``B``, ``Lq``: from
    ``labels`` when not given)."""
    _check("labels", labels, 3, torch.int32)
    if B is None:
        B, Lq = labels.shape[:2]
    if labels.shape != (B, Lq, 3):
        raise ValueError(f"labels must be (B={B}, Lq={Lq}, 3), got {tuple(labels.shape)}")
    _check_positions_and_lens(positions, cache_seqlens, B, Lq, "Lq")
    _one_device(cache_seqlens, labels, positions)


def validate_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, block_table=None):
    """Raise ``ValueError`` naming the argument when shapes, dtypes or devices do not fit (caches
    ``(B, Lmax, Hkv, D)`` without ``block_table``, page pools ``(num_pages, page_size, Hkv, D)``
    with a ``block_table (B, max_pages) int32``: :mod:`simsd_kernels.paging`)."""
    _check("q", q, 4, _FLOAT_DTYPES)
    B, Lq, Hq, D = q.shape
    for name, t in (("k", k), ("v", v)):
        _check(name, t, 4, q.dtype)
        if t.shape[:2] != (B, Lq) or t.shape[3] != D:
            raise ValueError(f"{name} must be (B={B}, Lq={Lq}, Hkv, D={D}), got {tuple(t.shape)}")
    Hkv = k.shape[2]
    if v.shape[2] != Hkv:
        raise ValueError(f"k and v must have the same number of kv heads, got {k.shape[2]} and {v.shape[2]}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"GQA: Hq={Hq} must be a multiple of Hkv={Hkv}")
    _check_caches(k_cache, v_cache, B, Hkv, D, q.dtype, block_table)
    validate_forward_inputs(cache_seqlens, labels, positions, B, Lq)
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {D}")
    _one_device(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions,
                *(() if block_table is None else (block_table,)))


def validate_append_args(k, v, positions, k_cache, v_cache, cache_seqlens, num_tokens: int, block_table=None):
    """Raise ``ValueError`` naming the argument unless ``k, v (B, L, Hkv, D)`` (one float dtype),
    ``positions (B, L)`` int64, ``k_cache, v_cache (B, Lmax, Hkv, D)`` of k's dtype (page pools
    ``(num_pages, page_size, Hkv, D)`` with a ``block_table (B, max_pages) int32``) and
    ``cache_seqlens (B,)`` int32 fit, share a device, and ``0 <= num_tokens <= L``."""
    _check("k", k, 4, _FLOAT_DTYPES)
    B, L, Hkv, D = k.shape
    _check("v", v, 4, k.dtype)
    if v.shape != k.shape:
        raise ValueError(f"v must be shaped as k (B={B}, L={L}, Hkv={Hkv}, D={D}), got {tuple(v.shape)}")
    _check_caches(k_cache, v_cache, B, Hkv, D, k.dtype, block_table)
    _check_positions_and_lens(positions, cache_seqlens, B, L, "L")
    if not 0 <= num_tokens <= L:
        raise ValueError(f"num_tokens must be in [0, {L}], got {num_tokens}")
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {D}")
    _one_device(k, v, positions, k_cache, v_cache, cache_seqlens, *(() if block_table is None else (block_table,)))


def _check_positions_and_lens(positions, cache_seqlens, B: int, L: int, length: str) -> None:
    """``positions (B, L)`` int64 and ``cache_seqlens (B,)`` int32, else a ``ValueError`` naming
    the argument (``length``: what the caller calls ``L``)."""
    _check("positions", positions, 2, torch.int64)
    if positions.shape != (B, L):
        raise ValueError(f"positions must be (B={B}, {length}={L}), got {tuple(positions.shape)}")
    _check("cache_seqlens", cache_seqlens, 1, torch.int32)
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens must be (B={B},), got {tuple(cache_seqlens.shape)}")


def _one_device(*tensors) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def capacity_of(k_cache, block_table=None) -> int:
    """Logical slots per row: ``Lmax`` of a ``(B, Lmax, Hkv, D)`` cache, ``max_pages * page_size``
    of a page pool ``(num_pages, page_size, Hkv, D)`` read through ``block_table (B, max_pages)``."""
    return k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])


def _check_caches(k_cache, v_cache, B: int, Hkv: int, D: int, dtype, block_table=None) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(name, t, 4, dtype)
        if block_table is None and (t.shape[0] != B or t.shape[2:] != (Hkv, D)):
            raise ValueError(f"{name} must be (B={B}, Lmax, Hkv={Hkv}, D={D}), got {tuple(t.shape)}")
        if block_table is not None and t.shape[2:] != (Hkv, D):
            raise ValueError(f"{name} must be a page pool (num_pages, page_size, Hkv={Hkv}, D={D}), "
                             f"got {tuple(t.shape)}")
    if block_table is not None:
        check_block_table(block_table, B)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")


class AttentionMetadata:
    """An attention backend (the class) and one forward's door to it (an instance).

    Each backend is one subclass (:class:`~simsd_kernels.torch_backend.TorchAttention`,
    :class:`~simsd_kernels.triton_backend.TritonAttention`,
    :class:`~simsd_kernels.cuda_backend.CudaAttention`) that declares what it is on the class --
    :attr:`name`, the supported set (:attr:`dtypes`, :attr:`head_dims`), :attr:`auto_devices`,
    :attr:`plan_options`, :attr:`fused` -- and answers :meth:`is_available` and :meth:`supports`
    as class methods; :mod:`simsd_kernels.backends` resolves a name (or ``auto``) to the class.
    An instance is built once per forward (:func:`~simsd_kernels.prepare.prepare_attention`; it
    plans there: the torch backend's host read, RoPE tables and SDPA calls, the fused backends' split
    plan) and read-only afterwards; every layer calls :meth:`forward`, which launches the backend's
    kernels itself (one hop from a layer to a kernel). :meth:`attend` is the same without the cache
    write, :meth:`append_kv` the write alone. :class:`TracedAttention` is the door while
    ``torch.compile`` traces.

    Attributes (per instance): ``cache_seqlens (B,)`` int32, ``labels (B, Lq, 3)`` int32,
    ``positions (B, Lq)`` int64, ``mask_mode`` (:class:`MaskMode`), ``rope_theta``,
    ``softmax_scale``, ``shape_invariant``, ``num_splits``, ``num_heads``, ``num_kv_heads``,
    ``group``, ``head_dim``, ``dtype``, ``cache_capacity``, ``B``, ``Lq``.

    Raises (construction):
        ValueError: a dtype or head_dim outside the backend's supported set (:meth:`supports`).
    """

    #: the backend's name: what ``backend=`` and ``SIMSD_ATTENTION_BACKEND`` call it
    name: str = ""
    #: the supported set, checked by :meth:`supports` alone: the float dtypes of q, k, v and the
    #: caches, and the head dims (None: any even head_dim) its kernels are built for
    dtypes: tuple = _FLOAT_DTYPES
    head_dims: tuple | None = None
    #: device types on which ``auto`` may choose it (none: only by name; ``auto`` ends at torch)
    auto_devices: tuple = ()
    #: whether its plan takes a forced split count ``num_splits`` (the self-check's split-KV case)
    plan_options: bool = False
    #: fused kernels: the mask, RoPE and the softmax in one pass, no score matrix in memory and no
    #: host read (a forward can be captured in a CUDA graph); the torch reference is neither
    fused: bool = False

    @classmethod
    def is_available(cls, device) -> tuple:
        """``(ok, reason)``: whether the backend can run on ``device`` (a ``torch.device``)."""
        return True, ""

    @classmethod
    def supports(cls, dtype: torch.dtype, head_dim: int) -> tuple:
        """``(ok, reason)``: whether ``dtype`` and ``head_dim`` are in the backend's supported set
        (:attr:`dtypes`, :attr:`head_dims`); the reason names the value that is not."""
        if dtype not in cls.dtypes:
            return False, f"dtype {dtype} is not one of {cls.dtypes}"
        if cls.head_dims is not None and head_dim not in cls.head_dims:
            return False, f"head_dim {head_dim} is not one of {cls.head_dims}"
        return True, ""

    def __init__(self, cache_seqlens, labels, positions, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, cache_capacity: int, mask_mode: MaskMode, rope_theta: float,
                 softmax_scale: float, shape_invariant: bool = False, num_splits: int = 0, block_table=None):
        ok, why = self.supports(dtype, head_dim)
        if not ok:
            raise ValueError(f"attention backend {self.name!r}: {why}")
        self.cache_seqlens, self.labels, self.positions = cache_seqlens, labels, positions
        self.mask_mode, self.rope_theta, self.softmax_scale = MaskMode(mask_mode), rope_theta, softmax_scale
        self.shape_invariant, self.num_splits = shape_invariant, num_splits
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.dtype, self.cache_capacity = dtype, cache_capacity
        self.B, self.Lq = labels.shape[:2]
        # the page table (simsd_kernels.paging): given, or the contiguous case's one page per row
        self.paged = block_table is not None
        self.page_size = page_size_of(block_table, self.B, cache_capacity)
        self.block_table = block_table if self.paged else identity_table(self.B, labels.device)
        kv = (self.B, self.Lq, num_kv_heads, head_dim)
        self._shapes = (torch.Size((self.B, self.Lq, num_heads, head_dim)), torch.Size(kv), torch.Size(kv))
        self._pool = torch.Size((self.page_size, num_kv_heads, head_dim))
        self._validated = False

    def _fits(self, k_cache, v_cache) -> bool:
        """Whether the caches are the prepared pools: ``(B, Lmax, Hkv, D)`` without a block
        table, ``(num_pages, page_size, Hkv, D)`` with one, k's and v's shapes equal."""
        return k_cache.shape == v_cache.shape and k_cache.shape[1:] == self._pool and \
            (self.paged or k_cache.shape[0] == self.B)

    def _table(self):
        """The block table to validate against (None in the contiguous case)."""
        return self.block_table if self.paged else None

    @classmethod
    def open(cls, q, k, k_cache, cache_seqlens, labels, positions, *, mask_mode, rope_theta: float,
             softmax_scale: float | None = None, shape_invariant: bool = False, num_splits: int = 0,
             block_table=None):
        """This backend's door for one call on these tensors: the heads, head_dim, dtype and
        capacity read from ``q (B, Lq, Hq, D)``, ``k (B, Lq, Hkv, D)`` and ``k_cache (B, Lmax, Hkv,
        D)``; ``mask_mode`` a name or int; ``softmax_scale`` default ``D ** -0.5``; ``num_splits``
        (0: the backend's own plan) matters to a backend with :attr:`plan_options`; with
        ``block_table (B, max_pages) int32`` the caches are page pools ``(num_pages, page_size, Hkv,
        D)`` and the capacity ``max_pages * page_size`` (:mod:`simsd_kernels.paging`). The backend is
        neither resolved nor self-checked (the self-check opens the door it checks this way); the
        tensors are validated at the door's first call.

        Raises:
            ValueError: a dtype or head_dim the backend does not support, an unknown mask mode.
        """
        D = q.shape[3]
        return cls(cache_seqlens, labels, positions, num_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=D,
                   dtype=q.dtype, cache_capacity=capacity_of(k_cache, block_table),
                   mask_mode=parse_mask_mode(mask_mode), rope_theta=float(rope_theta),
                   softmax_scale=D ** -0.5 if softmax_scale is None else float(softmax_scale),
                   shape_invariant=bool(shape_invariant), num_splits=int(num_splits), block_table=block_table)

    @classmethod
    def open_write(cls, k, k_cache, cache_seqlens, positions, *, rope_theta: float, block_table=None):
        """This backend's door for writing the new tokens ``k (B, L, Hkv, D)`` at ``positions (B,
        L)`` into caches like ``k_cache (B, Lmax, Hkv, D)`` (page pools with ``block_table``) at
        ``cache_seqlens (B,)``
        (:meth:`append_kv`; its labels are zeros, the mask mode ``bidirectional``). Not resolved,
        not self-checked; validated at the first write.

        Raises:
            ValueError: a dtype or head_dim the backend does not support.
        """
        B, L, Hkv, D = k.shape
        labels = torch.zeros((B, L, 3), dtype=torch.int32, device=k.device)
        return cls(cache_seqlens, labels, positions, num_heads=Hkv, num_kv_heads=Hkv, head_dim=D, dtype=k.dtype,
                   cache_capacity=capacity_of(k_cache, block_table), mask_mode=MaskMode.BIDIRECTIONAL,
                   rope_theta=float(rope_theta), softmax_scale=D ** -0.5, block_table=block_table)

    def _check(self, q, k, v, k_cache, v_cache) -> None:
        """Full validation at the first call, then only that the shapes and dtypes are the same."""
        if (q.shape, k.shape, v.shape) == self._shapes and self._fits(k_cache, v_cache) and \
                q.dtype == self.dtype and k_cache.dtype == self.dtype and self._validated:
            return
        validate_attention_args(q, k, v, k_cache, v_cache, self.cache_seqlens, self.labels, self.positions,
                                self._table())
        got = (q.shape, k.shape, v.shape)
        if got != self._shapes or not self._fits(k_cache, v_cache) or q.dtype != self.dtype:
            raise ValueError(f"the attention was prepared for q, k, v of shapes {[tuple(s) for s in self._shapes]} "
                             f"and caches of pages {tuple(self._pool)} in {self.dtype}, got "
                             f"{[tuple(s) for s in got]}, k_cache {tuple(k_cache.shape)} in {q.dtype}")
        self._validated = True

    def _check_write(self, k, v, k_cache, v_cache, num_tokens) -> int:
        """:meth:`append_kv`'s arguments validated (in full at the first write, then only that the
        shapes and dtypes are the prepared ones); returns the number of tokens to write."""
        n = self.Lq if num_tokens is None else num_tokens
        if (k.shape, v.shape) == self._shapes[1:] and self._fits(k_cache, v_cache) and k.dtype == self.dtype and \
                k_cache.dtype == self.dtype and self._validated and 0 <= n <= self.Lq:
            return n
        validate_append_args(k, v, self.positions, k_cache, v_cache, self.cache_seqlens, n, self._table())
        got = (k.shape, v.shape)
        if got != self._shapes[1:] or not self._fits(k_cache, v_cache) or k.dtype != self.dtype:
            raise ValueError(f"the cache write was prepared for k, v of shapes {[tuple(s) for s in self._shapes[1:]]} "
                             f"and caches of pages {tuple(self._pool)} in {self.dtype}, got "
                             f"{[tuple(s) for s in got]}, k_cache {tuple(k_cache.shape)} in {k.dtype}")
        self._validated = True
        return n

    def forward(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        """Rotate ``q (B, Lq, Hq, D)`` and ``k (B, Lq, Hkv, D)`` once, write the rotated k and
        ``v`` into ``k_cache, v_cache (B, Lmax, Hkv, D)`` (or page pools through the door's
        ``block_table``) at ``cache_seqlens[b] + i`` (slots
        ``>= Lmax`` skipped), attend over the cache ``[0, cache_seqlens[b])`` and the new tokens
        by the mask rule. Returns ``(B, Lq, Hq, D)`` in q's dtype (possibly a strided view).
        ``cache_seqlens`` is not advanced (the caller owns it). Every backend keeps this contract;
        this default is :meth:`attend` then :meth:`append_kv` (the backends fuse them).

        Raises:
            ValueError: tensors that do not fit the prepared shapes (named, as
                :func:`validate_attention_args`).
        """
        out = self.attend(q, k, v, k_cache, v_cache)
        self.append_kv(k, v, k_cache, v_cache)
        return out

    def attend(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        """:meth:`forward` without the cache write (:func:`simsd_kernels.temporal_attention`)."""
        raise NotImplementedError(f"attention backend {self.name!r} has no attend")

    def append_kv(self, k, v, k_cache, v_cache, num_tokens: int | None = None) -> None:
        """:meth:`forward`'s cache write alone, of the first ``num_tokens`` (default ``Lq``) new
        tokens: ``k`` rotated at ``positions`` and ``v`` (``(B, Lq, Hkv, D)``) written into
        ``k_cache, v_cache (B, Lmax, Hkv, D)`` at ``cache_seqlens[b] + i`` (slots ``>= Lmax``
        skipped; :func:`simsd_kernels.append_kv`).

        Raises:
            ValueError: tensors that do not fit (named, as :func:`validate_append_args`).
        """
        raise NotImplementedError(f"attention backend {self.name!r} has no append_kv")


class TracedAttention(AttentionMetadata):
    """The door while ``torch.compile`` traces (:func:`~simsd_kernels.prepare.prepare_attention`):
    :meth:`forward` and :meth:`attend` are the custom ops ``simsd::attention_with_kvcache`` and
    ``simsd::temporal_attention`` (:mod:`simsd_kernels.custom_ops`, opaque to the compiler), which
    resolve the backend named ``requested`` and open its door when they run. ``name`` is the
    requested name."""

    def __init__(self, requested: str, *args, **kwargs):
        self.name = requested
        super().__init__(*args, **kwargs)

    def forward(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        self._check(q, k, v, k_cache, v_cache)
        # registered by simsd_kernels.custom_ops (imported with the package), called by name
        return torch.ops.simsd.attention_with_kvcache(q, k, v, k_cache, v_cache, *self._op_args())

    def attend(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        self._check(q, k, v, k_cache, v_cache)
        return torch.ops.simsd.temporal_attention(q, k, v, k_cache, v_cache, *self._op_args())

    def _op_args(self) -> tuple:
        return (self.cache_seqlens, self.labels, self.positions, int(self.mask_mode), float(self.rope_theta),
                float(self.softmax_scale), self.name, bool(self.shape_invariant), self._table())
