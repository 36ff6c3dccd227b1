"""The paged door: caches as page pools read and written through a ``block_table``
(``simsd_kernels.paging``), on every backend that runs here (torch; Triton under the interpreter;
CUDA on a GPU).

* a forward through a page table with holes (pages scattered over a larger pool, one row's pages in
  reverse order, unused table entries -1, unreferenced pages NaN) gives the same output bits and
  writes the same K/V bits as the contiguous cache (one page per row) on the same backend, for
  page boundaries inside a block of new tokens and at its edge and for rows shorter than a page;
  its output is within the flash-attention tolerance of the float64 reference; pages no row
  references are never written (they stay NaN);
* the door's ``append_kv`` writes into the right pages; ``shape_invariant`` bits do not depend on
  the pages;
* a bad ``block_table`` (dtype, shape, pages that do not divide the capacity) is named.
"""
from __future__ import annotations

import pytest
import torch

import simsd_kernels as sk
from simsd_kernels import MaskMode
from simsd_kernels.paging import gather_rows, identity_table
from simsd_kernels.reference import temporal_attention_naive
from tests.kernels.helpers import available_backends, make_inputs, max_err, torch_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
THETA = 1e6
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 1e-2}
BACKENDS = available_backends(DEVICE)


def holey_table(gen, lens, capacity: int, page_size: int, lq: int, spare: int = 3):
    """A ``(B, capacity // page_size)`` int32 table over a pool of ``B * max_pages + spare`` pages:
    the pages a row needs (slots ``< lens[b] + lq``) drawn at random from the pool without
    repetition, row 0's in reverse order, the other entries -1 (never read); and the pool size."""
    B, max_pages = len(lens), capacity // page_size
    num_pages = B * max_pages + spare
    free = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((B, max_pages), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        used = min(max_pages, -(-(n + lq) // page_size))
        pages = [free.pop() for _ in range(used)]
        table[b, :used] = torch.tensor(sorted(pages, reverse=True) if b == 0 else pages, dtype=torch.int32)
    return table, num_pages


def to_pages(cache, table, page_size: int, num_pages: int):
    """The contiguous ``cache (B, Lmax, Hkv, D)`` laid out in a NaN-filled page pool by ``table``."""
    pool = torch.full((num_pages, page_size, *cache.shape[2:]), float("nan"), dtype=cache.dtype)
    for b in range(table.shape[0]):
        for j, page in enumerate(table[b].tolist()):
            if page >= 0:
                pool[page] = cache[b, j * page_size:(j + 1) * page_size]
    return pool


def _door(args, mode, backend, table=None, **kw):
    q, k, v, kc, vc, lens, labels, pos = args  # kc: the contiguous cache, of the same capacity
    return sk.prepare_attention(lens, labels, pos, num_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=q.shape[3],
                                dtype=q.dtype, cache_capacity=kc.shape[1], mask_mode=mode, rope_theta=THETA,
                                backend=backend, block_table=table, **kw)


def _nan_tail(cache, lens):
    unread = torch.arange(cache.shape[1])[None] >= lens[:, None]
    return cache.masked_fill(unread[..., None, None], float("nan"))


# (B, Lq, cache lengths, capacity, page size, mode): page size 4 = the block of 4 new tokens
# (a block's write starts at a page edge when the length is a multiple of 4, inside a page
# otherwise); page 6 (boundaries inside the block); page 16 (rows shorter than a page); page 1;
# a page of the whole capacity per row, the pages scattered (the torch door reads a run of rows in
# place only when their pages are consecutive)
CASES = [
    (3, 4, [8, 5, 0], 48, 4, MaskMode.BLOCK_CAUSAL),
    (3, 4, [6, 13, 2], 48, 6, MaskMode.EXACT),
    (2, 9, [3, 11], 32, 16, MaskMode.PAPER),
    (2, 8, [70, 1], 96, 8, MaskMode.BIDIRECTIONAL),
    (2, 5, [4, 9], 16, 1, MaskMode.EXACT),
    (3, 4, [7, 7, 7], 16, 16, MaskMode.BIDIRECTIONAL),  # one page per row, not in row order: one run of 3 rows
]


def _case_id(c):
    return f"B{c[0]}-Lq{c[1]}-c{'_'.join(map(str, c[2]))}-cap{c[3]}-page{c[4]}-{c[5].name.lower()}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_forward_is_the_contiguous_forward(case, dtype, backend):
    B, Lq, lens, cap, page, mode = case
    args = list(make_inputs(7 + sum(lens) + page, B, Lq, 4, 2, 64, lens, dtype=dtype, lmax=cap))
    args[3], args[4] = _nan_tail(args[3], args[5]), _nan_tail(args[4], args[5])
    table, num_pages = holey_table(torch.Generator().manual_seed(page), lens, cap, page, Lq)
    kp, vp = to_pages(args[3], table, page, num_pages), to_pages(args[4], table, page, num_pages)
    referenced = torch.zeros(num_pages, dtype=torch.bool)
    referenced[table[table >= 0].long()] = True
    dev = [a.to(DEVICE) for a in args]
    kp, vp, table = kp.to(DEVICE), vp.to(DEVICE), table.to(DEVICE)
    q, k, v, kc, vc = dev[:5]
    kc, vc = kc.clone(), vc.clone()
    want = _door(dev, mode, backend).forward(q, k, v, kc, vc).float()
    got = _door(dev, mode, backend, table).forward(q, k, v, kp, vp).float()
    assert not got.isnan().any()
    assert torch.equal(got, want), max_err(got, want)
    for pool, cache in ((kp, kc), (vp, vc)):  # the same bits written, through the pages
        for b, x in enumerate(lens):
            m = min(x + Lq, cap)
            assert torch.equal(gather_rows(pool, table, page, slice(b, b + 1), m), cache[b:b + 1, :m]), b
        assert pool[~referenced.to(DEVICE)].isnan().all()  # no stray write
    # against the float64 math, read through the same pages (attend: the cache as it was)
    clean = dev[:3] + [args[3].to(DEVICE).nan_to_num(), args[4].to(DEVICE).nan_to_num()] + dev[5:]
    ref = temporal_attention_naive(*clean, mode, THETA)
    base = max_err(torch_attention(*clean, mode, THETA, 64 ** -0.5), ref)
    kp0, vp0 = to_pages(args[3], table.cpu(), page, num_pages), to_pages(args[4], table.cpu(), page, num_pages)
    att = _door(dev, mode, backend, table).attend(q, k, v, kp0.to(DEVICE), vp0.to(DEVICE))
    assert max_err(att, ref) <= 2 * base + FLOOR[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_append_kv_writes_its_pages(backend):
    lens = [5, 0, 12]
    args = make_inputs(3, 3, 6, 2, 2, 64, lens, lmax=24)
    k, v, pos = args[1], args[2], args[7]
    table, num_pages = holey_table(torch.Generator().manual_seed(1), lens, 24, 4, 6)
    kc, vc = args[3].clone(), args[4].clone()
    sk.append_kv(k, v, pos, kc, vc, args[5], rope_theta=THETA, num_tokens=4, backend=backend)
    kp, vp = to_pages(args[3], table, 4, num_pages), to_pages(args[4], table, 4, num_pages)
    sk.append_kv(k, v, pos, kp, vp, args[5], rope_theta=THETA, num_tokens=4, backend=backend, block_table=table)
    for b, x in enumerate(lens):
        assert torch.equal(gather_rows(kp, table, 4, slice(b, b + 1), x + 4), kc[b:b + 1, :x + 4])
        assert torch.equal(gather_rows(vp, table, 4, slice(b, b + 1), x + 4), vc[b:b + 1, :x + 4])


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_shape_invariant_bits_do_not_depend_on_pages(backend):
    lens = [40, 3]
    args = [a.to(DEVICE) for a in make_inputs(11, 2, 4, 4, 2, 64, lens, dtype=torch.bfloat16, lmax=64)]
    q, k, v, kc, vc = args[:5]
    table, num_pages = holey_table(torch.Generator().manual_seed(2), lens, 64, 8, 4)
    kp, vp = (to_pages(t.cpu(), table, 8, num_pages).to(DEVICE) for t in (kc, vc))
    want = _door(args, MaskMode.EXACT, backend, shape_invariant=True).attend(q, k, v, kc, vc)
    got = _door(args, MaskMode.EXACT, backend, table.to(DEVICE), shape_invariant=True).attend(q, k, v, kp, vp)
    assert torch.equal(got, want)


def test_contiguous_door_reads_through_the_one_page_per_row_table():
    args = make_inputs(5, 3, 2, 2, 2, 64, [1, 2, 3], lmax=8)
    door = _door(args, MaskMode.EXACT, "torch")
    assert not door.paged and door.page_size == 8
    assert torch.equal(door.block_table, identity_table(3, "cpu")) and door.block_table.tolist() == [[0], [1], [2]]


@pytest.mark.parametrize("table, match", [
    (torch.zeros(3, 2, dtype=torch.int64), "int32"),
    (torch.zeros(2, 2, dtype=torch.int32), r"\(B=3, max_pages"),
    (torch.zeros(3, 5, dtype=torch.int32), "not 5 whole pages"),
    (torch.zeros(3, 4, dtype=torch.int32)[:, ::2], "contiguous in its last dim"),
])
def test_bad_block_table_is_named(table, match):
    args = make_inputs(5, 3, 2, 2, 2, 64, [1, 2, 3], lmax=8)
    q, k, v, kc, vc, lens, labels, pos = args
    with pytest.raises(ValueError, match="block_table") as err:
        sk.prepare_attention(lens, labels, pos, num_heads=2, num_kv_heads=2, head_dim=64, dtype=q.dtype,
                             cache_capacity=8, mask_mode="exact", rope_theta=THETA, backend="torch", block_table=table)
    assert err.match(match)
