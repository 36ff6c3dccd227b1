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
from simsd.models.pages import PageAllocator, PagesExhausted, check_page_size
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
    assert c.allocator.pages == [[2, 3], [0, 1, 4]] and c.block_table[:, :3].tolist() == [[2, 3, 0], [0, 1, 4]]
    c.seqlens.fill_(3)
    c.release(1)
    assert c.allocator.free_pages == 3 and c.seqlens.tolist() == [3, 0]


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
