"""Static KV cache: per-layer page pools, a block table and per-row lengths on the device."""
from __future__ import annotations

import torch

from simsd_kernels.paging import page_slots

from .pages import PageAllocator, check_page_size


class KVCache:
    """Per-layer page pools ``k[i], v[i]`` of shape ``(num_pages, page_size, Hkv, D)``, a
    ``block_table (B, max_len // page_size) int32`` and ``seqlens (B,) int32`` (the door's
    convention, :mod:`simsd_kernels.paging`: row b's slot s at page ``block_table[b, s //
    page_size]``, offset ``s % page_size``).

    Keys are stored rotated (RoPE applied at their positions). ``seqlens[b]`` counts the
    committed tokens of row ``b``; forwards read ``[0, seqlens[b])`` and never resize buffers
    (CUDA-graph friendly: the block table is updated in place).

    ``page_size`` (default ``max_len``: one page per row) must divide ``max_len`` and be a whole
    number of ``block_size`` tokens when that is given (``ParamError(page_size)``,
    :func:`simsd.models.pages.check_page_size`). Without ``num_pages`` every row owns its
    ``max_len // page_size`` consecutive pages from the start (the contiguous layout: with one page
    per row the pools are the ``(B, max_len, Hkv, D)`` buffers of a contiguous cache). With
    ``num_pages`` the pool is shared: rows own no page until :meth:`grow` takes them from the
    :class:`~simsd.models.pages.PageAllocator` (:attr:`allocator`) and :meth:`release` returns them.
    A shared pool has one more page, :attr:`scratch`, that the allocator never hands out: every
    table entry of a row past its own pages names it, so the writes of a forward that covers a
    row without a request of its own (the door writes every covered row's query tokens) land
    there, never in another row's page; nothing reads it as a committed slot.
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device, page_size: int | None = None,
                 num_pages: int | None = None, block_size: int | None = None):
        page_size = max_len if page_size is None else page_size
        # a cache of no slot (max_len 0) is one empty page per row
        max_pages = 1 if max_len == page_size == 0 else check_page_size(page_size, max_len, block_size)
        owned = num_pages is None
        num_pages = batch_size * max_pages if owned else int(num_pages)
        #: the page unowned table entries name (a shared pool's extra page; None when rows own theirs)
        self.scratch = None if owned else num_pages
        shape = (num_pages + (not owned), page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.max_len, self.page_size = max_len, page_size
        self.allocator = PageAllocator(num_pages, max(page_size, 1), batch_size, max_pages)
        self.block_table = torch.full((batch_size, max_pages), self.scratch or 0, dtype=torch.int32, device=device)
        self._first_row = 0  # this cache's first row in the allocator (a view's start)
        if owned:  # every row takes its consecutive pages now
            for b in range(batch_size):
                self.grow(b, max_len)
        #: check for overflow in :meth:`advance` (a host read; off where the caller tracks lengths)
        self.check_lengths = True

    @classmethod
    def for_model(cls, config, batch_size: int, max_len: int, dtype, device, **paging) -> "KVCache":
        return cls(config.num_hidden_layers, batch_size, max_len, config.num_key_value_heads,
                   config.head_dim, dtype, device, **paging)

    def rows(self, start: int, stop: int) -> "KVCache":
        """A view of rows ``[start, stop)``: the same pools, its ``block_table`` and ``seqlens``
        alias this cache's rows, so writes and ``advance`` through the view land here (no copy).
        Pages are taken and returned through the whole cache (:meth:`grow`, :meth:`release`)."""
        if not 0 <= start < stop <= self.batch_size:
            raise ValueError(f"rows [{start}, {stop}) outside a cache of {self.batch_size} rows")
        view = KVCache.__new__(KVCache)
        view.k, view.v = self.k, self.v
        view.seqlens = self.seqlens[start:stop]
        view.block_table = self.block_table[start:stop]
        view.max_len, view.page_size, view.allocator = self.max_len, self.page_size, self.allocator
        view.scratch = self.scratch
        view.check_lengths = self.check_lengths
        view._first_row = self._first_row + start
        return view

    @property
    def batch_size(self) -> int:
        return self.seqlens.shape[0]

    def grow(self, row: int, num_tokens: int) -> None:
        """Give row ``row`` (of this view) the pages of slots ``[0, num_tokens)`` (allocator
        :meth:`~simsd.models.pages.PageAllocator.grow`; the new ids written into the block table).

        Raises:
            simsd.models.pages.PagesExhausted: the pool has too few free pages (nothing taken).
            ValueError: more than ``max_len`` slots.
        """
        row_id = self._first_row + row
        have = len(self.allocator.pages[row_id])
        taken = self.allocator.grow(row_id, num_tokens)
        if taken:
            self.block_table[row, have:have + len(taken)] = torch.tensor(taken, dtype=torch.int32)

    def share_prefix(self, row: int, keys: list, max_pages: int | None = None) -> int:
        """Give row ``row`` (of this view; it holds no page) the cached pages of the longest
        prefix of ``keys`` (:func:`simsd.models.pages.page_keys` of its tokens), at most
        ``max_pages`` of them, as its first pages, and make them its committed length; returns
        the pages taken (:meth:`~simsd.models.pages.PageAllocator.share`)."""
        pages = self.allocator.match(keys)[:max_pages]
        if pages:
            self.allocator.share(self._first_row + row, pages)
            self.block_table[row, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.seqlens[row] = len(pages) * self.page_size
        return len(pages)

    def register(self, row: int, keys: list) -> int:
        """Offer row ``row``'s first ``len(keys)`` pages (full pages of committed tokens named by
        ``keys``) to the prefix cache; returns the pages newly cached
        (:meth:`~simsd.models.pages.PageAllocator.register`)."""
        return self.allocator.register(self._first_row + row, keys)

    def release(self, row: int) -> None:
        """Return row ``row``'s pages to the pool and empty the row (length 0; its table entries
        name :attr:`scratch`). A cache whose rows own their pages keeps them (length 0 only)."""
        self.seqlens[row] = 0
        if self.scratch is None:
            return
        self.allocator.release(self._first_row + row)
        self.block_table[row].fill_(self.scratch)

    @property
    def shared(self) -> bool:
        """Whether the rows share a pool (pages taken as they grow) rather than own their pages."""
        return self.scratch is not None

    def slots(self, t: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Entries of the pool ``t`` (one of :attr:`k`, :attr:`v`) at logical slots ``cols (B, L)``
        int64 of every row (each ``< max_len``): ``(B, L, Hkv, D)``, gathered through the table."""
        return t[page_slots(self.block_table, cols, self.page_size)]

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
