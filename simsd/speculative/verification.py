"""SimSD verification layouts and acceptance rules (docs/design.md §4, §4.1, §4.2).

* :func:`paper_layout`: ``[leftover | D_1..D_n | M_1..M_n]`` with the RoPE copy and the
  four-quadrant temporal mask labels (paper mode).
* :func:`~simsd.decoding.layouts.exact_layout` (in the decoding layer: prompt scoring uses it
  too): one copy of the block per verified draft step (exact mode).
* :func:`token_verdicts`, :func:`accept_in_order`: greedy matching or speculative rejection
  sampling of the draft tokens in the draft's temporal order (paper mode);
  :func:`tree_verdict`: exact mode's comparison of whole steps over a proposal tree (greedy or
  sampling).
  All three run on the device without host reads: a round's decision is read once, by the
  caller.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from simsd_kernels import KIND_DRAFT, KIND_KNOWN, KIND_MASK, TAU_INF

from ..decoding.sampling import draw, filtered_probs
from ..engine.host_sync import to_device


def paper_layout(block: torch.Tensor, known, drafted: torch.Tensor, tau: torch.Tensor,
                 start: int, rope_copy: bool = True):
    """Query tokens of the paper's verification forward for one block.

    Args:
        block: ``(L,)`` block tokens before this round (MASK at unknown positions).
        known: ``L`` bools (a host list, or a tensor that is read once), positions known before
            the round (the leftover). The layout's index arithmetic runs on the host from it
            and travels to the device in one asynchronous copy.
        drafted: ``(L,)`` the draft's block after its steps (MASK where not revealed).
        tau: ``(L,)`` int64, the step (1-based) at which the draft revealed each position,
            ``TAU_INF`` where it did not.
        start: absolute position of the block's first token.
        rope_copy: M_k takes D_k's position (the paper); False: M gets fresh positions after D.

    Returns:
        ``ids (Lq,)`` int64 on the device; ``positions``: ``Lq`` host ints; ``labels``: ``Lq``
        host ``(kind, tau, grp)`` triples with ``tau = 0``; ``taus (Lq,)`` int32 on the device,
        the ``tau`` labels (0 for the leftover, the draft's reveal step for D and M); and
        ``m_index (L,)`` int64 on the device: the query index of each position's M slot (0
        for known positions, whose verdict is not read). Layout: leftover in block order, then
        D and M over the unknown positions. As engine inputs: ``Fwd(..., tau=taus)``.
    """
    device = block.device
    known = known.tolist() if isinstance(known, torch.Tensor) else list(known)
    L = len(known)
    left = [i for i in range(L) if known[i]]
    unk = [i for i in range(L) if not known[i]]
    n, nl = len(unk), len(left)
    m_pos = [start + i for i in unk] if rope_copy else [start + L + j for j in range(n)]
    positions = [start + i for i in left] + [start + i for i in unk] + m_pos
    labels = [(KIND_KNOWN, 0, 0)] * nl + [(KIND_DRAFT, 0, 0)] * n + [(KIND_MASK, 0, 0)] * n
    m_index = [0] * L
    for j, i in enumerate(unk):
        m_index[i] = nl + n + j
    # ids from [block | drafted] (an M slot's token is the block's MASK), taus from [tau | 0]
    host = to_device(left + [L + i for i in unk] + unk + [L] * nl + unk + unk + m_index, device)
    id_index, tau_index, m_index = host.split([nl + 2 * n, nl + 2 * n, L])
    ids = torch.cat([block, drafted]).index_select(0, id_index)
    taus = F.pad(tau.to(device), (0, 1)).index_select(0, tau_index).to(torch.int32)
    return ids, positions, labels, taus, m_index


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
            ``ACCEPT`` and ``RESIDUAL``), on the logits' device.

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
        ``(new_block (L,), rejected, steps_taken, accepted)``, all on the device (0-d tensors;
        no host reads): ``steps_taken`` is the rejected proposal's step or ``n``. (The proposals
        of the steps taken are counted on the host from ``tau``, with the decision.)
    """
    prop = tau <= n
    order = torch.sort(tau, stable=True).indices  # the temporal order: reveal step, then position
    rank = order.argsort()  # proposals rank 0 .. n_prop - 1
    n_prop = prop.sum()
    r = (ok & prop)[order].cumprod(0).sum()  # proposals accepted before the first rejected one
    rejected = r < n_prop
    before = rank < r
    taken = tau.masked_fill(before, TAU_INF).min().clamp(max=n)  # the rejected proposal's step, or n
    new = torch.where(before, drafted, block)
    new = torch.where(prop & (rank == r), replacement, new)
    return new, rejected, taken, r


def accept_in_position_order(block: torch.Tensor, drafted: torch.Tensor, proposed: torch.Tensor,
                             ok: torch.Tensor, replacement: torch.Tensor):
    """Accept the longest prefix of draft proposals in block position order (the SimSD
    release's ``greedy_match_verify`` and ``mrs_verify`` with ``verify_order_mode="position"``).

    Proposals are judged from the first position on; the first one with ``ok`` False takes its
    ``replacement`` token and every later position stays MASK (the release re-drafts it in the
    next round). When every proposal is accepted nothing else is added (no bonus token).

    Args:
        block: ``(L,)`` the block at the round start.
        drafted: ``(L,)`` the draft's block after its steps.
        proposed: ``(L,)`` bool, the positions the draft revealed in the round.
        ok, replacement: ``(L,)`` per-position verdicts (:func:`token_verdicts`).

    Returns:
        ``(new_block (L,), accepted)`` on the device (``accepted`` a 0-d tensor; no host reads).
    """
    L = block.shape[0]
    index = torch.arange(L, device=block.device)
    first = torch.where(proposed & ~ok, index, L).min()  # the first rejected position, or L
    before = proposed & (index < first)
    new = torch.where(before, drafted, block)
    return torch.where(index == first, replacement, new), before.sum()


def tree_verdict(mine: torch.Tensor, states: torch.Tensor, shape: tuple):
    """Exact verification of a proposal tree (:class:`~simsd.speculative.tree.ProposalTree`):
    node ``j`` is valid iff every node on its path is the target's own step on its parent (same
    positions, same tokens); the round commits the target's step on the deepest valid node, or
    that node's state when it has no MASK left.

    Greedy or sampling alike: ``mine`` holds the steps vanilla decoding takes at those states
    (under sampling with the same keyed noise, :mod:`simsd.decoding.noise`), so the committed
    block is always one vanilla decoding reaches. Sibling states differ: the valid nodes form a
    path from the root.

    Args:
        mine: ``(C, L)`` the target's own step on each copy (the nodes with MASK, in node order).
        states: ``(N, L)`` the nodes' states (node 0: the round's block).
        shape: the tree's :meth:`~simsd.speculative.tree.ProposalTree.constants` on the device.

    Returns:
        ``(new_block (L,), steps_taken, accepted, valid, valid_state (L,))`` on the device (0-d
        tensors but the blocks; no host read): ``accepted`` counts the proposed tokens on the
        valid path, ``valid`` is the deepest valid node and ``valid_state`` its state.
    """
    copy_index, parent, depth, copies, _, path = shape
    stepped = states.index_copy(0, copy_index, mine)  # a node's step: its target step, or itself if full
    ok = torch.cat([torch.ones(1, dtype=torch.bool, device=states.device),
                    (stepped.index_select(0, parent) == states[1:]).all(-1)])
    reached = ~(path & ~ok[None, :]).any(-1)  # every node on the path is its parent's target step
    valid = (reached.long() * (depth + 1)).argmax()
    valid_state = states.index_select(0, valid.view(1))[0]
    new = stepped.index_select(0, valid.view(1))[0]
    taken = depth.index_select(0, valid.view(1))[0] + copies.index_select(0, valid.view(1))[0]
    return new, taken, (valid_state != states[0]).sum(), valid, valid_state


def revealing_copies(states: torch.Tensor, shape: tuple, node: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Per block position, the verify copy whose target step revealed it on the path from the root
    of a proposal tree to ``node`` (a 0-d device tensor: the round's deepest valid node,
    :func:`tree_verdict`): the deepest node of that path (the root and ``node`` included) where the
    position is still MASK; its copy's logits are those vanilla decoding revealed the position
    from. ``states (N, L)``, ``shape``: as :func:`tree_verdict`. Returns ``(L,)`` int64 copy
    indices on the device (no host read); positions known at the round's start get the root's
    copy (their value is not read)."""
    _, _, depth, _, rank, path = shape
    on_path = path.index_select(0, node.view(1))[0].clone()
    on_path[0] = True
    score = ((states == mask_id) & on_path[:, None]).long() * (depth[:, None] + 1)
    return rank.index_select(0, score.argmax(0))
