"""The Triton mask mirror (``triton_ops.common.allowed``) equals ``mask_rule.allowed``.

V = identity trick: with q = k = 0 every visible key gets the same weight, and with an empty
cache and ``v[j] = e_j`` (one-hot over D), ``out[i, j] = allowed(i, j) / #allowed(i)``. So the
support of the output is the kernel's mask, compared exactly with the one definition, over
every pair of label combinations (kind 0-3, tau 0/1/2/TAU_INF, grp -1/0/1/2**30, each label
twice so pairs of equal labels and two key tiles are covered). tau 0 and grp 2**30 are the
engine's padding labels (``simsd.engine.batching.PAD_LABEL``): no real token may see them.
"""
import itertools

import pytest
import torch

pytest.importorskip("triton")

from simsd_kernels.mask_rule import TAU_INF, MaskMode, dense_new_token_mask  # noqa: E402
from simsd_kernels.paging import identity_table  # noqa: E402
from triton_ops.ops import temporal_attention_fwd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _all_label_combinations(copies=2):
    # kind 3: invalid; grp -1: shared prefix; tau 0 / grp 2**30: the engine's padding
    combos = list(itertools.product(range(4), (0, 1, 2, TAU_INF), (-1, 0, 1, 1 << 30)))
    labels = torch.tensor(combos * copies, dtype=torch.int32)
    perm = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(0))
    return labels[perm][None].contiguous()  # (1, 128, 3)


@pytest.mark.parametrize("mode", list(MaskMode), ids=lambda m: m.name.lower())
def test_kernel_mask_equals_mask_rule(mode):
    labels = _all_label_combinations()
    Lq, D, Hq, Hkv = labels.shape[1], 128, 2, 1
    assert Lq <= D
    q = torch.zeros(1, Lq, Hq, D)
    k = torch.zeros(1, Lq, Hkv, D)
    v = torch.eye(Lq, D)[None, :, None, :].contiguous()
    cache = torch.zeros(1, 4, Hkv, D)
    seqlens = torch.zeros(1, dtype=torch.int32)
    positions = torch.arange(Lq)[None]
    args = [t.to(DEVICE) for t in (q, k, v, cache, cache, seqlens, labels, positions)]
    out = torch.full((1, Lq, Hq, D), float("nan"), device=DEVICE)
    temporal_attention_fwd(*args, mode, 1e4, 1.0, out=out, block_table=identity_table(args[0].shape[0], args[0].device))
    out = out.cpu()

    want = dense_new_token_mask(labels, mode)[0]  # (Lq, Lq)
    for h in range(Hq):
        got = out[0, :, h, :Lq] > 0
        assert torch.equal(got, want), f"head {h}: {(got != want).nonzero()[:5].tolist()}"
        counts = want.sum(-1, keepdim=True).clamp_min(1).float()
        torch.testing.assert_close(out[0, :, h, :Lq] * counts, want.float(), atol=1e-5, rtol=0)
        assert Lq == D or out[0, :, h, Lq:].abs().max() == 0
