"""Self-check of a backend against the references, on the device at hand (docs/design.md §5).

:func:`run_check` opens a backend's door (the class, a subclass of
:class:`~simsd_kernels.metadata.AttentionMetadata`) on small cases of one configuration
(:class:`~simsd_kernels.backends.OpConfig`) and compares it with the float64 reference on the same
device. The tolerance is flash-attention's, on two statistics: the backend's max and mean
absolute errors may each be at most twice those of the torch reference (SDPA) at the same dtype,
plus a dtype floor (:data:`ERR_FLOOR`, :data:`MEAN_ERR_FLOOR`). The max alone lets a systematic error hide under
bfloat16's rounding of the largest outputs (a softmax scale 1% off reaches 0.6-0.9 of it); the
mean catches it (tests/kernels/test_backend_selfcheck.py keeps a 1% scale and a 0.1% RoPE-angle
error failing in bfloat16). The backend gets caches whose unread slots hold NaN and must return
finite values of the right shape and dtype. Each case runs through the door's ``attend`` (what
:func:`simsd_kernels.temporal_attention` runs) and its ``forward`` (the write-then-attend path the
model runs: the same output bound, and exactly the new tokens' slots written, v bit-exact, k rotated
within the bound); ``append_kv`` (the ``"append_kv"`` op) must write exactly its slots. Last, the
door's ``forward`` through a page table with holes (:func:`check_paged`: the first case's rows in
reversed pages of 8 slots among pages no row references) must give the contiguous cache's bits.

Cases (:data:`CASES`, the same on every device): an empty and a short cache row (the backend's own
plan); a row of 300 keys beside an empty one under a forced 3-way split-KV plan (partials + merge;
the empty row has one active split and writes directly); and a query of 70 new tokens (> 64: two
new-key tiles) over 100 cached keys under the shape-invariant plan (the one exact verification
uses: the 64-row query tile, the largest); its labels leave a new-key tile that the first query
tile may not see (the kernels skip it) in every mask mode but ``bidirectional`` (where every token
sees every other; :func:`skipped_tiles`). A forced split count reaches backends that take one
(``plan_options``); others run their own plan.

:mod:`simsd_kernels.backends` calls it once per process and configuration;
:mod:`simsd_kernels.check` (``simsd check``) runs it over a grid and prints the table.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .mask_rule import KIND_DRAFT, KIND_KNOWN, KIND_MASK, SHARED_GRP, TAU_INF, MaskMode, dense_new_token_mask
from .paging import gather_rows
from .reference import temporal_attention_naive
from .rope import apply_rope
from .torch_backend import TorchAttention

#: max-error floor per dtype, added to 2x the max error of plain PyTorch at the same dtype
ERR_FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
#: mean-error floor per dtype, added to 2x the mean error of plain PyTorch at the same dtype (about
#: a fifth of that mean error in bfloat16: the bound stays below a 1% scale error's mean error)
MEAN_ERR_FLOOR = {torch.float32: 2e-7, torch.float16: 1e-5, torch.bfloat16: 1e-4, torch.float64: 1e-14}
THETA = 1e6
LQ, HKV = 9, 2
#: new tokens of the long case: more than one 64-key tile (and more than one 64-row query tile)
LONG_LQ = 70


@dataclass(frozen=True)
class Case:
    """One attention case of the self-check: ``cache_lens`` of the rows, the cache ``capacity``,
    ``q_len`` new tokens, ``kv_heads`` (Hq = kv_heads * the configuration's group), and the launch
    ``plans`` it runs under (keyword arguments of the door: ``shape_invariant``, and ``num_splits``
    for a backend with ``plan_options``)."""
    cache_lens: tuple
    capacity: int
    q_len: int = LQ
    kv_heads: int = HKV
    plans: tuple = ({},)


#: the cases of every configuration, on every device (a few ms on a GPU; some seconds under the
#: Triton interpreter, whose cost is per program: the split and long cases keep one kv head, and the
#: long one a single row and no merge)
CASES = (
    Case((0, 45), 48),                                               # an empty and a short row
    Case((0, 300), 320, kv_heads=1, plans=({"num_splits": 3},)),     # split-KV + merge; empty row: one split
    Case((100,), 128, LONG_LQ, kv_heads=1, plans=({"shape_invariant": True},)),  # > 64 new tokens
)


@dataclass
class CheckResult:
    """``ok``; ``max_err`` and ``tol`` (the worst case's error against float64 and its bound);
    ``detail``: what failed, or a summary."""
    ok: bool
    max_err: float
    tol: float
    detail: str


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.to(torch.float64) - b.to(torch.float64)).abs().max().item() if a.numel() else 0.0


def case_labels(mode: MaskMode, B: int, Lq: int, gen: torch.Generator):
    """``(labels (B, Lq, 3) int32, position offsets (B, Lq) int64)`` of a realistic layout:
    bidirectional random labels; block_causal blocks of 4; exact a shared prefix of 2 then
    copies of 4 tokens (positions repeat per copy; past 64 tokens the shared prefix is 4, so no
    copy straddles the 64-token tile boundary), the first copy an ancestor of every other (a
    verification tree's finished block: its ``tau`` the last group); paper ``[known | D_1..D_n | M_1..M_n]`` with tau in
    1..3 or TAU_INF and the RoPE copy (M_k at D_k's position; past 64 tokens the first 64 are known,
    a folded commit, and n = (Lq - 64) // 2). Past 64 tokens each of block_causal, exact and paper
    thus has a new-key tile that the first query tile may not see (:func:`skipped_tiles`)."""
    lab = torch.zeros(B, Lq, 3, dtype=torch.int32)
    idx = torch.arange(Lq)
    off = idx[None].repeat(B, 1)
    mode = MaskMode(mode)
    if mode == MaskMode.BIDIRECTIONAL:
        lab[..., 0] = torch.randint(0, 3, (B, Lq), generator=gen, dtype=torch.int32)
        lab[..., 1] = torch.randint(1, 4, (B, Lq), generator=gen, dtype=torch.int32)
    elif mode == MaskMode.BLOCK_CAUSAL:
        lab[..., 2] = (idx // 4).to(torch.int32)
    elif mode == MaskMode.EXACT:
        shared = min(2 if Lq <= 64 else 4, Lq)
        lab[:, :shared, 2] = SHARED_GRP
        lab[:, shared:, 2] = ((idx[shared:] - shared) // 4).to(torch.int32)
        lab[:, shared:shared + 4, 1] = (Lq - 1 - shared) // 4  # copy 0's subtree: every copy after it
        off[:, shared:] = shared + (idx[shared:] - shared) % 4
    else:
        n0, n = fill_paper_labels(lab, gen, pairs=None if Lq <= 64 else (Lq - 64) // 2)
        off[:, n0 + n:] = off[:, n0:n0 + n]
    return lab, off


def fill_paper_labels(lab: torch.Tensor, gen: torch.Generator, pairs: int | None = None) -> tuple:
    """Write the paper layout ``[known | D_1..D_n | M_1..M_n]`` into ``lab`` ((B, Lq, 3) int32,
    in place): kinds in column 0, tau in column 1 (D_k and M_k share a random tau in 1..3 or
    TAU_INF); ``n = pairs`` (default ``Lq // 2``). Returns ``(n0, n)``, the number of known slots
    and of pairs."""
    B, Lq = lab.shape[:2]
    n = Lq // 2 if pairs is None else pairs
    n0 = Lq - 2 * n
    lab[:, :n0, 0] = KIND_KNOWN
    lab[:, n0:n0 + n, 0] = KIND_DRAFT
    lab[:, n0 + n:, 0] = KIND_MASK
    tau = torch.randint(1, 5, (B, n), generator=gen, dtype=torch.int32)
    tau[tau == 4] = TAU_INF
    lab[:, n0:n0 + n, 1] = tau
    lab[:, n0 + n:, 1] = tau
    return n0, n


def attention_case(device, dtype, head_dim: int, group: int, mask_mode, cache_lens, capacity: int,
                   Lq: int = LQ, Hkv: int = HKV, seed: int = 0):
    """``(args, poisoned)``: the 8 tensor arguments of the attention op on ``device`` with zeros
    in the unread cache slots (for the references), and the same with NaN there (for the
    backend under test). Positions continue each row's cache."""
    gen = torch.Generator().manual_seed(seed)
    B, Hq = len(cache_lens), Hkv * group
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    q, k, v = rnd(B, Lq, Hq, head_dim), rnd(B, Lq, Hkv, head_dim), rnd(B, Lq, Hkv, head_dim)
    k_cache, v_cache = rnd(B, capacity, Hkv, head_dim), rnd(B, capacity, Hkv, head_dim)
    unread = torch.arange(capacity)[None, :] >= torch.tensor(cache_lens)[:, None]
    labels, off = case_labels(mode=MaskMode(int(mask_mode)), B=B, Lq=Lq, gen=gen)
    positions = torch.tensor(cache_lens, dtype=torch.int64)[:, None] + off
    seqlens = torch.tensor(cache_lens, dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    clean = [to(t) for t in (q, k, v, k_cache.masked_fill(unread[..., None, None], 0),
                             v_cache.masked_fill(unread[..., None, None], 0), seqlens, labels, positions)]
    poisoned = list(clean)
    poisoned[3] = to(k_cache.masked_fill(unread[..., None, None], float("nan")))
    poisoned[4] = to(v_cache.masked_fill(unread[..., None, None], float("nan")))
    return clean, poisoned


class Baseline(NamedTuple):
    """The torch reference's max and mean absolute errors against float64 on one case."""
    max_err: float
    mean_err: float


def mean_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.to(torch.float64) - b.to(torch.float64)).abs().mean().item() if a.numel() else 0.0


def attend_once(backend, args, mask_mode, scale, **plan):
    """``backend``'s door (a door class) opened for the 8 tensors ``args`` of one call and run
    without a cache write: ``(B, Lq, Hq, D)``, contiguous. ``plan``: ``shape_invariant``,
    ``num_splits``."""
    q, k, v, kc, vc, lens, labels, pos = args
    door = backend.open(q, k, kc, lens, labels, pos, mask_mode=mask_mode, rope_theta=THETA, softmax_scale=scale, **plan)
    return door.attend(q, k, v, kc, vc).contiguous()


def reference(clean, mask_mode, scale):
    """``(ref, baseline)``: the float64 reference of the case and the torch backend's errors
    (:class:`Baseline`)."""
    f64 = [t.to(torch.float64) if t.is_floating_point() else t for t in clean]
    ref = temporal_attention_naive(*f64, int(mask_mode), THETA, scale)
    out = attend_once(TorchAttention, clean, int(mask_mode), scale)
    return ref, Baseline(max_err(out, ref), mean_err(out, ref))


def judge(out, clean, ref, baseline: Baseline, cache_lens) -> CheckResult:
    """Shape, dtype, finiteness, ``max_err(out, ref) <= 2 * baseline.max_err + ERR_FLOOR[dtype]``
    and ``mean_err(out, ref) <= 2 * baseline.mean_err + MEAN_ERR_FLOOR[dtype]``."""
    q = clean[0]
    tol = 2 * baseline.max_err + ERR_FLOOR[q.dtype]
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
        return CheckResult(False, float("inf"), tol, f"output {tuple(out.shape)} {out.dtype}, expected "
                                                      f"{tuple(q.shape)} {q.dtype}")
    if not torch.isfinite(out).all():
        return CheckResult(False, float("nan"), tol, f"NaN/inf in the output (cache lengths {tuple(cache_lens)})")
    err, mean = max_err(out, ref), mean_err(out, ref)
    mean_tol = 2 * baseline.mean_err + MEAN_ERR_FLOOR[q.dtype]
    where = f"against float64 (torch: max {baseline.max_err:.3g}, mean {baseline.mean_err:.3g}; cache lengths " \
            f"{tuple(cache_lens)}, {q.shape[1]} new tokens)"
    if not err <= tol:
        return CheckResult(False, err, tol, f"max error {err:.3g} > tolerance {tol:.3g} {where}")
    if not mean <= mean_tol:
        return CheckResult(False, err, tol, f"mean error {mean:.3g} > tolerance {mean_tol:.3g} {where}")
    return CheckResult(True, err, tol, f"max error {err:.3g} <= {tol:.3g}, mean error {mean:.3g} <= {mean_tol:.3g}")


def skipped_tiles(labels: torch.Tensor, mask_mode, group: int, block_m: int, block_n: int = 64) -> int:
    """How many (query tile, new-key tile) pairs of ``labels (B, Lq, 3)`` no query row of the tile
    may see: the tiles the fused kernels skip (rows pack ``group`` q-heads per token, as there)."""
    vis = dense_new_token_mask(labels.cpu(), int(mask_mode))       # (B, Lq, Lq)
    rows = vis.repeat_interleave(group, dim=1)                    # (B, Lq * group, Lq)
    n = 0
    for m0 in range(0, rows.shape[1], block_m):
        for k0 in range(0, rows.shape[2], block_n):
            n += int((~rows[:, m0:m0 + block_m, k0:k0 + block_n].any(-1).any(-1)).sum())
    return n


def check_attention_case(backend, device, dtype, head_dim, group, mask_mode, case: Case,
                         seed: int = 0) -> CheckResult:
    """One attention case of ``backend`` (a door class) against float64 (and the torch backend's
    errors): under each of the case's plans (``num_splits`` only for a backend with
    ``plan_options``) the door is opened, its ``attend`` judged, then its ``forward`` on copies of
    the caches (:func:`check_forward`); the worst result, or the first failure."""
    clean, poisoned = attention_case(device, dtype, head_dim, group, mask_mode, case.cache_lens, case.capacity,
                                     Lq=case.q_len, Hkv=case.kv_heads, seed=seed)
    scale = head_dim ** -0.5
    ref, baseline = reference(clean, mask_mode, scale)
    q, k, v, kc, vc, lens, labels, pos = poisoned
    worst = None
    for plan in case.plans:
        plan = plan if backend.plan_options else {n: x for n, x in plan.items() if n != "num_splits"}
        door = backend.open(q, k, kc, lens, labels, pos, mask_mode=int(mask_mode), rope_theta=THETA,
                            softmax_scale=scale, **plan)
        res = judge(door.attend(q, k, v, kc, vc), clean, ref, baseline, case.cache_lens)
        if res.ok:
            fwd = check_forward(door, poisoned, clean, ref, baseline, case.cache_lens)
            res = fwd if not fwd.ok or fwd.max_err > res.max_err else res
        if not res.ok:
            if plan:
                res.detail += " (plan: " + ", ".join(f"{n}={x}" for n, x in plan.items()) + ")"
            return res
        worst = res if worst is None or res.max_err > worst.max_err else worst
    return worst


def check_forward(door, poisoned, clean, ref, baseline: Baseline, cache_lens) -> CheckResult:
    """The door's ``forward`` (the path the model runs) on one case, on copies of the caches: its
    output judged as the attention's, then the cache: the rotated k and v of every new token at
    ``cache_seqlens[b] + i`` below the capacity (v exact, k within 2x the torch error + the floor),
    nothing else written."""
    q, k, v, kc, vc, seqlens, labels, positions = poisoned
    kc, vc = kc.clone(), vc.clone()
    B, Lq = q.shape[:2]
    out = door.forward(q, k, v, kc, vc)
    res = judge(out, clean, ref, baseline, cache_lens)
    if not res.ok:
        res.detail = "door: " + res.detail
        return res
    cap = kc.shape[1]
    written = torch.zeros(B, cap, dtype=torch.bool)
    for b, c in enumerate(cache_lens):
        written[b, :min(c + Lq, cap)] = True
    written = written.to(kc.device)
    if not torch.equal(kc.isnan().all(-1).all(-1), ~written) or not torch.equal(vc.isnan().all(-1).all(-1), ~written):
        return CheckResult(False, float("inf"), 0.0, "door wrote other slots than cache_seqlens[b] + i (below the "
                                                     "capacity)")
    rows, cols = written.nonzero(as_tuple=True)
    new = cols >= seqlens.to(torch.int64)[rows]
    rows, cols = rows[new], cols[new]
    tok = cols - seqlens.to(torch.int64)[rows]
    if not torch.equal(vc[rows, cols], v[rows, tok]):
        return CheckResult(False, float("inf"), 0.0, "door: the cached v differs from the input")
    exact = apply_rope(k.to(torch.float64), positions, THETA)[rows, tok]
    err, base_err = max_err(kc[rows, cols], exact), max_err(apply_rope(k, positions, THETA)[rows, tok], exact)
    tol = 2 * base_err + ERR_FLOOR[q.dtype]
    if not err <= tol:
        return CheckResult(False, err, tol, f"door: cached rotated k error {err:.3g} > tolerance {tol:.3g}")
    return res


#: the paged case: :data:`CASES`' first case in pages of 8 slots (a row of 45 keys ends inside a page)
PAGE_SIZE, SPARE_PAGES = 8, 2


def check_paged(backend, device, dtype, head_dim, group, mask_mode, seed: int = 0) -> CheckResult:
    """The door's ``forward`` through a block table (:mod:`simsd_kernels.paging`) on the first case:
    the rows' pages in reverse order over a pool with pages no row references (NaN, as the unread
    slots): the output and the written K/V (read back through the table) must be the bits of the
    same door on the contiguous cache, and the unreferenced pages stay NaN."""
    case = CASES[0]
    _, poisoned = attention_case(device, dtype, head_dim, group, mask_mode, case.cache_lens, case.capacity,
                                 Lq=case.q_len, Hkv=case.kv_heads, seed=seed)
    q, k, v, kc, vc, lens, labels, pos = poisoned
    B, max_pages = kc.shape[0], case.capacity // PAGE_SIZE
    num_pages = B * max_pages + SPARE_PAGES
    table = (num_pages - 1 - torch.arange(B * max_pages, device=device)).view(B, max_pages).to(torch.int32)
    pools = []
    for cache in (kc, vc):
        pool = torch.full((num_pages, PAGE_SIZE, *cache.shape[2:]), float("nan"), dtype=dtype, device=device)
        pool[table.reshape(-1).long()] = cache.reshape(B * max_pages, PAGE_SIZE, *cache.shape[2:])
        pools.append(pool)
    kc, vc = kc.clone(), vc.clone()
    opened = dict(mask_mode=int(mask_mode), rope_theta=THETA, softmax_scale=head_dim ** -0.5)
    want = backend.open(q, k, kc, lens, labels, pos, **opened).forward(q, k, v, kc, vc)
    got = backend.open(q, k, pools[0], lens, labels, pos, block_table=table, **opened).forward(q, k, v, *pools)
    if not torch.equal(got, want):
        return CheckResult(False, max_err(got, want), 0.0, "paged door: the output differs from the contiguous "
                                                            "cache's")
    for pool, cache in zip(pools, (kc, vc)):
        logical = gather_rows(pool, table, PAGE_SIZE, slice(0, B), case.capacity)
        if not torch.equal(logical.isnan(), cache.isnan()) or not torch.equal(logical.nan_to_num(), cache.nan_to_num()):
            return CheckResult(False, float("inf"), 0.0, "paged door: the K/V written through the table differ")
        if not pool[:SPARE_PAGES].isnan().all():
            return CheckResult(False, float("inf"), 0.0, "paged door wrote a page no row references")
    return CheckResult(True, 0.0, 0.0, "paged door: the contiguous bits")


def check_append_kv(backend, device, dtype, head_dim, seed: int = 0) -> CheckResult:
    """The door's ``append_kv`` (:meth:`~simsd_kernels.metadata.AttentionMetadata.open_write`) of 7
    of 9 tokens into rows of lengths 0, 5 and 41 (capacity 48: the last row fills it): v exact, k
    within 2x the torch error + the floor, nothing else written."""
    gen = torch.Generator().manual_seed(seed)
    lens, L, n, cap = (0, 5, 41), 9, 7, 48
    B = len(lens)
    k = torch.randn(B, L, HKV, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(B, L, HKV, head_dim, generator=gen).to(dtype).to(device)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    positions = (torch.tensor(lens)[:, None] + torch.arange(L)[None] + 3).to(device)
    nan = torch.full((B, cap, HKV, head_dim), float("nan"), dtype=dtype, device=device)
    kc, vc = nan.clone(), nan.clone()
    backend.open_write(k, kc, seqlens, positions, rope_theta=THETA).append_kv(k, v, kc, vc, n)
    written = torch.zeros(B, cap, dtype=torch.bool)
    for b, c in enumerate(lens):
        written[b, c:min(c + n, cap)] = True
    written = written.to(device)
    if not torch.equal(kc.isnan().all(-1).all(-1), ~written) or not torch.equal(vc.isnan().all(-1).all(-1), ~written):
        return CheckResult(False, float("inf"), 0.0, "append_kv wrote other slots than cache_seqlens[b] + i "
                                                     "(i < num_tokens, below the capacity)")
    exact = apply_rope(k.to(torch.float64), positions, THETA)
    torch_k = apply_rope(k, positions, THETA)
    rows, cols = written.nonzero(as_tuple=True)
    tok = cols - seqlens.to(torch.int64)[rows]
    got_k, got_v = kc[rows, cols], vc[rows, cols]
    if not torch.equal(got_v, v[rows, tok]):
        return CheckResult(False, float("inf"), 0.0, "append_kv: v differs from the input")
    err, base_err = max_err(got_k, exact[rows, tok]), max_err(torch_k[rows, tok], exact[rows, tok])
    tol = 2 * base_err + ERR_FLOOR[dtype]
    if not err <= tol:
        return CheckResult(False, err, tol, f"append_kv: rotated k error {err:.3g} > tolerance {tol:.3g}")
    return CheckResult(True, err, tol, f"append_kv: max error {err:.3g} <= {tol:.3g}")


def run_check(backend, device, config) -> CheckResult:
    """Check ``backend`` (a door class) for ``config`` on ``device`` (every case); an exception is a
    failure.

    Runs under ``torch.no_grad`` with ``device`` as the current CUDA device."""
    device = torch.device(device)
    guard = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
    try:
        with torch.no_grad(), guard:
            if config.op == "append_kv":
                return check_append_kv(backend, device, config.dtype, config.head_dim)
            worst = None
            for case in CASES:
                res = check_attention_case(backend, device, config.dtype, config.head_dim, config.group,
                                           config.mask_mode, case)
                if not res.ok:
                    return res
                worst = res if worst is None or res.max_err > worst.max_err else worst
            paged = check_paged(backend, device, config.dtype, config.head_dim, config.group, config.mask_mode)
            return worst if paged.ok else paged
    except Exception as exc:  # a kernel that raises is a kernel that failed its check
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return CheckResult(False, float("nan"), float("nan"), f"{type(exc).__name__}: {msg}"[:300])

