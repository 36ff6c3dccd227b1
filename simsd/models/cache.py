"""Static KV cache: preallocated per-layer K/V buffers and per-row lengths on the device."""
from __future__ import annotations

import torch


class KVCache:
    """Per-layer buffers ``k[i], v[i]`` of shape ``(B, Lmax, Hkv, D)`` and ``seqlens (B,) int32``.

    Keys are stored rotated (RoPE applied at their positions). ``seqlens[b]`` counts the
    committed tokens of row ``b``; forwards read ``[0, seqlens[b])`` and never resize buffers
    (CUDA-graph friendly).
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device):
        shape = (batch_size, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.max_len = max_len
        #: check for overflow in :meth:`advance` (a host read; off where the caller tracks lengths)
        self.check_lengths = True

    @classmethod
    def for_model(cls, config, batch_size: int, max_len: int, dtype, device) -> "KVCache":
        return cls(config.num_hidden_layers, batch_size, max_len, config.num_key_value_heads,
                   config.head_dim, dtype, device)

    def rows(self, start: int, stop: int) -> "KVCache":
        """A view of rows ``[start, stop)``: its buffers and ``seqlens`` alias this cache's, so
        writes and ``advance`` through the view land here (no copy)."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(f"rows [{start}, {stop}) outside a cache of {self.batch_size} rows")
        view = KVCache.__new__(KVCache)
        view.k = [t[start:stop] for t in self.k]
        view.v = [t[start:stop] for t in self.v]
        view.seqlens = self.seqlens[start:stop]
        view.max_len = self.max_len
        view.check_lengths = self.check_lengths
        return view

    @property
    def batch_size(self) -> int:
        return self.seqlens.shape[0]

    def reset(self) -> None:
        self.seqlens.zero_()

    def advance(self, num_tokens) -> None:
        """Add ``num_tokens`` (int or ``(B,)`` tensor) to every row's length.

        Raises:
            ValueError: the cache would overflow ``max_len`` (checked with a host read unless
                ``check_lengths`` is off or a CUDA graph is being captured).
        """
        new = self.seqlens + num_tokens  # an int or a device tensor: no host-to-device copy
        capturing = new.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.check_lengths and not capturing and int(new.max()) > self.max_len:
            raise ValueError(f"KV cache overflow: length {int(new.max())} > capacity {self.max_len}")
        self.seqlens.copy_(new)
