"""The FlexAttention mask_mod mirror equals the dense mask of the one mask rule."""
import itertools

import pytest
import torch

from simsd_kernels.flex import make_mask_mod
from simsd_kernels.reference import full_mask


@pytest.mark.parametrize("mode", ["bidirectional", "block_causal", "exact", "paper"])
def test_flex_mask_mod_matches_dense(mode):
    from torch.nn.attention.flex_attention import create_mask
    g = torch.Generator().manual_seed(0)
    B, Lq, cache_len = 2, 9, 5
    # label combinations: kinds 0-2, taus 0-3, groups -1 (shared prefix) to 2
    combos = list(itertools.product(range(3), range(4), range(-1, 3)))
    labels = torch.tensor([combos[int(i)] for i in torch.randint(0, len(combos), (B * Lq,), generator=g)],
                          dtype=torch.int32).view(B, Lq, 3)
    seqlens = torch.tensor([0, 4], dtype=torch.int32)
    got = create_mask(make_mask_mod(labels, seqlens, cache_len, mode), B, None, Lq, cache_len + Lq, device="cpu")
    want = full_mask(seqlens, labels, mode, cache_len)
    assert torch.equal(got[:, 0], want)
