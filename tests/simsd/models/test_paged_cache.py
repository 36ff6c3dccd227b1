"""The paged KV cache (simsd/models/cache.py) and its page allocator (simsd/models/pages.py).

* the page size is validated (positive, a whole number of blocks, dividing the capacity), the
  error names ``page_size``;
* the allocator hands out the lowest free pages, takes pages only as a row grows, refuses a
  request it cannot serve without taking anything, returns a row's pages when it ends;
* the default cache is the contiguous layout as the one-page-per-row case (each row owning its
  consecutive pages);
* a model's forwards over a shared pool whose rows took their pages interleaved (so a row's pages
  are not consecutive) give the logits and K/V bits of the contiguous cache, through prefill and
  block steps whose writes cross page boundaries inside a block and at its edge.
"""
from __future__ import annotations

import pytest
import torch

from simsd import load_checkpoint
from simsd.config.vocabulary import ParamError
from simsd.models.cache import KVCache
from simsd.models.model import labels_for
from simsd.models.pages import PageAllocator, PagesExhausted, check_page_size, page_keys
from tests.helpers import random_checkpoint

V = 96


@pytest.mark.parametrize("page, max_len, block, match", [
    (0, 16, None, "positive"), (6, 16, 4, "whole number of blocks"), (8, 20, 4, "divide the cache capacity"),
    (2.0, 16, None, "positive"),
])
def test_bad_page_size_is_named(page, max_len, block, match):
    with pytest.raises(ParamError, match=match) as err:
        check_page_size(page, max_len, block)
    assert err.value.param == "page_size"
    with pytest.raises(ParamError):
        KVCache(1, 2, max_len, 1, 4, torch.float32, "cpu", page_size=page, block_size=block)


def test_allocator_takes_pages_as_rows_grow_and_returns_them():
    alloc = PageAllocator(num_pages=6, page_size=4, batch_size=3, max_pages=4)
    assert alloc.grow(0, 5) == [0, 1] and alloc.grow(0, 8) == [] and alloc.grow(1, 1) == [2]
    assert alloc.grow(0, 9) == [3] and (alloc.used_pages, alloc.free_pages) == (4, 2)
    with pytest.raises(PagesExhausted):
        alloc.grow(2, 12)  # 3 pages, 2 free: nothing taken
    assert alloc.free_pages == 2 and alloc.pages[2] == []
    with pytest.raises(ValueError, match="more than a row's 4"):
        alloc.grow(1, 17)
    assert alloc.release(0) == [0, 1, 3] and alloc.free_pages == 5
    assert alloc.grow(2, 12) == [0, 1, 3]  # lowest ids first


def test_default_cache_is_one_page_per_row_and_pages_are_consecutive():
    c = KVCache(2, 3, 8, 1, 4, torch.float32, "cpu")
    assert c.k[0].shape == (3, 8, 1, 4) and c.block_table.tolist() == [[0], [1], [2]]
    p = KVCache(2, 3, 8, 1, 4, torch.float32, "cpu", page_size=4)
    assert p.k[0].shape == (6, 4, 1, 4) and p.block_table.tolist() == [[0, 1], [2, 3], [4, 5]]
    view = p.rows(1, 3)
    assert view.k is p.k and view.block_table.tolist() == [[2, 3], [4, 5]]


def test_shared_pool_grows_and_releases_through_the_table():
    c = KVCache(1, 2, 8, 1, 4, torch.float32, "cpu", page_size=2, num_pages=5)
    c.grow(1, 3)
    c.grow(0, 4)
    c.rows(1, 2).grow(0, 5)
    # the pool's sixth page (id 5) is the scratch page that unowned entries name
    assert c.allocator.pages == [[2, 3], [0, 1, 4]] and c.block_table[:, :3].tolist() == [[2, 3, 5], [0, 1, 4]]
    assert c.k[0].shape[0] == 6 and c.scratch == 5
    c.seqlens.fill_(3)
    c.release(1)
    assert c.allocator.free_pages == 3 and c.seqlens.tolist() == [3, 0] and c.block_table[1].tolist() == [5] * 4


@pytest.mark.bitwise
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_over_a_shared_pool_gives_the_contiguous_bits(dtype):
    path = random_checkpoint("target", tokenizer=False, vocab_size=V, num_hidden_layers=2, seed=0, std=0.2)
    m = load_checkpoint(path, dtype=dtype, with_tokenizer=False).model
    B, L, cap, page = 2, 4, 36, 6  # page 6 with blocks of 4: boundaries inside a block and at its edge
    flat = m.new_cache(B, cap)
    paged = m.new_cache(B, cap, page_size=page, num_pages=B * cap // page + 2)
    prompts = [5, 9]
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        lens = flat.seqlens.tolist()
        n = max(prompts) if step == 0 else L
        for b in (1, 0):  # the rows take their pages interleaved: row 0's pages are not consecutive
            paged.grow(b, lens[b] + n)
        ids = torch.randint(0, V - 2, (B, n), generator=gen)
        pos = flat.seqlens.long()[:, None] + torch.arange(n)[None]
        lab = labels_for(n, "cpu").repeat(B, 1, 1)
        write = torch.tensor(prompts if step == 0 else [L, L], dtype=torch.int32)
        want = m(ids, pos, lab, "block_causal", flat, write)
        got = m(ids, pos, lab, "block_causal", paged, write)
        assert torch.equal(got, want), step
    assert paged.allocator.pages[0] != list(range(paged.allocator.pages[0][0], paged.allocator.pages[0][0] + 4))
    cols = torch.arange(int(flat.seqlens.min()))[None].repeat(B, 1)
    for a, b in zip(flat.k + flat.v, paged.k + paged.v):
        assert torch.equal(flat.slots(a, cols), paged.slots(b, cols))


def test_page_keys_name_whole_prefixes():
    a, b = page_keys(list(range(10)), 4), page_keys(list(range(8)) + [7, 7, 7], 4)
    assert len(a) == 2 and a == b  # equal first 8 tokens; the partial last page has no key
    assert page_keys([0, 1, 2, 3, 9, 5, 6, 7], 4)[0] == a[0] and page_keys([0, 1, 2, 3, 9, 5, 6, 7], 4)[1] != a[1]
    assert page_keys([1, 0, 2, 3, 4, 5, 6, 7], 4)[1] != a[1]  # a page's key depends on the pages before it
    assert page_keys([1, 2, 3], 4) == []


def test_prefix_pages_are_shared_counted_and_evicted_least_recently_used():
    alloc = PageAllocator(num_pages=6, page_size=4, batch_size=3, max_pages=4)
    sys_a = page_keys(list(range(12)), 4)   # three full pages of one system prompt
    sys_b = page_keys(list(range(100, 108)), 4)
    alloc.grow(0, 13)
    assert alloc.register(0, sys_a) == 3 and alloc.cached_pages == 3
    hit = alloc.match(page_keys(list(range(12)) + [50] * 4, 4))
    assert hit == alloc.pages[0][:3] and alloc.match(sys_b) == []
    alloc.share(1, hit[:2])
    alloc.grow(1, 10)  # its own third page after the two shared ones
    assert alloc.pages[1][:2] == hit[:2] and alloc.pages[1][2] not in alloc.pages[0]
    assert (alloc.used_pages, alloc.free_pages) == (5, 1)
    alloc.release(0)  # pages 0-1 still held by row 1; its third cached page and last page come back
    assert (alloc.used_pages, alloc.free_pages, alloc.cached_pages) == (3, 3, 3)
    assert alloc.match(sys_a) == hit  # still cached though no row holds the third page
    alloc.release(1)
    assert (alloc.used_pages, alloc.free_pages, alloc.cached_pages) == (0, 6, 3)
    # pressure: free pages go first, then cached ones, least recently used first
    alloc.grow(2, 12)
    assert alloc.evictions == 0 and alloc.cached_pages == 3
    alloc.release(2)
    alloc.grow(2, 16)  # 4 pages: the 3 free ones and the least recently used cached page
    assert alloc.evictions == 1 and alloc.match(sys_a) == hit[:2]  # the third page, given back first, went first
    with pytest.raises(PagesExhausted):
        alloc.grow(0, 12)  # 2 cached pages left, 3 needed: nothing taken
    assert alloc.cached_pages == 2 and alloc.pages[0] == []
    # a cached page no row held is in use again once shared: never evicted while a row holds it
    alloc.share(0, alloc.match(sys_a))
    alloc.release(2)
    assert alloc.grow(1, 16) == [p for p in range(6) if p not in hit[:2]]
    assert alloc.free_pages == 0 and alloc.evictions == 1 and alloc.match(sys_a) == hit[:2]


def test_prefix_share_and_register_refuse_what_they_cannot_do():
    alloc = PageAllocator(num_pages=4, page_size=2, batch_size=2, max_pages=2)
    alloc.grow(0, 4)
    keys = page_keys([1, 2, 3, 4], 2)
    with pytest.raises(ValueError, match="3 page keys for 2 pages"):
        alloc.register(0, keys + keys[:1])
    assert alloc.register(0, keys) == 2 and alloc.register(0, keys) == 0
    alloc.grow(1, 2)
    with pytest.raises(ValueError, match="a shared prefix comes first"):
        alloc.share(1, alloc.match(keys))
    assert alloc.register(1, keys[:1]) == 0  # another page holds that key: left unregistered
    alloc.release(1)
    with pytest.raises(ValueError, match="not a cached prefix"):
        alloc.share(1, [3])


@pytest.mark.bitwise
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_shared_prefix_gives_the_bits_of_prefilling_it_again(dtype):
    """A row that takes another row's cached prompt pages and prefills only the rest has the
    K/V and logits of a row that prefilled the whole prompt, bit for bit under shape-invariant
    numerics (``invariant``, units of a block: the rest is a whole number of blocks)."""
    path = random_checkpoint("target", tokenizer=False, vocab_size=V, num_hidden_layers=2, seed=1, std=0.2)
    m = load_checkpoint(path, dtype=dtype, with_tokenizer=False).model
    m.invariant = True
    page, L = 8, 4
    cache = m.new_cache(3, 32, page_size=page, num_pages=10, block_size=L)
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, V - 2, (16,), generator=gen).tolist()
    prompts = [system + [3, 4, 5, 6], system + [7, 8, 9, 10]]

    def prefill(row: int, ids: list, start: int):
        cache.grow(row, len(ids))
        n = len(ids) - start
        view = cache.rows(row, row + 1)
        lab = torch.tensor([[(0, 0, p // L) for p in range(start, len(ids))]], dtype=torch.int32)
        return m(torch.tensor([ids[start:]]), torch.arange(start, len(ids))[None], lab, "block_causal", view,
                 torch.tensor([n], dtype=torch.int32), unit=L)

    whole = prefill(0, prompts[0], 0)
    assert cache.register(0, page_keys(prompts[0], page)) == 2 and cache.allocator.cached_pages == 2
    assert cache.rows(1, 2).share_prefix(0, page_keys(prompts[0], page)) == 2  # the same prompt
    assert cache.seqlens.tolist()[:2] == [20, 16]
    again = prefill(1, prompts[0], 16)
    assert torch.equal(again, whole[:, 16:])
    assert cache.share_prefix(2, page_keys(prompts[1], page), max_pages=1) == 1
    assert cache.allocator.pages[2] == cache.allocator.pages[0][:1]
    other = prefill(2, prompts[1], 8)
    fresh = m.new_cache(1, 32)
    lab = torch.tensor([[(0, 0, p // L) for p in range(20)]], dtype=torch.int32)
    want = m(torch.tensor([prompts[1]]), torch.arange(20)[None], lab, "block_causal", fresh,
             torch.tensor([20], dtype=torch.int32), unit=L)
    assert torch.equal(other, want[:, 8:])
    cols = torch.arange(20)[None]
    for a, b in zip(fresh.k + fresh.v, cache.k + cache.v):
        assert torch.equal(fresh.slots(a, cols), cache.rows(2, 3).slots(b, cols))
