"""The engine's side of a paged KV cache: page pools shared by the rows, pages taken as rows grow,
admission by free pages, and the block-level prefix cache (docs/design.md §6, issue 37).

With a pool (``BatchEngine(num_pages=...)``) every model's cache is a shared pool of
``num_pages`` pages of ``page_size`` slots (:class:`simsd.models.cache.KVCache`, the same count
for every model: a row holds the same tokens in each). :class:`EnginePages` keeps them:

* **growth**: before a forward, every row with a request gets the pages of every slot the forward
  writes (its length plus the forward's width: the door writes all of a row's query tokens and
  the torch backend reads them back from the cache), :meth:`EnginePages.reserve`; rows covered
  without a request write into the scratch page. A row keeps its pages until it is released
  (:meth:`release`), at most the width of one forward past its committed length;
* **admission**: a request is admitted while every pool has the pages of its prompt and one
  forward's width free (:meth:`admission_pages`); a request that could never fit the pool is
  refused (:meth:`check_fits`). When a running row cannot grow, the scheduler preempts
  (:class:`~simsd.engine.scheduler.Scheduler`);
* **prefix cache** (``prefix_caching``): a prompt's full pages of its block-aligned part are
  looked up before its prefill (:meth:`share_prefix`: the longest prefix cached in every model's
  pool is shared, its prefill skipped) and offered to the cache after it (:meth:`register_prefix`),
  as are the full pages of its prompt and output when it ends (a chat's next turn starts with
  them; the K/V of committed slots are those a prefill of their tokens writes);
  pages no row holds stay cached until a growth evicts them (least recently used first,
  :class:`simsd.models.pages.PageAllocator`). Committed K/V depend only on the tokens up to them
  (block-causal, absolute positions), so a hit gives the K/V a prefill would write: the same
  bits under shape-invariant numerics (``invariant``, chunk boundaries at blocks:
  docs/exactness.md), otherwise what a chunked prefill gives.
"""
from __future__ import annotations

from simsd.models.pages import PagesExhausted, page_keys

__all__ = ["EnginePages", "PagesExhausted"]


class EnginePages:
    """Page bookkeeping of an engine's shared pools.

    Args:
        caches: model name -> :class:`~simsd.models.cache.KVCache` over a shared pool (each with
            the same ``num_pages`` and ``page_size``).
        margin: the widest forward a row may carry (tokens written past its length).
        prefix_caching: share cached prompt pages between requests (module doc).

    Counters: ``prefix_queried`` (prompt tokens looked up in whole pages), ``prefix_hit``
    (of those, tokens found cached and not prefilled).
    """

    def __init__(self, caches: dict, margin: int, prefix_caching: bool = False):
        self.caches, self.margin, self.prefix_caching = caches, margin, prefix_caching
        first = next(iter(caches.values()))
        self.page_size, self.num_pages = first.page_size, first.allocator.num_pages
        #: pages that hold a number of slots (the allocator's rule)
        self.pages_for = first.allocator.pages_for
        self.prefix_queried = self.prefix_hit = 0

    @property
    def free_pages(self) -> int:
        """The fewest free pages among the pools (cached pages no row holds count as free)."""
        return min(c.allocator.free_pages for c in self.caches.values())

    def free_after(self, rows) -> int:
        """:attr:`free_pages` once the rows ``rows`` give theirs back (pages another row shares
        as well are counted: a bound for admission, not a promise)."""
        return min(c.allocator.free_pages + sum(len(c.allocator.pages[i]) for i in rows)
                   for c in self.caches.values())

    def admission_pages(self, prompt_len: int) -> int:
        """Pages a request of a ``prompt_len``-token prompt needs free in every pool to be
        admitted: its prompt and one forward's width."""
        return self.pages_for(prompt_len + self.margin)

    def check_fits(self, request_id: str, capacity: int) -> None:
        """Refuse a request that needs more pages than a whole pool holds.

        Raises:
            ValueError: ``capacity`` tokens plus the forward margin need more than ``num_pages``
                pages (the message gives both).
        """
        need = self.pages_for(capacity + self.margin)
        if need > self.num_pages:
            raise ValueError(f"request {request_id} needs {need} KV pages of {self.page_size} tokens ({capacity} "
                             f"tokens and a forward's {self.margin}), the pool holds {self.num_pages}")

    def reserve(self, name: str, ends: dict) -> None:
        """Give each row ``i`` of ``ends`` (``{row: slots}``) the pages of model ``name``'s slots
        ``[0, ends[i])``.

        Raises:
            PagesExhausted: the pool ran out (the rows keep what they got).
        """
        cache = self.caches[name]
        for i, end in ends.items():
            cache.grow(i, end)

    def share_prefix(self, index: int, aligned: list) -> int:
        """Before row ``index``'s prefill (it holds no page): give it, in every pool, the cached
        pages of the longest prefix of its block-aligned prompt ``aligned`` that every pool holds;
        returns the tokens they hold (its prefill starts there; 0 without ``prefix_caching``)."""
        if not self.prefix_caching:
            return 0
        keys = page_keys(aligned, self.page_size)
        hit = min(len(c.allocator.match(keys)) for c in self.caches.values())
        for cache in self.caches.values():
            cache.share_prefix(index, keys, hit)
        self.prefix_queried += len(keys) * self.page_size
        self.prefix_hit += hit * self.page_size
        return hit * self.page_size

    def register_prefix(self, index: int, aligned: list) -> None:
        """Offer row ``index``'s full pages of the committed tokens ``aligned`` (from slot 0: its
        block-aligned prompt after its prefill, its prompt and output when it ends) to every
        pool's prefix cache (nothing without ``prefix_caching``)."""
        if self.prefix_caching:
            keys = page_keys(aligned, self.page_size)
            for cache in self.caches.values():
                cache.register(index, keys)

    def release(self, index: int) -> None:
        """Return row ``index``'s pages (cached ones stay cached)."""
        for cache in self.caches.values():
            cache.release(index)

    def stats(self) -> dict:
        """Per model: ``pages_total``, ``pages_used`` (held by rows), ``pages_free`` (free or
        cached without a row), ``pages_cached`` (the prefix cache's), ``evictions``; and
        ``page_size``, ``prefix_queried_tokens``, ``prefix_hit_tokens``."""
        out = {"page_size": self.page_size, "prefix_queried_tokens": self.prefix_queried,
               "prefix_hit_tokens": self.prefix_hit}
        for name, cache in self.caches.items():
            a = cache.allocator
            out[name] = {"pages_total": a.num_pages, "pages_used": a.used_pages, "pages_free": a.free_pages,
                         "pages_cached": a.cached_pages, "evictions": a.evictions}
        return out
