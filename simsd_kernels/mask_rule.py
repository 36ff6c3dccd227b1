"""The verification mask rule, written once.

Every backend (PyTorch reference, FlexAttention ``mask_mod``, Triton, CUDA) mirrors
:func:`allowed`; ``tests/kernels/test_mask_mirror.py`` (and the Flex and C++ tests) check the mirrors
against it, ``tests/kernels/test_expected_masks.py`` holds all of them to masks written by hand.

Each new (query-side) token carries three int32 labels ``(kind, tau, grp)``:

* ``kind``: 0 = known token (prompt tail, committed tokens: "leftover"),
  1 = draft data slot ``D``, 2 = mask slot ``M``;
* ``tau``: the draft step that revealed the token, 1-based (``TAU_INF`` if never revealed);
  in ``exact`` mode the last group of the copy's subtree (0: the copy alone), see below;
* ``grp``: a group id: the block index for ``block_causal`` (prefill), the copy id for
  ``exact``.

Cache entries are always visible to every new token; the rule only concerns new-to-new
attention. Query ``i`` may attend key ``j`` when (SimSD paper, docs/design.md §4 and §5):

* ``bidirectional`` (denoise, commit): always;
* ``block_causal`` (prefill): ``grp_j <= grp_i``;
* ``exact`` (one block copy per verified state): ``grp_j == grp_i``, or ``grp_j == SHARED_GRP``
  (-1): a shared prefix that every token sees and that sees only itself (used to fold the
  previous block's commit into the verification forward), or ``grp_j < grp_i <= tau_j``: the
  key's copy is an ancestor of the query's in a verification tree, the copies numbered in
  depth-first order and ``tau_j`` the last group of the key copy's subtree (a proposed finished
  block seen by the next block's copies, as the cache would hold it; ``tau = 0``: no descendant);
* ``paper`` (four-quadrant temporal mask)::

      query \\ key | known | D_j           | M_j
      ------------+-------+---------------+--------------
      known       |  yes  |  no           |  no
      D_i         |  yes  | tau_j <= tau_i| tau_j >  tau_i
      M_i         |  yes  | tau_j <  tau_i| tau_j >= tau_i
"""
from __future__ import annotations

import enum

KIND_KNOWN = 0
KIND_DRAFT = 1
KIND_MASK = 2

#: ``grp`` of the shared prefix in ``exact`` mode (seen by every copy)
SHARED_GRP = -1

#: time label of a position that the draft did not reveal within the verified steps
TAU_INF = 1 << 30


class MaskMode(enum.IntEnum):
    BIDIRECTIONAL = 0
    BLOCK_CAUSAL = 1
    EXACT = 2
    PAPER = 3


MASK_MODES = {m.name.lower(): m for m in MaskMode}


def parse_mask_mode(mask_mode) -> MaskMode:
    """Return the :class:`MaskMode` for a name (``"paper"``) or int; ``ValueError`` otherwise."""
    if isinstance(mask_mode, MaskMode):
        return mask_mode
    if isinstance(mask_mode, str) and mask_mode.lower() in MASK_MODES:
        return MASK_MODES[mask_mode.lower()]
    if isinstance(mask_mode, int) and not isinstance(mask_mode, bool) and mask_mode in set(MaskMode):
        return MaskMode(mask_mode)
    raise ValueError(
        f"mask_mode must be one of {sorted(MASK_MODES)} (or its int value), got {mask_mode!r}"
    )


def allowed(mask_mode, kind_q, tau_q, grp_q, kind_k, tau_k, grp_k):
    """True where query token ``q`` may attend new token ``k``.

    Works elementwise on Python ints and on broadcastable integer tensors alike (it uses only
    comparison and ``& |`` operators), so the same code serves the dense reference mask and the
    FlexAttention ``mask_mod``.
    """
    mode = parse_mask_mode(mask_mode)
    if mode == MaskMode.BIDIRECTIONAL:
        return (kind_q == kind_q) & (kind_k == kind_k)
    if mode == MaskMode.BLOCK_CAUSAL:
        return grp_k <= grp_q
    if mode == MaskMode.EXACT:
        return (grp_k == grp_q) | (grp_k == SHARED_GRP) | ((grp_k < grp_q) & (grp_q <= tau_k))
    # paper: four quadrants
    k_known = kind_k == KIND_KNOWN
    k_draft = kind_k == KIND_DRAFT
    k_mask = kind_k == KIND_MASK
    q_draft = kind_q == KIND_DRAFT
    q_mask = kind_q == KIND_MASK
    from_draft = q_draft & (k_known | (k_draft & (tau_k <= tau_q)) | (k_mask & (tau_k > tau_q)))
    from_mask = q_mask & (k_known | (k_draft & (tau_k < tau_q)) | (k_mask & (tau_k >= tau_q)))
    from_known = (kind_q == KIND_KNOWN) & k_known
    return from_known | from_draft | from_mask


def dense_new_token_mask(labels, mask_mode):
    """Dense ``(B, Lq, Lq)`` bool mask among new tokens from ``labels (B, Lq, 3)`` int32.

    Only for references and tests: the kernels never materialise it.
    """
    kind, tau, grp = labels.unbind(-1)
    return allowed(
        mask_mode,
        kind[:, :, None], tau[:, :, None], grp[:, :, None],
        kind[:, None, :], tau[:, None, :], grp[:, None, :],
    )
