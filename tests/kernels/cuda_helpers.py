"""Shared helpers of the CUDA-backend tests: loading the extension, label layouts, tolerances."""
from __future__ import annotations

import os

import pytest
import torch

from simsd_kernels import MaskMode
from simsd_kernels.selfcheck import fill_paper_labels


def load_cuda_backend():
    """The ``simsd_kernels.cuda_backend`` module, or skip (fail with SIMSD_REQUIRE_CUDA_EXT=1)."""
    try:
        import simsd_kernels.cuda_backend as cb
    except ImportError as exc:
        if os.environ.get("SIMSD_REQUIRE_CUDA_EXT", "") == "1":
            pytest.fail(f"SIMSD_REQUIRE_CUDA_EXT=1 but the extension does not import: {exc}")
        pytest.skip(f"simsd CUDA extension not built: {exc}")
    return cb


def make_labels(mode: MaskMode, B: int, Lq: int, gen: torch.Generator, block: int = 4) -> torch.Tensor:
    """``(B, Lq, 3)`` int32 labels of a realistic layout for ``mode`` (CPU).

    * bidirectional: random labels (ignored by the rule);
    * block_causal: grp = token // block (prefill blocks);
    * exact: grp = token // block (one block copy per verified step);
    * paper: ``[leftover | D_1..D_n | M_1..M_n]``, D_k and M_k share tau in 1..3 or TAU_INF.
    """
    lab = torch.zeros(B, Lq, 3, dtype=torch.int32)
    idx = torch.arange(Lq)
    if mode == MaskMode.BIDIRECTIONAL:
        lab[..., 0] = torch.randint(0, 3, (B, Lq), generator=gen, dtype=torch.int32)
        lab[..., 1] = torch.randint(1, 4, (B, Lq), generator=gen, dtype=torch.int32)
        lab[..., 2] = torch.randint(0, 3, (B, Lq), generator=gen, dtype=torch.int32)
    elif mode in (MaskMode.BLOCK_CAUSAL, MaskMode.EXACT):
        lab[..., 2] = (idx // block).to(torch.int32)
    else:
        fill_paper_labels(lab, gen)
    return lab


def make_inputs(B, Lq, Hq, Hkv, D, cache_lens, Lmax, dtype, device, seed, mode):
    """Random inputs of the op (``positions`` continue each row's cache, as in decoding)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = rnd(B, Lq, Hq, D), rnd(B, Lq, Hkv, D), rnd(B, Lq, Hkv, D)
    k_cache, v_cache = rnd(B, Lmax, Hkv, D), rnd(B, Lmax, Hkv, D)
    cache_seqlens = torch.tensor(cache_lens, dtype=torch.int32, device=device)
    for b, n in enumerate(cache_lens):  # the reference reads [0, max len): keep the rest finite
        k_cache[b, n:] = 0
        v_cache[b, n:] = 0
    labels = make_labels(mode, B, Lq, gen).to(device)
    positions = torch.tensor(cache_lens)[:, None] + torch.arange(Lq)[None, :]
    if mode == MaskMode.PAPER and Lq > 1:  # RoPE copy: M_k at the position of D_k
        n = Lq // 2
        n0 = Lq - 2 * n
        positions[:, n0 + n:] = positions[:, n0:n0 + n]
    positions = positions.to(device)
    return q, k, v, k_cache, v_cache, cache_seqlens, labels, positions


def nan_poison_beyond(cache: torch.Tensor, cache_lens) -> torch.Tensor:
    """A copy of ``cache`` with NaN in every slot a row must not read."""
    out = cache.clone()
    for b, n in enumerate(cache_lens):
        out[b, n:] = float("nan")
    return out


def poison_allocator(*shapes, dtype=torch.float32, device="cuda"):
    """Fill freshly freed caching-allocator blocks with NaN of ``dtype``, so a kernel output of
    that dtype allocated with ``torch.empty`` of these sizes likely starts as NaN and an
    unwritten tile shows. (A float32 NaN seen as two 16-bit halves is a NaN and a zero: 16-bit
    outputs must be poisoned in their own dtype.)"""
    bufs = [torch.full(s, float("nan"), dtype=dtype, device=device) for s in shapes]
    del bufs


#: error floor per dtype, added to 2x the error of plain PyTorch at the same dtype
ERR_FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.to(torch.float64) - ref.to(torch.float64)).abs().max().item() if a.numel() else 0.0
