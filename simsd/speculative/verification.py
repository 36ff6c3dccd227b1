"""SimSD verification layouts and acceptance rules (docs/design.md §4, §4.1, §4.2).

* :func:`paper_layout`: ``[leftover | D_1..D_n | M_1..M_n]`` with the RoPE copy and the
  four-quadrant temporal mask labels (paper mode).
* :func:`exact_layout`: one copy of the block per verified draft step (exact mode).
* :func:`token_verdicts`, :func:`accept_in_order`: greedy matching or speculative rejection
  sampling of the draft tokens in the draft's temporal order (paper mode);
  :func:`exact_step_verdict`: exact mode's comparison of whole steps (greedy or sampling).
  All three run on the device without host reads: a round's decision is read once, by the
  caller.
"""
from __future__ import annotations

import torch

from simsd_kernels import KIND_DRAFT, KIND_KNOWN, KIND_MASK, TAU_INF

from ..decoding.sampling import draw, exponential_noise, filtered_probs
from ..decoding.strategies import stable_rank
from ..engine.host_sync import to_device


def paper_layout(block: torch.Tensor, known, drafted: torch.Tensor, tau: torch.Tensor,
                 start: int, mask_id: int, rope_copy: bool = True):
    """Query tokens of the paper's verification forward for one block.

    Args:
        block: ``(L,)`` block tokens before this round (MASK at unknown positions).
        known: ``L`` bools (a host list, or a tensor that is read once), positions known before
            the round (the leftover). The layout's index arithmetic runs on the host from it
            and travels to the device in one asynchronous copy.
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
    known = known.tolist() if isinstance(known, torch.Tensor) else list(known)
    L = len(known)
    left = [i for i in range(L) if known[i]]
    unk = [i for i in range(L) if not known[i]]
    n, nl = len(unk), len(left)
    m_pos = [start + i for i in unk] if rope_copy else [start + L + j for j in range(n)]
    positions = [start + i for i in left] + [start + i for i in unk] + m_pos
    kinds = [KIND_KNOWN] * nl + [KIND_DRAFT] * n + [KIND_MASK] * n
    m_index = [-1] * L
    for j, i in enumerate(unk):
        m_index[i] = nl + n + j
    host = to_device(left + unk + positions + kinds + m_index, device)
    left_t, unk_t = host[:nl], host[nl:nl + n]
    positions_t, kinds_t, m_index_t = host[nl + n:].split([nl + 2 * n, nl + 2 * n, L])
    ids = torch.cat([block[left_t], drafted[unk_t], torch.full((n,), mask_id, device=device, dtype=block.dtype)])
    t = tau.to(device)[unk_t].to(torch.int64).clamp(max=TAU_INF)
    taus = torch.cat([torch.zeros(nl, dtype=torch.int64, device=device), t, t])
    labels = torch.stack([kinds_t, taus, torch.zeros_like(taus)], -1).to(torch.int32)
    return ids[None], positions_t[None], labels[None], m_index_t


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


def token_verdicts(logits: torch.Tensor, drafted: torch.Tensor, draft_probs: torch.Tensor | None,
                   params, rng=None):
    """Per-position verdicts on draft tokens, on the device and without host reads.

    Args:
        logits: ``(L, V)`` the target's logits at each position's verification slot (MASK
            token already removed).
        drafted: ``(L,)`` the draft's token per position.
        draft_probs: ``(L, V)`` the draft's sampling distribution per position (unused when
            greedy).
        params: :class:`~simsd.decoding.sampling.SamplingParams` (shared by draft and target).
        rng: the randomness of rejection sampling (unused when greedy): a pair ``(u (L,),
            exponential (L, V))`` of keyed noise (:mod:`simsd.decoding.noise`, streams
            ``ACCEPT`` and ``RESIDUAL``; what :class:`~simsd.speculative.spec_row.SpecRow`
            passes), or a ``torch.Generator`` on the logits' device.

    Returns:
        ``ok (L,) bool`` and ``replacement (L,) int64``. Greedy: accept iff the draft token is
        the target's argmax; the replacement is the argmax. Sampling (speculative rejection
        sampling, Leviathan et al. 2023): accept when ``u * p_d(x) < p_t(x)``, i.e. with
        probability ``min(1, p_t(x) / p_d(x))``; the replacement is drawn from
        ``normalize(max(0, p_t - p_d))`` (``p_t`` where that is all zero), so a committed token
        follows ``p_t``.
    """
    if params.greedy:
        best = logits.argmax(-1)
        return best == drafted, best
    p_t = filtered_probs(logits, params)
    p_d = draft_probs.to(p_t.dtype)
    x = drafted[:, None]
    pt_x, pd_x = p_t.gather(-1, x)[:, 0], p_d.gather(-1, x)[:, 0]
    if isinstance(rng, torch.Generator) or rng is None:
        u = torch.rand(pt_x.shape, generator=rng, device=pt_x.device, dtype=torch.float64)
        noise = exponential_noise(p_t.shape, p_t.device, rng)
    else:
        u, noise = rng
    ok = (pd_x > 0) & (u.double() * pd_x.double() < pt_x.double())
    residual = (p_t - p_d).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_t)
    return ok, draw(residual, noise=noise)


def accept_in_order(block: torch.Tensor, drafted: torch.Tensor, tau: torch.Tensor, n: int,
                    ok: torch.Tensor, replacement: torch.Tensor):
    """Accept the longest prefix of draft proposals in the draft's temporal order.

    Proposals are the positions with ``tau <= n``, ordered by reveal step, then position. They
    are accepted in that order until the first one with ``ok`` False, which takes its
    ``replacement`` token; later proposals (the rest of that step and later steps) stay MASK.

    Args:
        block: ``(L,)`` the block at the round start.
        drafted: ``(L,)`` the draft's block after its ``n`` steps.
        tau: ``(L,)`` int64 1-based reveal step, ``TAU_INF`` where not revealed.
        ok, replacement: ``(L,)`` per-position verdicts (:func:`token_verdicts`).

    Returns:
        ``(new_block (L,), rejected, steps_taken, accepted, proposed)``, all on the device
        (0-d tensors; no host reads): ``steps_taken`` is the rejected proposal's step or ``n``;
        ``proposed`` counts the proposals of the steps taken.
    """
    L = block.shape[0]
    prop = tau <= n
    big = (n + 2) * L
    key = torch.where(prop, tau * L + torch.arange(L, device=tau.device), big)
    rank = stable_rank(key, descending=False)
    n_prop = prop.sum()
    first_bad = torch.where(prop & ~ok, rank, big).min()
    r = torch.minimum(first_bad, n_prop)
    rejected = r < n_prop
    at_r = prop & (rank == r)
    taken = torch.where(rejected, torch.where(at_r, tau, 0).max(), n)
    new = torch.where(prop & (rank < r), drafted, block)
    new = torch.where(at_r, replacement, new)
    return new, rejected, taken, r, (prop & (tau <= taken)).sum()


def exact_step_verdict(mine: torch.Tensor, states: torch.Tensor, drafted: torch.Tensor, tau: torch.Tensor,
                       bonus: bool):
    """Exact verification: draft step ``c`` is accepted iff the target's own step on
    ``states[c]`` (``mine[c]``: same positions, same tokens) equals the draft's next state.

    Greedy or sampling alike: ``mine[c]`` is the step vanilla decoding would take at that state
    (under sampling with the same keyed noise, :mod:`simsd.decoding.noise`), so the committed
    block is always one vanilla decoding reaches.

    Args:
        mine: ``(n + bonus, L)`` the target's own denoising step on each verified state
            (``mine[n]``: on ``drafted``, the bonus copy).
        states: ``(n, L)`` the block before each draft step; ``drafted (L,)`` after the last.
        tau: ``(L,)`` 1-based reveal steps.

    Returns:
        ``(new_block (L,), steps_taken, accepted, proposed)`` on the device (0-d tensors): the
        target's step at the first mismatch, else its bonus step (or ``drafted`` without one).
    """
    n = states.shape[0]
    after = torch.cat([states[1:], drafted[None]])
    ok_prefix = (mine[:n] == after).all(-1).long().cumprod(0)
    n_ok = ok_prefix.sum()
    steps = torch.arange(1, n + 1, device=tau.device)
    counts = (tau[None] == steps[:, None]).sum(-1)
    accepted = (counts * ok_prefix).sum()
    proposed = (counts * (steps <= n_ok + 1)).sum()
    last = mine[n] if bonus else drafted
    candidates = torch.cat([mine[:n], last[None]])
    new = torch.index_select(candidates, 0, n_ok.view(1))[0]
    taken = (n_ok + 1).clamp(max=n + int(bonus))
    return new, taken, accepted, proposed


#: the former name (greedy was the only case before keyed noise)
exact_greedy_verdict = exact_step_verdict
