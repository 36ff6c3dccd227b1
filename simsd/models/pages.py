"""The page allocator of a paged KV cache: a free list of page ids, pages taken as a row grows and
returned when it ends, and the block-level prefix cache (vLLM's block manager and its automatic
prefix caching, reduced to what one pool needs).

Host-side bookkeeping only: :class:`PageAllocator` decides which pages a row owns; the cache
(:class:`simsd.models.cache.KVCache`) copies a row's page ids into its device ``block_table``.
Pages are handed out lowest id first (a deterministic layout: the same requests in the same order
get the same pages); a row's pages are its table entries in order, the first page holding slots
``[0, page_size)``.

**Prefix cache.** Committed blocks never change in block diffusion, and a full page of committed
tokens holds K/V that depend only on the tokens up to its end (block-causal attention, absolute
positions from 0). A page is named by :func:`page_keys`: the SHA-256 of its tokens chained with
its predecessor's key, so equal keys mean equal token prefixes (vLLM's hashed blocks). A row
registers its full committed pages (:meth:`~PageAllocator.register`); another row whose tokens
start the same way finds them (:meth:`~PageAllocator.match`) and shares them
(:meth:`~PageAllocator.share`, reference counts). A registered page that no row uses stays
cached and counts as free: a :meth:`~PageAllocator.grow` takes free pages first, then evicts
cached ones least recently used first.
"""
from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict

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


def page_keys(tokens, page_size: int) -> list:
    """The prefix-cache keys of the full pages of ``tokens`` (host ints, slot order from slot 0):
    ``keys[i]`` (32 bytes) is the SHA-256 of ``keys[i - 1]`` and the ``page_size`` ids of page
    ``i``, so it names the whole prefix ``tokens[:(i + 1) * page_size]``; a partial last page has
    no key."""
    keys, prev = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prev = hashlib.sha256(prev + array("q", tokens[start:start + page_size]).tobytes()).digest()
        keys.append(prev)
    return keys


class PageAllocator:
    """``num_pages`` pages of ``page_size`` slots shared by ``batch_size`` rows of at most
    ``max_pages`` pages each, with the prefix cache of the module doc.

    ``pages[b]`` lists the page ids row ``b`` owns, in slot order. :meth:`grow` takes the pages a
    row needs to hold ``num_tokens`` slots, :meth:`release` returns them. Errors:
    :class:`PagesExhausted` when the free and cached pages are too few, ``ValueError`` for a row
    past ``max_pages``. Counters: ``evictions`` (cached pages taken back by :meth:`grow`).
    """

    def __init__(self, num_pages: int, page_size: int, batch_size: int, max_pages: int):
        if num_pages < 0 or page_size < 1 or batch_size < 0 or max_pages < 1:
            raise ValueError(f"bad pool: {num_pages} pages of {page_size}, {batch_size} rows of {max_pages} pages")
        self.num_pages, self.page_size, self.max_pages = num_pages, page_size, max_pages
        self._free = list(range(num_pages))  # a heap: lowest id first
        self.pages: list[list[int]] = [[] for _ in range(batch_size)]
        self._refs = [0] * num_pages          # rows that hold each page
        self._key_of: dict = {}               # registered page -> its key
        self._page_of: dict = {}              # key -> its registered page
        self._unused: OrderedDict = OrderedDict()  # registered pages no row holds, least recently used first
        self.evictions = 0

    @property
    def free_pages(self) -> int:
        """Pages a :meth:`grow` may take: the free ones and the cached ones no row holds."""
        return len(self._free) + len(self._unused)

    @property
    def used_pages(self) -> int:
        """Pages held by rows."""
        return self.num_pages - self.free_pages

    @property
    def cached_pages(self) -> int:
        """Registered pages (held by rows or not): the prefix cache's content."""
        return len(self._page_of)

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
        if need > self.free_pages:
            raise PagesExhausted(f"row {row} needs {need} more pages, {self.free_pages} free of {self.num_pages}")
        taken = [self._take() for _ in range(need)]
        self.pages[row].extend(taken)
        return taken

    def _take(self) -> int:
        """A page for a row: the lowest free one, else the least recently used cached one (its
        key dropped: an eviction)."""
        if self._free:
            p = heapq.heappop(self._free)
        else:
            p, _ = self._unused.popitem(last=False)
            del self._page_of[self._key_of.pop(p)]
            self.evictions += 1
        self._refs[p] = 1
        return p

    def release(self, row: int) -> list:
        """Give back every page of row ``row``: a page no other row holds goes to the free list,
        or, registered, stays cached as the most recently used; returns the row's pages."""
        pages, self.pages[row] = self.pages[row], []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p]:
                continue
            if p in self._key_of:
                self._unused[p] = None
            else:
                heapq.heappush(self._free, p)
        return pages

    def match(self, keys: list) -> list:
        """The registered pages of the longest prefix of ``keys`` (:func:`page_keys`) held in
        the cache, in order (nothing taken)."""
        found = []
        for key in keys:
            p = self._page_of.get(key)
            if p is None:
                break
            found.append(p)
        return found

    def share(self, row: int, pages: list) -> None:
        """Row ``row``, which holds no page, takes ``pages`` (a :meth:`match`) as its first pages
        (each page's reference count goes up; a cached page no row held is in use again).

        Raises:
            ValueError: the row holds pages already, a page is not registered, or more than
                ``max_pages`` pages.
        """
        if self.pages[row]:
            raise ValueError(f"row {row} holds {len(self.pages[row])} pages; a shared prefix comes first")
        if len(pages) > self.max_pages or any(p not in self._key_of for p in pages):
            raise ValueError(f"row {row}: pages {pages} are not a cached prefix of at most {self.max_pages} pages")
        for p in pages:
            self._refs[p] += 1
            self._unused.pop(p, None)
        self.pages[row] = list(pages)

    def register(self, row: int, keys: list) -> int:
        """Name row ``row``'s first ``len(keys)`` pages by ``keys`` (:func:`page_keys` of its
        committed tokens: every slot of those pages holds its final K/V). A page registered
        already, or a key another page holds, is left as it is. Returns the pages newly
        registered.

        Raises:
            ValueError: more keys than the row's pages.
        """
        mine = self.pages[row]
        if len(keys) > len(mine):
            raise ValueError(f"row {row}: {len(keys)} page keys for {len(mine)} pages")
        new = 0
        for p, key in zip(mine, keys):
            if p in self._key_of or key in self._page_of:
                continue
            self._key_of[p], self._page_of[key] = key, p
            new += 1
        return new
