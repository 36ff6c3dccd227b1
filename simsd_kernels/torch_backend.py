"""The ``torch`` backend, the reference: SDPA over exactly the keys each query token sees.

:class:`TorchAttention` is the backend (any float dtype, float64 included, any even head_dim,
available everywhere; ``auto``'s last resort, never checked: it is what the others are checked
against). Its door is built once per forward (:func:`simsd_kernels.prepare_attention`): it
reads the cache lengths on the host (the forward's one host read: this backend is not CUDA-graph
safe), computes the RoPE tables for the forward's positions, the cache slots the new tokens are
written to, and which SDPA calls the mask mode needs. Every layer then calls it once: q and k are
rotated (:func:`simsd_kernels.rope.rotate`), the rotated k and v written to the cache (when
asked), and the calls run:

* ``bidirectional``: one call per run of consecutive rows with the same cache length, over the
  cache slots ``[0, n + Lq)`` (the new keys just written behind the cache), without a mask;
* ``exact`` and ``block_causal``: per row, one call per group of query tokens that see the same
  keys (an exact-mode copy, the shared prefix, a prefill block), over exactly those keys: the
  row's cache prefix then its visible new tokens in order -- read back from the cache when they
  are the first new tokens (a block-causal block, the first copy), else concatenated. A token's
  output thus depends only on its group's tokens and the keys it sees, never on the other tokens
  of the forward, its batch neighbours or padding: an exact-mode copy gets the bits of a denoise
  forward of that state, in every dtype (docs/design.md §4.2; a dense mask over all new tokens,
  or keys padded to a common length, would change SDPA's blocking and hence the rounding);
* ``paper`` (no such promise): one masked call per run of rows with the same cache length, the
  boolean mask built here once for all layers.

The plan's host reads (cache lengths, labels) are made once per forward, outside any
``TorchFunctionMode`` (:class:`simsd.engine.host_sync.HostReads` counts the decoding loop's
reads). Rows without ``Lq`` free slots past their length get their keys gathered (the write skips the
slots past the capacity, as the kernels do). GQA through SDPA's ``enable_gqa`` (the same bits as
repeating the kv heads, without the copies). A token that sees no key gets zeros.

The cache is read and written through the door's block table (:mod:`simsd_kernels.paging`): the
write scatters each new token to ``(block_table[b, s // page_size], s % page_size)``; the reads
take a row's slots ``[0, n)`` in place when every row holds its slots in one page and a run's
rows sit in consecutive pages (the contiguous cache: no copy, as before paging; the pages read
with the lengths, in the forward's one host read), else gathered the same way into a fresh
tensor. Paged and contiguous caches give the same bits (tests/kernels/test_paged_door.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .mask_rule import MaskMode, dense_new_token_mask
from .metadata import AttentionMetadata
from .paging import gather_rows, page_slots
from .rope import rope_tables, rotate


def _span(idx: list):
    """``slice(a, b)`` when ``idx`` is the consecutive run ``a..b-1``, else None."""
    return slice(idx[0], idx[-1] + 1) if idx and idx[-1] - idx[0] + 1 == len(idx) else None


class _Group:
    """One SDPA call of one row: query tokens ``pick`` (a slice or an index tensor) see the cache
    prefix and the new tokens ``cols`` (a slice, an index tensor or None); ``prefix``: the number
    of new tokens when ``cols`` are the first ones (the keys are then a cache view once written)."""
    __slots__ = ("row", "pick", "cols", "prefix")

    def __init__(self, row, pick, cols, prefix):
        self.row, self.pick, self.cols, self.prefix = row, pick, cols, prefix


class TorchAttention(AttentionMetadata):
    """The torch backend (:class:`~simsd_kernels.metadata.AttentionMetadata`), and its door for one
    forward: planned at construction, then :meth:`forward` per layer (shapes as
    :func:`simsd_kernels.temporal_attention`). ``num_splits`` is ignored (no split plan)."""

    name = "torch"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The plan is the backend's own work, made outside any TorchFunctionMode, as it was when
        # this backend ran inside a custom op: simsd.engine.host_sync.HostReads counts the
        # decoding loop's reads, not this backend's one read per forward (the fused backends
        # read nothing on the host).
        with torch._C.DisableTorchFunction():
            self._plan(self.cache_seqlens, self.labels, self.positions, self.mask_mode, self.rope_theta,
                       self.softmax_scale, self.head_dim, self.dtype, self.cache_capacity, self.group)

    def _plan(self, cache_seqlens, labels, positions, mask_mode, rope_theta, softmax_scale, head_dim, dtype,
              capacity, group) -> None:
        B, Lq = labels.shape[:2]
        device = labels.device
        self.mode, self.scale, self.gqa = MaskMode(mask_mode), float(softmax_scale), group > 1
        self.cos, self.sin = rope_tables(positions, head_dim, rope_theta, dtype)
        one_page = self.block_table.shape[1] == 1  # each row's slots in one page: read in place
        if one_page:  # the forward's host read: the lengths and each row's page
            host = torch.cat([cache_seqlens.to(torch.int64), self.block_table[:, 0].to(torch.int64)]).tolist()
            lengths, pages = host[:B], host[B:]
        else:  # the forward's host read
            lengths, pages = cache_seqlens.tolist(), None
        self.pages = pages
        self.lengths, self.Lq = lengths, Lq
        self.room = [n + Lq <= capacity for n in lengths]
        slots = cache_seqlens.to(torch.int64)[:, None] + torch.arange(Lq, device=device)
        self.all_slots = slots
        if all(self.room):
            self.keep, self.where = None, page_slots(self.block_table, slots, self.page_size)
        else:  # rows near the capacity write only the slots that exist
            keep = (slots < capacity).nonzero(as_tuple=True)
            self.keep, self.where = keep, page_slots(self.block_table, slots[keep], self.page_size, keep[0])
        self.runs, self.groups, self.masks = [], [], []
        if self.mode in (MaskMode.BIDIRECTIONAL, MaskMode.PAPER):
            a = 0
            for b in range(1, B + 1):
                if b == B or lengths[b] != lengths[a]:
                    self.runs.append((a, b))
                    a = b
            if self.mode == MaskMode.PAPER:
                self.masks = [self._paper_mask(labels[a:b], lengths[a]) for a, b in self.runs]
        else:
            visible = dense_new_token_mask(labels, self.mode).cpu().tolist()
            for b in range(B):
                self._plan_row(b, visible[b], device)
        self.empty = self.mode == MaskMode.PAPER and any(bool((~m.any(-1)).any()) for m in self.masks)

    def _paper_mask(self, labels, n: int):
        new = dense_new_token_mask(labels, self.mode)
        cache = torch.ones(new.shape[0], new.shape[1], n, dtype=torch.bool, device=new.device)
        return torch.cat([cache, new], -1)[:, None]

    def _plan_row(self, b: int, visible: list, device) -> None:
        by_keys: dict = {}
        for i, row in enumerate(visible):
            by_keys.setdefault(tuple(row), []).append(i)
        for row, members in by_keys.items():
            cols = [j for j, seen in enumerate(row) if seen]
            if self.lengths[b] == 0 and not cols:
                continue  # sees nothing: zeros
            pick = _span(members) or torch.tensor(members, device=device)
            prefix = len(cols) if cols == list(range(len(cols))) else None
            take = None if not cols else (_span(cols) or torch.tensor(cols, device=device))
            self.groups.append(_Group(b, pick, take, prefix))

    def forward(self, q, k, v, k_cache, v_cache, write: bool = True):
        """:meth:`AttentionMetadata.forward <simsd_kernels.metadata.AttentionMetadata.forward>`;
        ``write`` False: without the cache write (:meth:`attend`)."""
        self._check(q, k, v, k_cache, v_cache)
        Hq, D = q.shape[2], q.shape[3]
        Hkv = k.shape[2]
        if q.stride() == k.stride() and q.stride(2) == D and q.stride(1) >= (Hq + Hkv) * D and \
                k.data_ptr() == q.data_ptr() + Hq * D * q.element_size():
            # q and k are adjacent heads of one tensor (the model's merged projection): one rotation
            qk = q.as_strided((*q.shape[:2], Hq + Hkv, D), q.stride())
            qr, kr = rotate(qk, self.cos, self.sin).split([Hq, Hkv], 2)
        else:
            qr, kr = rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin)
        if write:
            self._write(kr, v, k_cache, v_cache)
        if self.groups:
            return self._grouped(qr, kr, v, k_cache, v_cache, write)
        return self._runs(qr, kr, v, k_cache, v_cache, write)

    def attend(self, q, k, v, k_cache, v_cache):
        return self.forward(q, k, v, k_cache, v_cache, False)

    def append_kv(self, k, v, k_cache, v_cache, num_tokens=None) -> None:
        n = self._check_write(k, v, k_cache, v_cache, num_tokens)
        if n == self.Lq:
            self._write(rotate(k, self.cos, self.sin), v, k_cache, v_cache)
        elif n:
            self._write(rotate(k[:, :n], self.cos[:, :n], self.sin[:, :n]), v[:, :n], k_cache, v_cache, n)

    def _write(self, kr, v, k_cache, v_cache, n=None) -> None:
        """The rotated ``kr`` and ``v`` of the first ``n`` new tokens (default all) scattered to
        their slots' pages (:func:`simsd_kernels.paging.page_slots`)."""
        if n is not None:  # a part of the tokens: the slots below the capacity
            keep = (self.all_slots[:, :n] < self.cache_capacity).nonzero(as_tuple=True)
            where = page_slots(self.block_table, self.all_slots[keep], self.page_size, keep[0])
            k_cache.index_put_(where, kr[keep])
            v_cache.index_put_(where, v[keep])
        elif self.keep is None:
            k_cache.index_put_(self.where, kr)
            v_cache.index_put_(self.where, v)
        else:
            k_cache.index_put_(self.where, kr[self.keep])
            v_cache.index_put_(self.where, v[self.keep])

    def _keys(self, cache, rows: slice, n: int):
        """Slots ``[0, n)`` of ``rows`` (``(rows, n, Hkv, D)``): a view of the pool when each row
        holds them in one page and the rows' pages are consecutive (a contiguous cache), else
        gathered through the block table."""
        if self.pages is not None:
            first = self.pages[rows.start]
            if self.pages[rows] == list(range(first, first + rows.stop - rows.start)):
                return cache[first:first + rows.stop - rows.start, :n]
        return gather_rows(cache, self.block_table, self.page_size, rows, n)

    def _sdpa(self, q, k, v, mask=None):
        """``q (b, m, Hq, D)`` over ``k, v (b, S, Hkv, D)`` -> ``(b, m, Hq, D)`` (a transposed view)."""
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           scale=self.scale, enable_gqa=self.gqa)
        return o.transpose(1, 2)

    def _runs(self, qr, kr, v, k_cache, v_cache, write: bool):
        outs = []
        for i, (a, b) in enumerate(self.runs):
            n = self.lengths[a]
            r = slice(a, b)
            if write and self.room[a]:
                keys, vals = self._keys(k_cache, r, n + self.Lq), self._keys(v_cache, r, n + self.Lq)
            else:
                keys = torch.cat([self._keys(k_cache, r, n), kr[r]], 1)
                vals = torch.cat([self._keys(v_cache, r, n), v[r]], 1)
            outs.append(self._sdpa(qr[a:b], keys, vals, self.masks[i] if self.masks else None))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        if self.empty:  # SDPA gives NaN where a query sees nothing; the op's answer is zeros
            seen = torch.cat([m.any(-1) for m in self.masks], 0).transpose(1, 2)[..., None]
            out = torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out

    def _grouped(self, qr, kr, v, k_cache, v_cache, write: bool):
        out = torch.zeros_like(qr)
        for g in self.groups:
            b, n = g.row, self.lengths[g.row]
            r = slice(b, b + 1)
            if g.cols is None:  # only the cache
                keys, vals = self._keys(k_cache, r, n), self._keys(v_cache, r, n)
            elif g.prefix is not None and write and self.room[b]:
                keys, vals = self._keys(k_cache, r, n + g.prefix), self._keys(v_cache, r, n + g.prefix)
            elif isinstance(g.cols, slice):
                keys = torch.cat([self._keys(k_cache, r, n), kr[r, g.cols]], 1)
                vals = torch.cat([self._keys(v_cache, r, n), v[r, g.cols]], 1)
            else:
                keys = torch.cat([self._keys(k_cache, r, n), kr[r].index_select(1, g.cols)], 1)
                vals = torch.cat([self._keys(v_cache, r, n), v[r].index_select(1, g.cols)], 1)
            if isinstance(g.pick, slice):
                out[r, g.pick] = self._sdpa(qr[r, g.pick], keys, vals)
            else:
                out[r].index_copy_(1, g.pick, self._sdpa(qr[r].index_select(1, g.pick), keys, vals))
        return out

