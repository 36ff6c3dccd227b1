"""The page-table convention of the KV caches (flash-attn's and FlashInfer's ``block_table``).

Every cache the door reads is a page pool ``k_cache, v_cache (num_pages, page_size, Hkv, D)`` and
a ``block_table (B, max_pages) int32``: the key of row ``b`` at logical slot ``s`` (``0 <= s <
capacity = max_pages * page_size``) lives at ``k_cache[block_table[b, s // page_size], s %
page_size]``. The contiguous cache ``(B, Lmax, Hkv, D)`` is the special case of one page of
``Lmax`` per row, ``block_table = [[0], [1], ..., [B - 1]]`` (:func:`identity_table`): a door
opened without a block table reads and writes through that table, the same code path.

The entries a forward reads (slots ``< cache_seqlens[b]``) and writes (slots ``cache_seqlens[b] +
i`` below the capacity) must name pages of the pool; the others are never read (the kernels mask
their block-table loads), so a row's unused tail may hold any value. Nothing here reads the table
on the host (CUDA-graph safe: a static table is updated in place between replays).
"""
from __future__ import annotations

import torch


def identity_table(batch: int, device) -> torch.Tensor:
    """``(B, 1) int32`` ``[[0], ..., [B - 1]]``: the contiguous cache's table (row b owns page b)."""
    return torch.arange(batch, dtype=torch.int32, device=device).view(batch, 1)


def page_size_of(block_table, batch: int, cache_capacity: int) -> int:
    """The page size of a forward whose rows hold ``cache_capacity`` logical slots through
    ``block_table (B, max_pages) int32`` (None: the contiguous case, one page of the capacity).

    Raises:
        ValueError: ``block_table`` not a ``(B, max_pages)`` int32 tensor contiguous in its last dim,
            or ``cache_capacity`` not ``max_pages`` whole pages (the message names ``block_table``).
    """
    if block_table is None:
        return int(cache_capacity)
    check_block_table(block_table, batch)
    pages = block_table.shape[1]
    if cache_capacity % pages:
        raise ValueError(f"block_table: cache_capacity {cache_capacity} is not {pages} whole pages")
    return cache_capacity // pages


def check_block_table(block_table, batch: int) -> None:
    """Raise ``ValueError`` naming ``block_table`` unless it is a ``(B, max_pages >= 1)`` int32
    tensor contiguous in its last dim."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
        got = tuple(block_table.shape) if isinstance(block_table, torch.Tensor) else type(block_table).__name__
        raise ValueError(f"block_table must be a (B={batch}, max_pages) int32 tensor, got {got}"
                         + (f" {block_table.dtype}" if isinstance(block_table, torch.Tensor) else ""))
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be (B={batch}, max_pages >= 1), got {tuple(block_table.shape)}")
    if block_table.numel() and block_table.stride(-1) != 1:
        raise ValueError(f"block_table must be contiguous in its last dim, got strides {block_table.stride()}")


def page_slots(block_table: torch.Tensor, slots: torch.Tensor, page_size: int, rows=None):
    """``(page, offset)`` int64 index tensors of logical ``slots`` (int64, each ``< capacity``) of
    ``rows`` (an index tensor broadcasting against ``slots``; default ``arange(B)[:, None]``):
    ``cache[page, offset]`` is the slot's entry (a gather or, with ``index_put_``, a scatter)."""
    if rows is None:
        rows = torch.arange(block_table.shape[0], device=slots.device)[:, None]
    return block_table[rows, slots // page_size].to(torch.int64), slots % page_size


def gather_rows(cache: torch.Tensor, block_table: torch.Tensor, page_size: int, rows: slice, n: int) -> torch.Tensor:
    """Slots ``[0, n)`` of the rows ``rows`` (a slice of the table's rows) of the page pool
    ``cache``, gathered through ``block_table`` into a new ``(rows, n, Hkv, D)`` tensor (the
    contiguous case included: one code path)."""
    table = block_table[rows]
    slots = torch.arange(n, device=cache.device)[None, :]
    pages, offs = page_slots(table, slots, page_size, torch.arange(table.shape[0], device=cache.device)[:, None])
    return cache[pages, offs]
