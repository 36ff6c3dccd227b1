"""The attention door: one forward's metadata, prepared once, then one call per layer.

    meta = prepare_attention(cache_seqlens, labels, positions, num_heads=..., num_kv_heads=...,
                             head_dim=..., dtype=..., cache_capacity=..., mask_mode=..., rope_theta=...)
    for layer in layers:
        out = meta.forward(q, k, v, k_cache[layer], v_cache[layer])   # write the new K/V, attend
    cache_seqlens += num_write                                        # the caller advances the rows

:func:`~simsd_kernels.prepare.prepare_attention` (``simsd_kernels/prepare.py``) builds it. The shape
of flash-attention's ``flash_attn_with_kvcache`` and vLLM's attention metadata:
:func:`prepare_attention` validates the forward's inputs, resolves the backend (self-check
included, :func:`simsd_kernels.backends.resolve_backend`) and opens the backend's door, which plans
the forward (:attr:`Backend.kvcache <simsd_kernels.backends.Backend>`, a subclass of
:class:`AttentionMetadata`: the torch backend's host read, RoPE tables and SDPA calls; the fused
backends' split plan) -- once per forward, not per layer. Its :meth:`~AttentionMetadata.forward`
(the backend's own, launching its kernels directly) then rotates the layer's new q and k once, writes the rotated k
and v of all ``Lq`` new tokens at slots ``cache_seqlens[b] + i`` (slots past the capacity are
skipped: the caller keeps ``Lq`` free slots past every row's length, then advances each row by its
own write count) and attends. :meth:`AttentionMetadata.attend` is the same without the write
(:func:`simsd_kernels.temporal_attention`).

Under ``torch.compile`` the backend is resolved when the op runs, inside the custom ops of
:mod:`simsd_kernels.custom_ops` (opaque to the compiler, with fake implementations).
"""
from __future__ import annotations

import torch

from .mask_rule import MaskMode

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
    _check("positions", positions, 2, torch.int64)
    if positions.shape != (B, Lq):
        raise ValueError(f"positions must be (B={B}, Lq={Lq}), got {tuple(positions.shape)}")
    _check("cache_seqlens", cache_seqlens, 1, torch.int32)
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens must be (B={B},), got {tuple(cache_seqlens.shape)}")
    devices = {t.device for t in (cache_seqlens, labels, positions)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def validate_attention_args(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, head_dims=None):
    """Raise ``ValueError`` naming the argument when shapes, dtypes or devices do not fit."""
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
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(name, t, 4, q.dtype)
        if t.shape[0] != B or t.shape[2:] != (Hkv, D):
            raise ValueError(f"{name} must be (B={B}, Lmax, Hkv={Hkv}, D={D}), got {tuple(t.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    validate_forward_inputs(cache_seqlens, labels, positions, B, Lq)
    if head_dims is not None and D not in head_dims:
        raise ValueError(f"head_dim {D} is not supported by this backend (supported: {head_dims})")
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {D}")
    devices = {t.device for t in (q, k, v, k_cache, v_cache, cache_seqlens, labels, positions)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


class AttentionMetadata:
    """One forward's attention, and the door every layer calls (built by :func:`prepare_attention`;
    read-only afterwards).

    Each backend's door is a subclass whose :meth:`forward` launches that backend's kernels
    directly (:attr:`Backend.kvcache <simsd_kernels.backends.Backend>`: the torch backend's
    :class:`~simsd_kernels.torch_backend.TorchAttention`, the CUDA and Triton backends' doors;
    :class:`ComposedAttention` for a backend without one), so a layer's call reaches the kernel
    in one hop. This class itself is the door while ``torch.compile`` traces: the backend is
    then resolved inside the custom ops of :mod:`simsd_kernels.custom_ops`.

    Attributes: ``backend`` (the resolved :class:`~simsd_kernels.backends.Backend`, or its
    requested name while ``torch.compile`` traces), ``cache_seqlens (B,)`` int32, ``labels
    (B, Lq, 3)`` int32, ``positions (B, Lq)`` int64, ``mask_mode`` (:class:`MaskMode`),
    ``rope_theta``, ``softmax_scale``, ``shape_invariant``, ``num_heads``, ``num_kv_heads``,
    ``group``, ``head_dim``, ``dtype``, ``cache_capacity``, ``B``, ``Lq``.
    """

    def __init__(self, backend, cache_seqlens, labels, positions, mask_mode: MaskMode, rope_theta: float,
                 softmax_scale: float, shape_invariant: bool, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, cache_capacity: int):
        self.backend = backend
        self.cache_seqlens, self.labels, self.positions = cache_seqlens, labels, positions
        self.mask_mode, self.rope_theta, self.softmax_scale = mask_mode, rope_theta, softmax_scale
        self.shape_invariant = shape_invariant
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.dtype, self.cache_capacity = dtype, cache_capacity
        self.B, self.Lq = labels.shape[:2]
        kv = (self.B, self.Lq, num_kv_heads, head_dim)
        cache = torch.Size((self.B, cache_capacity, num_kv_heads, head_dim))
        self._shapes = (torch.Size((self.B, self.Lq, num_heads, head_dim)), torch.Size(kv), torch.Size(kv), cache,
                        cache)
        self._validated = False

    def _check(self, q, k, v, k_cache, v_cache) -> None:
        """Full validation at the first call, then only that the shapes and dtypes are the same."""
        if (q.shape, k.shape, v.shape, k_cache.shape, v_cache.shape) == self._shapes and \
                q.dtype == self.dtype and k_cache.dtype == self.dtype and self._validated:
            return
        validate_attention_args(q, k, v, k_cache, v_cache, self.cache_seqlens, self.labels, self.positions)
        got = (q.shape, k.shape, v.shape, k_cache.shape, v_cache.shape)
        if got != self._shapes or q.dtype != self.dtype:
            raise ValueError(f"the attention was prepared for q, k, v, k_cache, v_cache of shapes "
                             f"{[tuple(s) for s in self._shapes]} in {self.dtype}, got "
                             f"{[tuple(s) for s in got]} in {q.dtype}")
        self._validated = True

    def forward(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        """Rotate ``q (B, Lq, Hq, D)`` and ``k (B, Lq, Hkv, D)`` once, write the rotated k and
        ``v`` into ``k_cache, v_cache (B, Lmax, Hkv, D)`` at ``cache_seqlens[b] + i`` (slots
        ``>= Lmax`` skipped), attend over the cache ``[0, cache_seqlens[b])`` and the new tokens
        by the mask rule. Returns ``(B, Lq, Hq, D)`` in q's dtype (possibly a strided view).
        ``cache_seqlens`` is not advanced (the caller owns it). Every backend's door keeps this
        contract.

        Raises:
            ValueError: tensors that do not fit the prepared shapes (named, as
                :func:`validate_attention_args`).
        """
        self._check(q, k, v, k_cache, v_cache)
        # registered by simsd_kernels.custom_ops (imported with the package), called by name
        return torch.ops.simsd.attention_with_kvcache(q, k, v, k_cache, v_cache, *self._op_args())

    def attend(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        """:meth:`forward` without the cache write."""
        self._check(q, k, v, k_cache, v_cache)
        return torch.ops.simsd.temporal_attention(q, k, v, k_cache, v_cache, *self._op_args())

    def _op_args(self) -> tuple:
        return (self.cache_seqlens, self.labels, self.positions, int(self.mask_mode), float(self.rope_theta),
                float(self.softmax_scale), str(self.backend), bool(self.shape_invariant))


class ComposedAttention(AttentionMetadata):
    """The door of a backend without its own (:attr:`Backend.kvcache` None): its ``attention``,
    then its ``append_kv`` of all ``Lq`` tokens."""

    def forward(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        out = self.attend(q, k, v, k_cache, v_cache)
        self.backend.append_kv(k, v, self.positions, k_cache, v_cache, self.cache_seqlens, self.rope_theta, self.Lq)
        return out

    def attend(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        self._check(q, k, v, k_cache, v_cache)
        extra = {"shape_invariant": True} if self.shape_invariant and self.backend.plan_options else {}
        return self.backend.attention(q, k, v, k_cache, v_cache, self.cache_seqlens, self.labels, self.positions,
                                      int(self.mask_mode), self.rope_theta, self.softmax_scale, **extra)


def open_door(backend, cache_seqlens, labels, positions, mask_mode: MaskMode, rope_theta: float, softmax_scale: float,
              shape_invariant: bool, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              cache_capacity: int) -> AttentionMetadata:
    """The door of ``backend`` (a resolved :class:`~simsd_kernels.backends.Backend`, or a name
    while ``torch.compile`` traces) for one forward, arguments already validated: its
    :attr:`~simsd_kernels.backends.Backend.kvcache` class (:class:`ComposedAttention` when it has
    none) plans the forward here, once."""
    cls = AttentionMetadata if isinstance(backend, str) else backend.kvcache or ComposedAttention
    return cls(backend, cache_seqlens, labels, positions, mask_mode, rope_theta, softmax_scale, shape_invariant,
               num_heads, num_kv_heads, head_dim, dtype, cache_capacity)
