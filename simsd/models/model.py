"""Native PyTorch implementation of the SDAR architecture (the Qwen3 decoder).

RMSNorm (eps from the config) -> attention -> residual -> RMSNorm -> SwiGLU MLP -> residual;
final norm; ``lm_head``. Attention: q/k/v/o projections without bias, GQA, per-head RMSNorm
on q and k (weights of size ``head_dim``) before rotate-half RoPE, scale ``head_dim ** -0.5``.
Parameter names equal Qwen3's, so HF state dicts load as they are.

The forward takes explicit position ids and per-token mask labels and runs attention through
:func:`simsd_kernels.temporal_attention` over a static :class:`~simsd.models.cache.KVCache`.
No shift: the logits at position ``p`` predict the token at ``p`` (SDAR).

Shape-invariant numerics (``SDARForCausalLM.invariant``, docs/design.md §4.2): a token's logits
must not depend on how many other tokens share its forward, so that an exact-mode verify
copy gets the bits of a denoise forward of the same state. Matrix products round in an order
that may depend on the number of rows (BLAS blocking: measured on the CPU, float32 products of
1 or 2 rows differ from the same rows inside a larger product), so with ``invariant`` every
token-wise part of a layer (norms, projections, RoPE inputs, MLP) runs separately on each
*unit* of ``unit`` consecutive tokens of a row (the block length: a denoise block, a verify
copy, a commit, a prefill block), on a fresh contiguous tensor: a unit's result is the result
of the same call on the same data wherever the unit sits. Attention is invariant in the torch
backend (:func:`simsd_kernels.reference.temporal_attention_torch` computes each group of
tokens over exactly its visible keys); with ``invariant`` the Triton and CUDA kernels get
``shape_invariant=True``: a split plan (query tile, split count and boundaries) that depends on
the cache capacity and the device only, not on the query length or the batch (see the README
for what is tested and what is not promised).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import simsd_kernels
from simsd_kernels import KIND_KNOWN

from .cache import KVCache
from .config import ModelConfig
from .moe import SparseMoeBlock


def labels_for(n: int, device, kind: int = KIND_KNOWN, tau: int = 0, grp=0) -> torch.Tensor:
    """Mask labels ``(1, n, 3)`` int32 ``(kind, tau, grp)``; ``grp``: an int or an ``(n,)``
    tensor on ``device`` (ints are filled in place: no host-to-device copy)."""
    lab = torch.zeros(1, n, 3, dtype=torch.int32, device=device)
    lab[..., 0] = kind
    lab[..., 1] = tau
    lab[..., 2] = grp
    return lab


def per_unit(fn, unit: int, x: torch.Tensor):
    """``fn`` applied separately to each unit of ``unit`` consecutive tokens of each row of
    ``x (B, L, ...)`` (the last unit of a row may be shorter), each unit a fresh contiguous
    ``(1, U, ...)`` tensor; the results (a tensor or a tuple of tensors ``(1, U, ...)``) are
    concatenated back to ``(B, L, ...)``. A unit's result is then that of one fixed call on
    its own data, whatever else the forward holds."""
    B, L = x.shape[:2]
    rows = []
    for b in range(B):
        outs = [fn(x[b:b + 1, s:s + unit].clone()) for s in range(0, L, unit)]
        if isinstance(outs[0], tuple):
            rows.append(tuple(torch.cat(parts, 1) for parts in zip(*outs)))
        else:
            rows.append(torch.cat(outs, 1))
    if isinstance(rows[0], tuple):
        return tuple(torch.cat(parts, 0) for parts in zip(*rows))
    return torch.cat(rows, 0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32) if dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rope_theta = c.rope_theta
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def qkv(self, x):
        """Projections of ``x (B, L, hidden)``: q ``(B, L, Hq, D)``, k and v ``(B, L, Hkv, D)``
        (q and k RMS-normalised per head, not rotated)."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, L, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, L, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x, positions, labels, mask_mode, cache: KVCache, num_write: int, backend: str):
        q, k, v = self.qkv(x)
        return self.o_proj(self.attend(q, k, v, positions, labels, mask_mode, cache, num_write, backend))

    def attend(self, q, k, v, positions, labels, mask_mode, cache: KVCache, num_write: int, backend: str,
               invariant: bool = False):
        """Attention over the cache and the new tokens, and their cache write; ``(B, L, Hq * D)``.
        ``invariant``: the fused kernels' shape-invariant split plan (``shape_invariant``)."""
        B, L = q.shape[:2]
        kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
        out = simsd_kernels.temporal_attention(
            q, k, v, kc, vc, cache.seqlens, labels, positions,
            mask_mode=mask_mode, rope_theta=self.rope_theta, backend=backend, shape_invariant=invariant,
        )
        if isinstance(num_write, torch.Tensor):  # per-row counts: write all L, rows advance by their own
            simsd_kernels.append_kv(k, v, positions, kc, vc, cache.seqlens, rope_theta=self.rope_theta,
                                    num_tokens=L, backend=backend)
        elif num_write:
            simsd_kernels.append_kv(k, v, positions, kc, vc, cache.seqlens, rope_theta=self.rope_theta,
                                    num_tokens=num_write, backend=backend)
        return out.reshape(B, L, self.num_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = SparseMoeBlock(config) if config.is_moe_layer(layer_idx) else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, labels, mask_mode, cache, num_write, backend, unit=None):
        """``unit``: run the token-wise parts per unit of that many tokens (:func:`per_unit`)."""
        if unit is None:
            x = x + self.self_attn(self.input_layernorm(x), positions, labels, mask_mode, cache, num_write, backend)
            return x + self.mlp(self.post_attention_layernorm(x))
        att = self.self_attn
        q, k, v = per_unit(lambda t: att.qkv(self.input_layernorm(t)), unit, x)
        out = att.attend(q, k, v, positions, labels, mask_mode, cache, num_write, backend, invariant=True)
        x = x + per_unit(att.o_proj, unit, out)
        return x + per_unit(lambda t: self.mlp(self.post_attention_layernorm(t)), unit, x)


class SDARBackbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class SDARForCausalLM(nn.Module):
    """SDAR / Qwen3 decoder with simsd's cache-aware forward.

    Attribute ``attention_backend`` (``auto | cuda | triton | torch``) is passed to every
    attention call. Attribute ``invariant`` (bool, default False): shape-invariant numerics
    (module doc) for forwards that pass ``unit``.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = SDARBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.attention_backend = "auto"
        self.invariant = False
        #: kv heads held by this process (fewer under tensor parallelism, see :mod:`simsd.engine.tp`)
        self.num_local_kv_heads = config.num_key_value_heads
        self.tp = (0, 1)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, batch_size, max_len, self.num_local_kv_heads, c.head_dim, self.dtype,
                       self.device)

    @torch.no_grad()
    def forward(self, input_ids, positions, labels, mask_mode, cache: KVCache, num_write: int = 0,
                logits_slice: slice | None = slice(None), unit: int | None = None):
        """One forward of ``L`` new tokens per row over the cache.

        Args:
            input_ids: ``(B, L)`` int64 token ids.
            positions: ``(B, L)`` int64 RoPE positions.
            labels: ``(B, L, 3)`` int32 ``(kind, tau, grp)`` (see :mod:`simsd_kernels.mask_rule`).
            mask_mode: ``"bidirectional" | "block_causal" | "exact" | "paper"``.
            cache: the static cache; rows read ``[0, cache.seqlens[b])``.
            num_write: the first ``num_write`` tokens of every row are written into the cache
                and ``cache.seqlens`` advances by it after the forward (0: read-only forward).
                A ``(B,)`` int tensor gives per-row counts: then all ``L`` tokens of every row
                are written at ``seqlens[b]..`` and row ``b`` advances by ``num_write[b]``; the
                slots past a row's new length are never read and are overwritten by its next
                write, but the cache needs ``L`` free slots past every row's length.
            logits_slice: which of the ``L`` tokens get logits (None: no lm_head at all).
            unit: with ``invariant`` set, the token-wise parts of every layer, the final norm
                and ``lm_head`` run per unit of ``unit`` consecutive tokens of a row (the block
                length; units of ``logits_slice`` count from its start); ignored otherwise.

        Returns:
            float32 logits ``(B, L', vocab)`` for the sliced tokens, or None.
        """
        unit = unit if self.invariant else None
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, labels, mask_mode, cache, num_write, self.attention_backend, unit)
        if isinstance(num_write, torch.Tensor) or num_write:
            cache.advance(num_write)
        if logits_slice is None:
            return None
        x = x[:, logits_slice]
        if unit is None:
            return self.lm_head(self.model.norm(x)).float()
        return per_unit(lambda t: self.lm_head(self.model.norm(t)), unit, x).float()
