"""The page allocator of a paged KV cache: a free list of page ids, pages taken as a row grows and
returned when it ends (vLLM's block manager, reduced to what one pool needs).

Host-side bookkeeping only: :class:`PageAllocator` decides which pages a row owns; the cache
(:class:`simsd.models.cache.KVCache`) copies a row's page ids into its device ``block_table``.
Pages are handed out lowest id first (a deterministic layout: the same requests in the same order
get the same pages); a row's pages are its table entries in order, the first page holding slots
``[0, page_size)``.
"""
from __future__ import annotations

import heapq

from simsd.config.vocabulary import ParamError, opt


class PagesExhausted(RuntimeError):
    """The pool has fewer free pages than a row asked for (nothing was taken)."""


def check_page_size(page_size: int, max_len: int, block_size: int | None = None) -> int:
    """``max_len // page_size``, the pages of a row of ``max_len`` slots.

    Raises:
        ParamError(page_size): not a positive int, not a whole number of ``block_size`` (SDAR's
            block length: a committed block then never straddles a page's end), or not dividing
            ``max_len``.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ParamError("page_size", f"{opt('page_size')} must be a positive integer, got {page_size!r}")
    if block_size is not None and page_size % block_size:
        raise ParamError("page_size", f"{opt('page_size', page_size)} must be a whole number of blocks of "
                                      f"{block_size} tokens")
    if max_len % page_size:
        raise ParamError("page_size", f"{opt('page_size', page_size)} must divide the cache capacity {max_len}")
    return max_len // page_size


class PageAllocator:
    """``num_pages`` pages of ``page_size`` slots shared by ``batch_size`` rows of at most
    ``max_pages`` pages each.

    ``pages[b]`` lists the page ids row ``b`` owns, in slot order. :meth:`grow` takes the pages a
    row needs to hold ``num_tokens`` slots, :meth:`release` returns them. Errors:
    :class:`PagesExhausted` when the free list is too short, ``ValueError`` for a row past
    ``max_pages``.
    """

    def __init__(self, num_pages: int, page_size: int, batch_size: int, max_pages: int):
        if num_pages < 0 or page_size < 1 or batch_size < 0 or max_pages < 1:
            raise ValueError(f"bad pool: {num_pages} pages of {page_size}, {batch_size} rows of {max_pages} pages")
        self.num_pages, self.page_size, self.max_pages = num_pages, page_size, max_pages
        self._free = list(range(num_pages))  # a heap: lowest id first
        self.pages: list[list[int]] = [[] for _ in range(batch_size)]

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` slots (ceil)."""
        return -(-int(num_tokens) // self.page_size)

    def grow(self, row: int, num_tokens: int) -> list:
        """Make row ``row`` own the pages of slots ``[0, num_tokens)``; returns the pages taken now
        (none when it already holds them; a row never shrinks here).

        Raises:
            ValueError: more than ``max_pages`` pages for one row.
            PagesExhausted: fewer free pages than needed (nothing taken).
        """
        need = self.pages_for(num_tokens) - len(self.pages[row])
        if self.pages_for(num_tokens) > self.max_pages:
            raise ValueError(f"row {row}: {num_tokens} slots need {self.pages_for(num_tokens)} pages, "
                             f"more than a row's {self.max_pages}")
        if need <= 0:
            return []
        if need > len(self._free):
            raise PagesExhausted(f"row {row} needs {need} more pages, {len(self._free)} free of {self.num_pages}")
        taken = [heapq.heappop(self._free) for _ in range(need)]
        self.pages[row].extend(taken)
        return taken

    def release(self, row: int) -> list:
        """Return every page of row ``row`` to the free list; returns them."""
        pages, self.pages[row] = self.pages[row], []
        for p in pages:
            heapq.heappush(self._free, p)
        return pages
