"""SimSD verification layouts and acceptance rules (DESIGN.md §4, §4.1).

* :func:`paper_layout`: ``[leftover | D_1..D_n | M_1..M_n]`` with the RoPE copy and the
  four-quadrant temporal mask labels (paper mode).
* :func:`exact_layout`: one copy of the block per verified draft step (exact mode).
* :func:`accept_token`: speculative rejection sampling of one draft token.
"""
from __future__ import annotations

import torch

from simsd_kernels import KIND_DRAFT, KIND_KNOWN, KIND_MASK, TAU_INF


def paper_layout(block: torch.Tensor, known: torch.Tensor, drafted: torch.Tensor, tau: torch.Tensor,
                 start: int, mask_id: int, rope_copy: bool = True):
    """Query tokens of the paper's verification forward for one block.

    Args:
        block: ``(L,)`` block tokens before this round (MASK at unknown positions).
        known: ``(L,)`` bool, positions known before the round (the leftover).
        drafted: ``(L,)`` the draft's block after its steps (MASK where not revealed).
        tau: ``(L,)`` int, the step (1-based) at which the draft revealed each position,
            ``TAU_INF`` where it did not.
        start: absolute position of the block's first token.
        rope_copy: M_k takes D_k's position (the paper); False: M gets fresh positions after D.

    Returns:
        ``ids (1, Lq)``, ``positions (1, Lq)``, ``labels (1, Lq, 3)`` int32 and ``m_index (L,)``:
        the query index of each position's M slot (-1 for known positions).
        Layout: leftover in block order, then D and M over the unknown positions.
    """
    device = block.device
    L = block.shape[0]
    pos = torch.arange(start, start + L, device=device)
    left = torch.nonzero(known).flatten()
    unk = torch.nonzero(~known).flatten()
    n = unk.numel()
    ids = torch.cat([block[left], drafted[unk], torch.full((n,), mask_id, device=device, dtype=block.dtype)])
    m_pos = pos[unk] if rope_copy else start + L + torch.arange(n, device=device)
    positions = torch.cat([pos[left], pos[unk], m_pos])
    kind = torch.cat([torch.full((left.numel(),), KIND_KNOWN), torch.full((n,), KIND_DRAFT),
                      torch.full((n,), KIND_MASK)]).to(device)
    t = tau[unk].to(torch.int64).clamp(max=TAU_INF)
    taus = torch.cat([torch.zeros(left.numel(), dtype=torch.int64, device=device), t, t])
    labels = torch.stack([kind.to(torch.int64), taus, torch.zeros_like(taus)], -1).to(torch.int32)
    m_index = torch.full((L,), -1, dtype=torch.int64, device=device)
    m_index[unk] = left.numel() + n + torch.arange(n, device=device)
    return ids[None], positions[None], labels[None], m_index


def exact_layout(states: list, start: int):
    """Query tokens of the exact verification forward: copy ``c`` is ``states[c] (L,)``.

    Each copy sits at the block's true positions and sees the cache and itself only
    (``exact`` mask, ``grp = c``), so its logits equal a vanilla denoise forward on that state.
    Returns ``ids (1, n*L)``, ``positions (1, n*L)``, ``labels (1, n*L, 3)``.
    """
    n, L = len(states), states[0].shape[0]
    device = states[0].device
    ids = torch.cat(states)[None]
    positions = torch.arange(start, start + L, device=device).repeat(n)[None]
    labels = torch.zeros(1, n * L, 3, dtype=torch.int32, device=device)
    labels[0, :, 2] = torch.arange(n, device=device, dtype=torch.int32).repeat_interleave(L)
    return ids, positions, labels


def accept_token(x: int, p_target: torch.Tensor, p_draft: torch.Tensor, generator: torch.Generator):
    """Speculative rejection sampling of draft token ``x``.

    Accept with probability ``min(1, p_target[x] / p_draft[x])``; on rejection draw from
    ``normalize(max(0, p_target - p_draft))`` (``p_target`` itself if that is all zero).
    Returns ``(accepted: bool, token: int)``. ``p_target, p_draft``: ``(V,)`` probabilities.
    """
    pt, pd = float(p_target[x]), float(p_draft[x])
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if pd > 0 and u < min(1.0, pt / pd):
        return True, x
    residual = (p_target.double() - p_draft.double()).clamp_min(0).cpu()
    if float(residual.sum()) <= 0:
        residual = p_target.double().cpu()
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
