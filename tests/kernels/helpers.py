"""Input builders shared by the kernel tests (seeded, CPU, any dtype)."""
from __future__ import annotations

import torch

from simsd_kernels.mask_rule import TAU_INF


def random_labels(gen, B, Lq, n_grp=3):
    """Random ``(B, Lq, 3)`` int32 labels: kinds 0-2, tau in 1..4 or TAU_INF, grp in [0, n_grp)."""
    kind = torch.randint(0, 3, (B, Lq), generator=gen)
    tau = torch.randint(1, 5, (B, Lq), generator=gen)
    tau = torch.where(torch.rand((B, Lq), generator=gen) < 0.15, torch.full_like(tau, TAU_INF), tau)
    grp = torch.randint(0, n_grp, (B, Lq), generator=gen)
    return torch.stack([kind, tau, grp], dim=-1).to(torch.int32).contiguous()


def make_inputs(seed, B, Lq, Hq, Hkv, D, cache_lens, dtype=torch.float32, lmax=None, max_pos=2048):
    """All arguments of ``temporal_attention`` (caches filled beyond the lengths too)."""
    gen = torch.Generator().manual_seed(seed)
    lmax = lmax if lmax is not None else max(max(cache_lens), 1) + 3
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    q = rnd(B, Lq, Hq, D)
    k = rnd(B, Lq, Hkv, D)
    v = rnd(B, Lq, Hkv, D)
    k_cache = rnd(B, lmax, Hkv, D)
    v_cache = rnd(B, lmax, Hkv, D)
    cache_seqlens = torch.tensor(cache_lens, dtype=torch.int32)
    labels = random_labels(gen, B, Lq)
    start = cache_seqlens.to(torch.int64)[:, None]
    positions = (start + torch.randint(0, max_pos, (B, 1), generator=gen) + torch.arange(Lq)[None, :]).contiguous()
    return q, k, v, k_cache, v_cache, cache_seqlens, labels, positions


def max_err(a, b):
    return (a.to(torch.float64) - b.to(torch.float64)).abs().max().item()


def available_backends(device) -> list:
    """Backend names that can run on ``device``: ``torch``, plus ``triton`` and ``cuda`` when
    they can (on a GPU with the built extension: all three)."""
    from simsd_kernels.backends import resolve_backend
    names = ["torch"]
    for name in ("triton", "cuda"):
        try:
            resolve_backend(name, torch.device(device))
            names.append(name)
        except ValueError:
            pass
    return names
