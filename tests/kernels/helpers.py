"""Input builders and one-call forms of the backends' doors, shared by the kernel tests."""
from __future__ import annotations

import torch

from simsd_kernels.mask_rule import TAU_INF
from simsd_kernels.metadata import AttentionMetadata
from simsd_kernels.torch_backend import TorchAttention


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


def door_attention(backend, q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode, rope_theta,
                   softmax_scale, **plan):
    """One call of ``backend``'s door (a door class) without the cache write: opened for these
    tensors (``plan``: ``shape_invariant``, ``num_splits``), then ``attend``; ``(B, Lq, Hq, D)``,
    contiguous. Not resolved, not self-checked."""
    door = backend.open(q, k, k_cache, cache_seqlens, labels, positions, mask_mode=mask_mode, rope_theta=rope_theta,
                        softmax_scale=softmax_scale, **plan)
    return door.attend(q, k, v, k_cache, v_cache).contiguous()


def torch_attention(*args, **plan):
    """:func:`door_attention` of the torch backend (the reference the kernels are compared with),
    arguments ``(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode, rope_theta,
    softmax_scale)``."""
    return door_attention(TorchAttention, *args, **plan)


def door_append_kv(backend, k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta, num_tokens,
                   block_table=None):
    """``backend``'s door's cache write of the first ``num_tokens`` tokens (in place; page pools
    with a ``block_table``)."""
    backend.open_write(k, k_cache, cache_seqlens, positions, rope_theta=rope_theta,
                       block_table=block_table).append_kv(k, v, k_cache, v_cache, num_tokens)


def torch_append_kv(*args, **paging):
    """:func:`door_append_kv` of the torch backend, arguments ``(k, v, positions, k_cache, v_cache,
    cache_seqlens, rope_theta, num_tokens)`` and ``block_table``."""
    door_append_kv(TorchAttention, *args, **paging)


def function_backend(name, attention=None, append_kv=None, *, head_dims=None, auto_devices=("cpu",),
                     plan_options=False, calls=None):
    """A backend (a door class) named ``name`` made of two functions, for deliberately wrong
    backends: ``attention(q, k, v, k_cache, v_cache, cache_seqlens, labels, positions, mask_mode,
    rope_theta, softmax_scale, **plan)`` -> ``(B, Lq, Hq, D)`` (default :func:`torch_attention`) is its
    ``attend`` and ``append_kv(k, v, positions, k_cache, v_cache, cache_seqlens, rope_theta,
    num_tokens)`` (default :func:`torch_append_kv`) its cache write; its ``forward`` is the one of
    :class:`AttentionMetadata` (attend, then the write). With ``plan_options``, ``plan`` holds the
    door's ``shape_invariant`` and ``num_splits`` when they are set (else it is empty); a paged door
    passes both functions its ``block_table`` (keyword) too. ``calls``
    (a dict) counts ``attention``, ``append_kv`` and ``available`` (its availability queries)."""
    calls = calls if calls is not None else {}
    for key in ("attention", "append_kv", "available"):
        calls.setdefault(key, 0)
    attention, append = attention or torch_attention, append_kv or torch_append_kv

    class FunctionBackend(AttentionMetadata):
        @classmethod
        def is_available(cls, device):
            calls["available"] += 1
            return True, ""

        def attend(self, q, k, v, k_cache, v_cache):
            self._check(q, k, v, k_cache, v_cache)
            calls["attention"] += 1
            plan = {}
            if plan_options and self.shape_invariant:
                plan["shape_invariant"] = True
            if plan_options and self.num_splits:
                plan["num_splits"] = self.num_splits
            if self.paged:
                plan["block_table"] = self.block_table
            return attention(q, k, v, k_cache, v_cache, self.cache_seqlens, self.labels, self.positions,
                             int(self.mask_mode), self.rope_theta, self.softmax_scale, **plan)

        def append_kv(self, k, v, k_cache, v_cache, num_tokens=None):
            n = self._check_write(k, v, k_cache, v_cache, num_tokens)
            calls["append_kv"] += 1
            append(k, v, self.positions, k_cache, v_cache, self.cache_seqlens, self.rope_theta, n,
                   **({"block_table": self.block_table} if self.paged else {}))

    FunctionBackend.name, FunctionBackend.auto_devices, FunctionBackend.plan_options = name, auto_devices, plan_options
    FunctionBackend.head_dims = head_dims
    return FunctionBackend
