"""``torch.library`` custom ops ``simsd::temporal_attention`` and ``simsd::append_kv``.

Registering the ops makes them opaque to ``torch.compile`` (no graph break, no tracing into
Triton or CUDA launch code) and gives them fake (meta) implementations, so compiled graphs and
CUDA-graph capture see the output shape without running a kernel. The backend is chosen at run
time by name (``auto | cuda | triton | torch``) and the configuration at hand with
:func:`simsd_kernels.backends.resolve_backend` (cached; self-checked on first use).

Schemas (shapes as in :func:`simsd_kernels.temporal_attention`)::

    simsd::temporal_attention(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache,
        Tensor cache_seqlens, Tensor labels, Tensor positions, int mask_mode, float rope_theta,
        float softmax_scale, str backend, bool shape_invariant=False) -> Tensor  # (B, Lq, Hq, D)
    simsd::append_kv(Tensor k, Tensor v, Tensor positions, Tensor(a!) k_cache,
        Tensor(b!) v_cache, Tensor cache_seqlens, float rope_theta, int num_tokens,
        str backend) -> ()
"""
from __future__ import annotations

import torch
from torch import Tensor

from .backends import OpConfig, resolve_backend


@torch.library.custom_op("simsd::temporal_attention", mutates_args=())
def temporal_attention_op(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                          cache_seqlens: Tensor, labels: Tensor, positions: Tensor, mask_mode: int,
                          rope_theta: float, softmax_scale: float, backend: str,
                          shape_invariant: bool = False) -> Tensor:
    impl = resolve_backend(backend, q.device, OpConfig("attention", q.dtype, q.shape[3], q.shape[2] // k.shape[2],
                                                       mask_mode))
    # the fused backends take the split plan's invariant rule; the torch reference has no split plan
    extra = {"shape_invariant": True} if shape_invariant and impl.name != "torch" else {}
    out = impl.attention(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode,
                         rope_theta, softmax_scale, **extra)
    return out if out.is_contiguous() else out.contiguous()


@temporal_attention_op.register_fake
def _temporal_attention_fake(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode,
                             rope_theta, softmax_scale, backend, shape_invariant=False):
    return q.new_empty(q.shape)


@torch.library.custom_op("simsd::append_kv", mutates_args=("k_cache", "v_cache"))
def append_kv_op(k: Tensor, v: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
                 cache_seqlens: Tensor, rope_theta: float, num_tokens: int, backend: str) -> None:
    impl = resolve_backend(backend, k.device, OpConfig("append_kv", k.dtype, k.shape[3]))
    impl.append_kv(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta, num_tokens)


@append_kv_op.register_fake
def _append_kv_fake(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta, num_tokens, backend):
    return None
