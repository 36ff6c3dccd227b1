"""The block-diffusion training objective of the bundled tiny SDAR pair (``tools/train_tiny_sdar.py``
trains with it, ``tools/distill.py`` distils through it, ``tools/eval_tiny_sdar.py`` scores with it).

One sequence of ``L`` tokens in blocks of ``B`` is read as ``[x_t | x_0]`` (its noisy copy, then the
clean one, at shared positions) under :func:`bd_mask`; per block ``m ~ U{1..B}`` positions are
masked (:func:`noise`) and the loss is the ``1/t``-weighted cross-entropy at them (:func:`bd_loss`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from simsd.models.model import SDARForCausalLM
from simsd_kernels.rope import apply_rope


def bd_mask(L: int, B: int) -> torch.Tensor:
    """``(2L, 2L)`` bool: rows/cols ``[x_t | x_0]``; True = may attend."""
    blk = torch.arange(L) // B
    same, before = blk[:, None] == blk[None, :], blk[None, :] < blk[:, None]
    top = torch.cat([same, before], dim=1)                                      # noisy queries
    bottom = torch.cat([torch.zeros(L, L, dtype=torch.bool), same | before], dim=1)  # clean queries
    return torch.cat([top, bottom], dim=0)


def train_forward(model: SDARForCausalLM, xt: torch.Tensor, x0: torch.Tensor, mask: torch.Tensor,
                  select: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``(N, L, V)`` at the noisy positions for the input ``[x_t | x_0]`` (shared positions);
    with ``select`` (``(N, L)`` bool) only the logits ``(n_selected, V)`` of those positions."""
    N, L = xt.shape
    c = model.config
    pos = torch.arange(L).repeat(2)[None].expand(N, 2 * L)
    x = model.model.embed_tokens(torch.cat([xt, x0], dim=1))
    for layer in model.model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        Hq, Hkv = c.num_attention_heads, c.num_key_value_heads
        q, k, v = a.qkv_proj(h).view(N, 2 * L, Hq + 2 * Hkv, c.head_dim).split([Hq, Hkv, Hkv], -2)
        q, k = a.q_norm(q), a.k_norm(k)  # the norm modules (the model's fused weight is detached)
        q, k = apply_rope(q, pos, c.rope_theta), apply_rope(k, pos, c.rope_theta)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=c.head_dim ** -0.5, enable_gqa=True)
        x = x + a.o_proj(o.transpose(1, 2).reshape(N, 2 * L, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = x[:, :L] if select is None else x[:, :L][select]
    return model.lm_head(model.model.norm(x)).float()


def noise(x0: torch.Tensor, B: int, mask_id: int, g: torch.Generator):
    """Per block ``m ~ U{1..B}`` masked positions; returns ``x_t``, masked (bool), weight ``1/t``."""
    N, L = x0.shape
    nb = L // B
    m = torch.randint(1, B + 1, (N, nb, 1), generator=g)
    ranks = torch.rand(N, nb, B, generator=g).argsort(-1).argsort(-1)
    masked = (ranks < m).view(N, L)
    weight = (B / m.float()).expand(N, nb, B).reshape(N, L)
    return torch.where(masked, torch.full_like(x0, mask_id), x0), masked, weight


def bd_loss(model, x0, B, mask_id, mask, g) -> torch.Tensor:
    xt, masked, w = noise(x0, B, mask_id, g)
    logits = train_forward(model, xt, x0, mask, select=masked)
    ce = F.cross_entropy(logits, x0[masked], reduction="none")
    return (ce * w[masked]).sum() / x0.numel()


@torch.no_grad()
def heldout_loss(model, windows, B, mask_id, seed=1234, bs=16) -> float:
    """The training loss on fixed ``windows`` with a fixed noise seed (no gradient)."""
    g = torch.Generator().manual_seed(seed)
    mask = bd_mask(windows.shape[1], B)
    tot = 0.0
    for i in range(0, len(windows), bs):
        x0 = windows[i:i + bs]
        tot += float(bd_loss(model, x0, B, mask_id, mask, g)) * x0.shape[0]
    return tot / len(windows)
