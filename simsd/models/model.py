"""Native PyTorch implementation of the SDAR architecture (the Qwen3 decoder).

RMSNorm (eps from the config) -> attention -> residual -> RMSNorm -> SwiGLU MLP -> residual;
final norm; ``lm_head``. Attention: q/k/v/o projections without bias, GQA, per-head RMSNorm
on q and k (weights of size ``head_dim``) before rotate-half RoPE, scale ``head_dim ** -0.5``.
Hidden states stay 2-D ``(tokens, hidden)`` through the layers; q, k, v come from one merged
projection and gate, up from another (as nano-vllm / vLLM merge them), q and k are normalised
in one pass over their heads. Parameter names (``state_dict``, ``load_state_dict``) equal
Qwen3's, so HF state dicts load as they are.

The forward takes explicit position ids and per-token mask labels. It builds one
:class:`~simsd.models.context.ForwardContext` (write counts, the attention prepared once:
:func:`simsd_kernels.prepare_attention`) that every layer reads; each layer's attention is one
call of the door over a static :class:`~simsd.models.cache.KVCache` (RoPE once, the new K/V
written, attention). No shift: the logits at position ``p`` predict the token at ``p`` (SDAR).

Shape-invariant numerics (``SDARForCausalLM.invariant``, docs/design.md §4.2): a token's logits
must not depend on how many other tokens share its forward, so that an exact-mode verify
copy gets the bits of a denoise forward of the same state. Matrix products round in an order
that may depend on the number of rows (BLAS blocking: measured on the CPU, float32 products of
1 or 2 rows differ from the same rows inside a larger product), so with ``invariant`` every
token-wise part of a layer (norms, projections, RoPE inputs, MLP) runs separately on each
*unit* of ``unit`` consecutive tokens of a row (the block length: a denoise block, a verify
copy, a commit, a prefill block), on a fresh contiguous tensor: a unit's result is the result
of the same call on the same data wherever the unit sits. Attention is invariant in the torch
backend (:mod:`simsd_kernels.torch_backend` computes each group of tokens over exactly its visible
keys); with ``invariant`` the Triton and CUDA kernels get
``shape_invariant=True``: a split plan (query tile, split count and boundaries) that depends on
the cache capacity and the device only, not on the query length or the batch (docs/exactness.md
"What is tested" says what is tested and what is not promised).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from simsd_kernels import KIND_KNOWN, parse_mask_mode, prepare_attention
from simsd_kernels.backends import OpConfig, resolve_backend

from .cache import KVCache
from .config import ModelConfig
from .context import ForwardContext, per_unit
from .moe import SparseMoeBlock


def labels_for(n: int, device, kind: int = KIND_KNOWN, tau: int = 0, grp=0) -> torch.Tensor:
    """Mask labels ``(1, n, 3)`` int32 ``(kind, tau, grp)``; ``grp``: an int or an ``(n,)``
    tensor on ``device`` (ints are filled in place: no host-to-device copy)."""
    lab = torch.zeros(1, n, 3, dtype=torch.int32, device=device)
    lab[..., 0] = kind
    lab[..., 1] = tau
    lab[..., 2] = grp
    return lab


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm over the last dim: normalised in float32, cast back to x's dtype, times
    ``weight`` (transformers' ``Qwen3RMSNorm``; the normalisation is ``F.rms_norm``, the same
    bits)."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def merged_names(module: nn.Module, merged: str, parts: tuple, sizes) -> None:
    """Keep the checkpoint's names for a merged projection (nano-vllm / vLLM merged linears): the
    module holds ``merged.weight``, the rows of the ``parts`` (e.g. q, k, v) one after another;
    ``state_dict`` splits it into ``<part>.weight`` (``sizes()``: their row counts) and
    ``load_state_dict`` concatenates them back."""
    def split(mod, state, prefix, local_metadata):
        w = state.pop(prefix + merged + ".weight", None)
        if w is not None:
            for name, part in zip(parts, w.split(sizes(), 0)):
                state[prefix + name + ".weight"] = part

    def concat(mod, state, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        names = [prefix + name + ".weight" for name in parts]
        if all(n in state for n in names):
            state[prefix + merged + ".weight"] = torch.cat([state.pop(n) for n in names], 0)

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(concat)


class Attention(nn.Module):
    """Qwen3 attention on ``(tokens, hidden)`` inputs; q, k and v from one merged projection
    (``qkv_proj``; the checkpoint's ``q_proj``, ``k_proj``, ``v_proj`` rows), q and k normalised
    per head in one pass, the rest through the forward's attention door (RoPE, cache write)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim,
                                  bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self._qk_norm, self._qk_norm_key = None, None
        merged_names(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"),
                     lambda: [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2)

    def qkv(self, x: torch.Tensor, lead: tuple = ()):
        """``x (T, hidden)`` -> q ``(*lead, Hq, D)``, k and v ``(*lead, Hkv, D)`` (q and k
        RMS-normalised per head, not rotated; q and k adjacent views of one tensor, v a view of
        the projection). ``lead``: the leading shape of the ``T`` tokens (default ``(T,)``;
        ``(B, L)`` gives the door's shapes without further views)."""
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = self.qkv_proj(x).view(*(lead or x.shape[:1]), Hq + 2 * Hkv, D).split([Hq + Hkv, Hkv], -2)
        q, k = (F.rms_norm(qk, (D,), eps=self.q_norm.eps) * self.qk_norm_weight()).split([Hq, Hkv], -2)
        return q, k, v

    def qk_norm_weight(self) -> torch.Tensor:
        """``(Hq + Hkv, D)``: ``q_norm.weight`` for each q head, then ``k_norm.weight`` for each k
        head, so that q and k are normalised and weighted by one product (the same elementwise
        products as two). Kept between forwards and rebuilt when either weight changes (its
        version counter, storage or the head counts: loading, ``.to()``, tensor parallelism)."""
        qw, kw = self.q_norm.weight, self.k_norm.weight
        key = (qw._version, kw._version, qw.data_ptr(), kw.data_ptr(), qw.dtype, self.num_heads, self.num_kv_heads)
        if self._qk_norm_key != key:
            self._qk_norm = torch.cat([qw.detach().expand(self.num_heads, -1),
                                       kw.detach().expand(self.num_kv_heads, -1)])
            self._qk_norm_key = key
        return self._qk_norm


class MLP(nn.Module):
    """SwiGLU with gate and up from one merged projection (``gate_up_proj``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        merged_names(self, "gate_up_proj", ("gate_proj", "up_proj"),
                     lambda: [self.gate_up_proj.weight.shape[0] // 2] * 2)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = SparseMoeBlock(config) if config.is_moe_layer(layer_idx) else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``x (B * L, hidden)``; with ``ctx.unit`` the token-wise parts run per unit (:func:`per_unit`).
        Attention is one call of the forward's door (:meth:`simsd_kernels.AttentionMetadata.forward`:
        RoPE, the new K/V written to this layer's cache, attention)."""
        att, unit = self.self_attn, ctx.unit
        B, L, i = ctx.B, ctx.L, att.layer_idx

        def token_wise(fn, t):
            return fn(t) if unit is None else per_unit(fn, ctx, t)
        if unit is None:
            q, k, v = att.qkv(self.input_layernorm(x), (B, L))
        else:
            q, k, v = (t.view(B, L, *t.shape[1:]) for t in per_unit(lambda t: att.qkv(self.input_layernorm(t)), ctx, x))
        o = ctx.attention.forward(q, k, v, ctx.cache.k[i], ctx.cache.v[i])
        x = x + token_wise(att.o_proj, o.reshape(B * L, att.num_heads * att.head_dim))
        return x + token_wise(lambda t: self.mlp(self.post_attention_layernorm(t)), x)


class SDARBackbone(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class SDARForCausalLM(nn.Module):
    """SDAR / Qwen3 decoder with simsd's cache-aware forward.

    Attribute ``attention_backend`` (``auto | cuda | triton | torch``) is resolved once per
    forward (:meth:`attention_backend_class` says what it resolves to). Attribute ``invariant``
    (bool, default False): shape-invariant numerics (module doc) for forwards that pass ``unit``.
    ``state_dict`` / ``load_state_dict`` use the checkpoint's (Qwen3's) parameter names, merged
    projections included.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = SDARBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.attention_backend = "auto"
        self.invariant = False
        #: q / kv heads held by this process (fewer under tensor parallelism, see :mod:`simsd.engine.tp`)
        self.num_local_heads = config.num_attention_heads
        self.num_local_kv_heads = config.num_key_value_heads
        self.tp = (0, 1)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def attention_backend_class(self, mask_mode=None) -> type:
        """What this model's attention runs on: the backend ``attention_backend`` resolves to on the
        model's device, its door class (a subclass of :class:`simsd_kernels.AttentionMetadata`:
        ``name``, ``fused``). With ``mask_mode`` as each forward of that mode resolves it (the
        model's dtype, head_dim and GQA group; self-check included), without one by availability
        alone.

        Raises:
            ValueError: a backend that cannot run here (named), as the forward would raise.
        """
        if mask_mode is None:
            return resolve_backend(self.attention_backend, self.device)
        group = self.num_local_heads // self.num_local_kv_heads
        config = OpConfig("attention", self.dtype, self.config.head_dim, group, int(parse_mask_mode(mask_mode)))
        return resolve_backend(self.attention_backend, self.device, config)

    def new_cache(self, batch_size: int, max_len: int, **paging) -> KVCache:
        """A :class:`KVCache` of this model's layers, local kv heads, dtype and device (``paging``:
        its ``page_size``, ``num_pages``, ``block_size``; default one page per row)."""
        c = self.config
        return KVCache(c.num_hidden_layers, batch_size, max_len, self.num_local_kv_heads, c.head_dim, self.dtype,
                       self.device, **paging)

    def context(self, positions, labels, mask_mode, cache: KVCache, num_write=0,
                unit: int | None = None) -> ForwardContext:
        """The :class:`~simsd.models.context.ForwardContext` of a forward (arguments as
        :meth:`forward`): write counts as a ``(B,)`` int32 tensor, the attention prepared once
        (backend resolved and self-checked, RoPE tables, the backend's plan)."""
        B = positions.shape[0]
        if isinstance(num_write, torch.Tensor):
            if num_write.shape != (B,):
                raise ValueError(f"num_write must be an int or a (B={B},) tensor, got shape {tuple(num_write.shape)}")
            num_write = num_write if num_write.dtype == torch.int32 else num_write.to(torch.int32)
        else:
            num_write = torch.full((B,), int(num_write), dtype=torch.int32, device=positions.device)
        unit = unit if self.invariant else None
        c = self.config
        attention = prepare_attention(cache.seqlens, labels, positions, num_heads=self.num_local_heads,
                                      num_kv_heads=self.num_local_kv_heads, head_dim=c.head_dim, dtype=self.dtype,
                                      cache_capacity=cache.max_len, mask_mode=mask_mode, rope_theta=c.rope_theta,
                                      backend=self.attention_backend, shape_invariant=unit is not None,
                                      block_table=cache.block_table)
        return ForwardContext(positions, labels, mask_mode, cache, num_write, attention, unit)

    @torch.no_grad()
    def forward(self, input_ids, positions, labels, mask_mode, cache: KVCache, num_write=0,
                logits_slice: slice | None = slice(None), unit: int | None = None):
        """One forward of ``L`` new tokens per row over the cache.

        Args:
            input_ids: ``(B, L)`` int64 token ids.
            positions: ``(B, L)`` int64 RoPE positions.
            labels: ``(B, L, 3)`` int32 ``(kind, tau, grp)`` (see :mod:`simsd_kernels.mask_rule`).
            mask_mode: ``"bidirectional" | "block_causal" | "exact" | "paper"``.
            cache: the static cache; rows read ``[0, cache.seqlens[b])``. Every layer writes the
                K/V of all ``L`` tokens of row ``b`` at ``seqlens[b]..`` (slots past the capacity
                are skipped: keep ``L`` free slots past every row's length); row ``b`` then
                advances by ``num_write[b]``: the slots past its new length are never read and
                are overwritten by its next write.
            num_write: ``(B,)`` int tensor of the tokens each row keeps, or an int for every row
                (0: a read-only forward).
            logits_slice: which of the ``L`` tokens get logits (None: no lm_head at all).
            unit: with ``invariant`` set, the token-wise parts of every layer, the final norm
                and ``lm_head`` run per unit of ``unit`` consecutive tokens of a row (the block
                length; units of ``logits_slice`` count from its start); ignored otherwise.

        Returns:
            float32 logits ``(B, L', vocab)`` for the sliced tokens, or None.

        Raises:
            ValueError: inputs that do not fit (named), a cache overflow
                (:meth:`~simsd.models.cache.KVCache.advance`).
        """
        ctx = self.context(positions, labels, mask_mode, cache, num_write, unit)
        B, L = input_ids.shape
        x = self.model.embed_tokens(input_ids.reshape(B * L))
        for layer in self.model.layers:
            x = layer(x, ctx)
        cache.advance(ctx.num_write)
        if logits_slice is None:
            return None
        if logits_slice != slice(None):
            x = x.view(B, L, -1)[:, logits_slice]
            L = x.shape[1]
            x = x.reshape(B * L, -1)
        if ctx.unit is None:
            logits = self.lm_head(self.model.norm(x))
        else:
            logits = per_unit(lambda t: self.lm_head(self.model.norm(t)), ctx.unit, x, L)
        return logits.view(B, L, -1).float()
