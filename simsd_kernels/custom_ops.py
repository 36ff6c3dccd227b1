"""``torch.library`` custom ops ``simsd::temporal_attention``, ``simsd::attention_with_kvcache``
and ``simsd::append_kv``: the door (:mod:`simsd_kernels.metadata`) and the cache write under
``torch.compile``.

Registering the ops makes them opaque to ``torch.compile`` (no graph break, no tracing into
Triton or CUDA launch code) and gives them fake (meta) implementations, so compiled graphs and
CUDA-graph capture see the output shape without running a kernel. Eager code calls the door
directly (no custom-op dispatch per layer); a compiled graph calls these ops, which run the door
eagerly: the backend is chosen by name (``auto | cuda | triton | torch``) and the configuration at
hand with :func:`simsd_kernels.backends.resolve_backend` (cached; self-checked on first use) and
its door opened (:func:`~simsd_kernels.prepare.prepare_attention`,
:func:`~simsd_kernels.prepare.prepare_append_kv`).

Schemas (shapes as in :func:`simsd_kernels.temporal_attention`)::

    simsd::temporal_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache,
        Tensor cache_seqlens, Tensor labels, Tensor positions, int mask_mode, float rope_theta,
        float softmax_scale, str backend, bool shape_invariant=False,
        Tensor? block_table=None) -> Tensor  # (B, Lq, Hq, D); caches: page pools with a block_table
    simsd::attention_with_kvcache(the same, with Tensor(a!) k_cache, Tensor(b!) v_cache) -> Tensor
    simsd::append_kv(Tensor k, Tensor v, Tensor positions, Tensor(a!) k_cache,
        Tensor(b!) v_cache, Tensor cache_seqlens, float rope_theta, int num_tokens,
        str backend, Tensor? block_table=None) -> ()
"""
from __future__ import annotations

import torch
from torch import Tensor

from .metadata import capacity_of
from .prepare import prepare_append_kv, prepare_attention


def _prepared(q, k, k_cache, cache_seqlens, labels, positions, mask_mode, rope_theta, softmax_scale, backend,
              shape_invariant, block_table):
    return prepare_attention(cache_seqlens, labels, positions, num_heads=q.shape[2], num_kv_heads=k.shape[2],
                             head_dim=q.shape[3], dtype=q.dtype, cache_capacity=capacity_of(k_cache, block_table),
                             mask_mode=mask_mode, rope_theta=rope_theta, softmax_scale=softmax_scale, backend=backend,
                             shape_invariant=shape_invariant, block_table=block_table)


@torch.library.custom_op("simsd::temporal_attention", mutates_args=())
def temporal_attention_op(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                          cache_seqlens: Tensor, labels: Tensor, positions: Tensor, mask_mode: int,
                          rope_theta: float, softmax_scale: float, backend: str,
                          shape_invariant: bool = False, block_table: Tensor | None = None) -> Tensor:
    meta = _prepared(q, k, k_cache, cache_seqlens, labels, positions, mask_mode, rope_theta, softmax_scale, backend,
                     shape_invariant, block_table)
    return meta.attend(q, k, v, k_cache, v_cache).contiguous()


@temporal_attention_op.register_fake
def _temporal_attention_fake(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode,
                             rope_theta, softmax_scale, backend, shape_invariant=False,
                             block_table=None):
    return q.new_empty(q.shape)


@torch.library.custom_op("simsd::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_op(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                              cache_seqlens: Tensor, labels: Tensor, positions: Tensor, mask_mode: int,
                              rope_theta: float, softmax_scale: float, backend: str,
                              shape_invariant: bool = False, block_table: Tensor | None = None) -> Tensor:
    meta = _prepared(q, k, k_cache, cache_seqlens, labels, positions, mask_mode, rope_theta, softmax_scale, backend,
                     shape_invariant, block_table)
    return meta.forward(q, k, v, k_cache, v_cache).contiguous()


@attention_with_kvcache_op.register_fake
def _attention_with_kvcache_fake(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode,
                                 rope_theta, softmax_scale, backend, shape_invariant=False,
                             block_table=None):
    return q.new_empty(q.shape)


@torch.library.custom_op("simsd::append_kv", mutates_args=("k_cache", "v_cache"))
def append_kv_op(k: Tensor, v: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
                 cache_seqlens: Tensor, rope_theta: float, num_tokens: int, backend: str,
                 block_table: Tensor | None = None) -> None:
    door = prepare_append_kv(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta=rope_theta,
                             num_tokens=num_tokens, backend=backend, block_table=block_table)
    door.append_kv(k, v, k_cache, v_cache, num_tokens)


@append_kv_op.register_fake
def _append_kv_fake(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta, num_tokens, backend,
                    block_table=None):
    return None
