"""Every implementation of the mask rule held to masks written by hand.

The mirrors are also compared with each other (test_mask_mirror.py, test_flex_mask.py,
test_cuda_mask_rule.py), but the same wrong rule in every copy passes those. Here the expected
masks are written out cell by cell from the four quadrants of docs/design.md §4 and the copies
of §4.1, for small layouts with leftover tokens, D and M slots, ties in tau, a never-revealed
token (TAU_INF), the exact mode's shared prefix (grp -1) and the engine's padding labels
(``simsd.engine.batching.PAD_LABEL``, written here too), and over a cache with per-row lengths.
Held to them:
``mask_rule.allowed`` (dense), the dense torch mask with the cache, the FlexAttention
``mask_mod``, the Triton kernel (interpreted on the CPU), the torch attention backend, and the
C++ mirror when the CUDA extension is built.

Attention reads the mask through its output: with q = k = 0 every visible key gets the same
weight, and with ``v = e_j`` (one-hot) the output of query i is ``visible(i, j) / #visible(i)``.
"""
from __future__ import annotations

import pytest
import torch

from simsd_kernels import KIND_DRAFT as D
from simsd_kernels import KIND_KNOWN as K
from simsd_kernels import KIND_MASK as M
from simsd_kernels import TAU_INF as INF
from simsd_kernels.mask_rule import MaskMode, dense_new_token_mask
from simsd_kernels.reference import full_mask

#: the padding labels of the engine's batched forwards (simsd.engine.batching.PAD_LABEL; this file
#: imports only simsd_kernels so that .ci/cuda_check.sh runs it in a torch-only venv)
PAD_LABEL = {"bidirectional": (0, 0, 0), "exact": (0, 0, 1 << 30), "paper": (M, 0, 0), "block_causal": (0, 0, 1 << 30)}


def rows(text: str) -> torch.Tensor:
    """A 0/1 matrix written one row per line (spaces ignored)."""
    lines = [ln.split("#")[0].replace(" ", "") for ln in text.strip().splitlines()]
    return torch.tensor([[c == "1" for c in ln] for ln in lines if ln])


# paper: [leftover x2 | D_1..D_4 | M_1..M_4 | pad], taus 1, 2, 2 (a tie), never revealed
PAPER_LABELS = [(K, 0, 0), (K, 0, 0),
                (D, 1, 0), (D, 2, 0), (D, 2, 0), (D, INF, 0),
                (M, 1, 0), (M, 2, 0), (M, 2, 0), (M, INF, 0),
                PAD_LABEL["paper"]]
# query \ key  K K  D1 D2 D2 Di  M1 M2 M2 Mi  pad
PAPER_EXPECTED = rows("""
               1 1  0  0  0  0   0  0  0  0   0    # leftover: leftover only
               1 1  0  0  0  0   0  0  0  0   0
               1 1  1  0  0  0   0  1  1  1   0    # D tau 1: D with tau <= 1, M with tau > 1
               1 1  1  1  1  0   0  0  0  1   0    # D tau 2: D tau <= 2 (the tie too), M tau > 2
               1 1  1  1  1  0   0  0  0  1   0
               1 1  1  1  1  1   0  0  0  0   0    # D never revealed: every D, no M
               1 1  0  0  0  0   1  1  1  1   0    # M tau 1: no D (tau < 1), M tau >= 1
               1 1  1  0  0  0   0  1  1  1   0    # M tau 2: D tau < 2, M tau >= 2 (the tie too)
               1 1  1  0  0  0   0  1  1  1   0
               1 1  1  1  1  0   0  0  0  1   0    # M never revealed: revealed D, M never revealed
               1 1  0  0  0  0   1  1  1  1   1    # pad (M, tau 0): seen by no real token
""")

# exact: [shared prefix x2 (grp -1, a folded commit) | copy 0 x2 | copy 1 x2 | copy 2 x2 | pad]
EXACT_LABELS = [(K, 0, -1), (K, 0, -1), (K, 0, 0), (K, 0, 0), (K, 0, 1), (K, 0, 1), (K, 0, 2), (K, 0, 2),
                PAD_LABEL["exact"]]
EXACT_EXPECTED = rows("""
               1 1  0 0  0 0  0 0  0    # the shared prefix sees itself only
               1 1  0 0  0 0  0 0  0
               1 1  1 1  0 0  0 0  0    # a copy: the prefix and itself
               1 1  1 1  0 0  0 0  0
               1 1  0 0  1 1  0 0  0
               1 1  0 0  1 1  0 0  0
               1 1  0 0  0 0  1 1  0
               1 1  0 0  0 0  1 1  0
               1 1  0 0  0 0  0 0  1    # pad: seen by no real token
""")

# an exact verification tree: [shared prefix (grp -1) | copy 0 | a proposed finished block F x2 (grp 1,
# its subtree ends at grp 2) | the next block's copy N x2 (grp 2: F is its ancestor) | pad]
EXACT_TREE_LABELS = [(K, 0, -1), (K, 0, 0), (K, 2, 1), (K, 2, 1), (K, 0, 2), (K, 0, 2), PAD_LABEL["exact"]]
EXACT_TREE_EXPECTED = rows("""
               1  0  0 0  0 0  0    # the shared prefix sees itself only
               1  1  0 0  0 0  0    # copy 0: the prefix and itself
               1  0  1 1  0 0  0    # F: the prefix and itself, not its descendant N
               1  0  1 1  0 0  0
               1  0  1 1  1 1  0    # N: the prefix, its ancestor F (as the cache would hold it), itself
               1  0  1 1  1 1  0
               1  0  0 0  0 0  1    # pad: seen by no real token
""")

# block-causal prefill: blocks 0, 0, 1, 1, 2 and the pad
CAUSAL_LABELS = [(K, 0, 0), (K, 0, 0), (K, 0, 1), (K, 0, 1), (K, 0, 2), PAD_LABEL["block_causal"]]
CAUSAL_EXPECTED = rows("""
               1 1 0 0 0 0
               1 1 0 0 0 0
               1 1 1 1 0 0
               1 1 1 1 0 0
               1 1 1 1 1 0
               1 1 1 1 1 1
""")

BIDIR_LABELS = [PAD_LABEL["bidirectional"]] * 3 + [(M, 2, 5)]  # labels mean nothing here
BIDIR_EXPECTED = torch.ones(4, 4, dtype=torch.bool)

CASES = {
    "paper": (MaskMode.PAPER, PAPER_LABELS, PAPER_EXPECTED),
    "exact": (MaskMode.EXACT, EXACT_LABELS, EXACT_EXPECTED),
    "exact_tree": (MaskMode.EXACT, EXACT_TREE_LABELS, EXACT_TREE_EXPECTED),
    "block_causal": (MaskMode.BLOCK_CAUSAL, CAUSAL_LABELS, CAUSAL_EXPECTED),
    "bidirectional": (MaskMode.BIDIRECTIONAL, BIDIR_LABELS, BIDIR_EXPECTED),
}
#: two rows: an empty cache and 3 cached tokens, in 5 cache slots
CACHE_LENS, CACHE_SLOTS = [0, 3], 5


def case(name):
    mode, labels, expected = CASES[name]
    lab = torch.tensor(labels, dtype=torch.int32)[None].expand(len(CACHE_LENS), -1, -1).contiguous()
    return mode, lab, expected


def expected_full(expected: torch.Tensor) -> torch.Tensor:
    """``(B, Lq, CACHE_SLOTS + Lq)``: cache slots below the row's length, then the new tokens."""
    Lq = expected.shape[0]
    out = []
    for n in CACHE_LENS:
        cache = torch.tensor([j < n for j in range(CACHE_SLOTS)]).expand(Lq, -1)
        out.append(torch.cat([cache, expected], -1))
    return torch.stack(out)


def test_hand_written_masks_follow_the_quadrants():
    """The hand-written tables themselves, cell by cell against the quadrant table read the
    plain way (one if per quadrant), so a typo in a table shows too."""
    def quadrant(q, k):
        (kq, tq, _), (kk, tk, _) = q, k
        if kk == K:
            return kq in (K, D, M)
        if kq == D:
            return tk <= tq if kk == D else tk > tq
        if kq == M:
            return tk < tq if kk == D else tk >= tq
        return False
    want = torch.tensor([[quadrant(q, k) for k in PAPER_LABELS] for q in PAPER_LABELS])
    assert torch.equal(want, PAPER_EXPECTED)
    assert not PAPER_EXPECTED[:-1, -1].any() and not EXACT_EXPECTED[:-1, -1].any()
    assert not CAUSAL_EXPECTED[:-1, -1].any()


def test_engine_padding_labels():
    """The engine pads batched forwards with exactly the labels held to the masks above."""
    from simsd.engine.batching import PAD_LABEL as ENGINE_PAD
    assert ENGINE_PAD == PAD_LABEL


@pytest.mark.parametrize("name", list(CASES))
def test_mask_rule(name):
    mode, lab, expected = case(name)
    got = dense_new_token_mask(lab, mode)
    for b in range(lab.shape[0]):
        assert torch.equal(got[b], expected), (got[b].int() - expected.int()).nonzero().tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_dense_torch_mask_with_cache(name):
    mode, lab, expected = case(name)
    got = full_mask(torch.tensor(CACHE_LENS, dtype=torch.int32), lab, mode, CACHE_SLOTS)
    assert torch.equal(got, expected_full(expected))


@pytest.mark.parametrize("name", list(CASES))
def test_flex_mask_mod(name):
    from torch.nn.attention.flex_attention import create_mask

    from simsd_kernels.flex import make_mask_mod
    mode, lab, expected = case(name)
    B, Lq = lab.shape[:2]
    mod = make_mask_mod(lab, torch.tensor(CACHE_LENS, dtype=torch.int32), CACHE_SLOTS, mode)
    got = create_mask(mod, B, None, Lq, CACHE_SLOTS + Lq, device="cpu")[:, 0]
    assert torch.equal(got, expected_full(expected))


def attention_support(run, mode, lab) -> torch.Tensor:
    """The visible keys of every query as seen through an attention implementation ``run``
    (q = k = 0, one-hot values over the cache slots then the new tokens); also checks that
    visible keys get equal weights."""
    B, Lq = lab.shape[:2]
    Dh, Hq, Hkv = 64, 2, 1
    S = CACHE_SLOTS + Lq
    eye = torch.eye(S, Dh)
    q = torch.zeros(B, Lq, Hq, Dh)
    k = torch.zeros(B, Lq, Hkv, Dh)
    v = eye[CACHE_SLOTS:][None, :, None, :].expand(B, -1, Hkv, -1).contiguous()
    k_cache = torch.zeros(B, CACHE_SLOTS, Hkv, Dh)
    v_cache = eye[:CACHE_SLOTS][None, :, None, :].expand(B, -1, Hkv, -1).contiguous()
    seqlens = torch.tensor(CACHE_LENS, dtype=torch.int32)
    positions = (seqlens.to(torch.int64)[:, None] + torch.arange(Lq)[None]).contiguous()
    out = run(q, k, v, k_cache, v_cache, seqlens, lab, positions, mode)[..., :S]  # (B, Lq, Hq, S)
    support = out[:, :, 0] > 1e-6
    torch.testing.assert_close(out[:, :, 1], out[:, :, 0])
    counts = support.sum(-1, keepdim=True).clamp_min(1).float()
    torch.testing.assert_close(out[:, :, 0] * counts, support.float(), atol=1e-5, rtol=0)
    return support


def _torch_backend(q, k, v, kc, vc, sl, lab, pos, mode):
    from simsd_kernels import temporal_attention
    return temporal_attention(q, k, v, kc, vc, sl, lab, pos, mask_mode=mode, rope_theta=1e4, backend="torch")


def _triton(q, k, v, kc, vc, sl, lab, pos, mode):
    pytest.importorskip("triton")
    from simsd_kernels.paging import identity_table
    from triton_ops.ops import temporal_attention_fwd
    out = torch.full(q.shape, float("nan"))
    temporal_attention_fwd(q, k, v, kc, vc, sl, lab, pos, mode, 1e4, 1.0, out=out,
                           block_table=identity_table(q.shape[0], q.device))
    return out


@pytest.mark.parametrize("impl", [_torch_backend, _triton], ids=["torch", "triton"])
@pytest.mark.parametrize("name", list(CASES))
def test_attention_kernels(name, impl):
    mode, lab, expected = case(name)
    assert torch.equal(attention_support(impl, mode, lab), expected_full(expected))


@pytest.mark.parametrize("name", list(CASES))
def test_cpp_mirror(name):
    """The C++ mirror (csrc/mask_rule.cuh) on the host; skipped unless the extension is built
    (``.ci/cuda_check.sh`` builds it and runs this file)."""
    from .cuda_helpers import load_cuda_backend
    cb = load_cuda_backend()
    mode, lab, expected = case(name)
    got = cb.mask_table(lab[:1].contiguous(), int(mode))
    assert torch.equal(got[0], expected)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel(name):
    from .cuda_helpers import load_cuda_backend
    load_cuda_backend()
    from simsd_kernels import temporal_attention
    mode, lab, expected = case(name)

    def run(q, k, v, kc, vc, sl, lb, pos, md):
        args = [t.cuda() for t in (q, k, v, kc, vc, sl, lb, pos)]
        return temporal_attention(*args, mask_mode=md, rope_theta=1e4, backend="cuda").cpu()
    assert torch.equal(attention_support(run, mode, lab), expected_full(expected))
