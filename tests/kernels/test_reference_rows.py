"""The torch reference backend computes each row over exactly its own keys, so a row's output
does not depend on the cache lengths of its batch neighbours (bitwise, in every dtype)."""
import pytest
import torch

from simsd_kernels import MaskMode
from tests.kernels.helpers import torch_attention


@pytest.mark.bitwise
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_output_independent_of_neighbours(dtype):
    g = torch.Generator().manual_seed(0)
    B, L, Hq, Hkv, D, cap = 3, 4, 4, 2, 64, 1200
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q, k, v = r(B, L, Hq, D), r(B, L, Hkv, D), r(B, L, Hkv, D)
    kc, vc = r(B, cap, Hkv, D), r(B, cap, Hkv, D)
    lens = torch.tensor([37, 1100, 37], dtype=torch.int32)
    labels = torch.zeros(B, L, 3, dtype=torch.int32)
    pos = lens[:, None].long() + torch.arange(L)
    batch = torch_attention(q, k, v, kc, vc, lens, labels, pos, int(MaskMode.BIDIRECTIONAL), 1e6, D ** -0.5)
    for b in range(B):
        s = slice(b, b + 1)
        alone = torch_attention(q[s], k[s], v[s], kc[s], vc[s], lens[s], labels[s], pos[s],
                                int(MaskMode.BIDIRECTIONAL), 1e6, D ** -0.5)
        assert torch.equal(batch[s], alone), b
