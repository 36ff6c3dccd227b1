"""Self-check of a backend against the references, on the device at hand (docs/design.md §5).

:func:`run_check` runs small cases of one configuration (:class:`~simsd_kernels.backends.OpConfig`)
through a backend and compares them with the float64 reference on the same device; the
tolerance is flash-attention's: the backend's max error may be at most twice the error of the
torch reference (SDPA) at the same dtype, plus a dtype floor (:data:`ERR_FLOOR`, as the kernel
tests use). The backend gets caches whose unread slots hold NaN and must return finite values
of the right shape and dtype; ``append_kv`` must write exactly its slots (v bit-exact).

:mod:`simsd_kernels.backends` calls it once per process and configuration;
:mod:`simsd_kernels.check` (``simsd check``) runs it over a grid and prints the table.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .mask_rule import KIND_DRAFT, KIND_KNOWN, KIND_MASK, SHARED_GRP, TAU_INF, MaskMode
from .reference import temporal_attention_naive, temporal_attention_torch
from .rope import apply_rope

#: error floor per dtype, added to 2x the error of plain PyTorch at the same dtype
ERR_FLOOR = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
THETA = 1e6
#: cache cases ``(cache lengths of the rows, capacity)``: an empty and a short row; a long row
#: whose cache a GPU splits (split-KV needs >= 256 keys per split) beside a short one
CASES_GPU = (((0, 45), 48), ((3, 611), 640))
CASES_CPU = (((0, 45), 48),)  # the kernels never split on the CPU
LQ, HKV = 9, 2


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
    copies of 4 tokens (positions repeat per copy); paper ``[known | D_1..D_n | M_1..M_n]`` with
    tau in 1..3 or TAU_INF and the RoPE copy (M_k at D_k's position)."""
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
        shared = min(2, Lq)
        lab[:, :shared, 2] = SHARED_GRP
        lab[:, shared:, 2] = ((idx[shared:] - shared) // 4).to(torch.int32)
        off[:, shared:] = shared + (idx[shared:] - shared) % 4
    else:
        n0, n = fill_paper_labels(lab, gen)
        off[:, n0 + n:] = off[:, n0:n0 + n]
    return lab, off


def fill_paper_labels(lab: torch.Tensor, gen: torch.Generator) -> tuple:
    """Write the paper layout ``[known | D_1..D_n | M_1..M_n]`` into ``lab`` ((B, Lq, 3) int32,
    in place): kinds in column 0, tau in column 1 (D_k and M_k share a random tau in 1..3 or
    TAU_INF); ``n = Lq // 2``. Returns ``(n0, n)``, the number of known slots and of pairs."""
    B, Lq = lab.shape[:2]
    n = Lq // 2
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


def reference(clean, mask_mode, scale):
    """``(ref, torch_err)``: the float64 reference of the case and the torch backend's error."""
    f64 = [t.to(torch.float64) if t.is_floating_point() else t for t in clean]
    ref = temporal_attention_naive(*f64, int(mask_mode), THETA, scale)
    return ref, max_err(temporal_attention_torch(*clean, int(mask_mode), THETA, scale), ref)


def judge(out, clean, ref, torch_err, cache_lens) -> CheckResult:
    """Shape, dtype, finiteness and ``max_err(out, ref) <= 2 * torch_err + ERR_FLOOR[dtype]``."""
    q = clean[0]
    tol = 2 * torch_err + ERR_FLOOR[q.dtype]
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
        return CheckResult(False, float("inf"), tol, f"output {tuple(out.shape)} {out.dtype}, expected "
                                                      f"{tuple(q.shape)} {q.dtype}")
    if not torch.isfinite(out).all():
        return CheckResult(False, float("nan"), tol, f"NaN/inf in the output (cache lengths {tuple(cache_lens)})")
    err = max_err(out, ref)
    if not err <= tol:
        return CheckResult(False, err, tol, f"max error {err:.3g} > tolerance {tol:.3g} against float64 "
                                            f"(torch error {torch_err:.3g}, cache lengths {tuple(cache_lens)})")
    return CheckResult(True, err, tol, f"max error {err:.3g} <= {tol:.3g}")


def check_attention_case(backend, device, dtype, head_dim, group, mask_mode, cache_lens, capacity,
                         seed: int = 0) -> CheckResult:
    """One attention case of ``backend`` against float64 (and the torch backend's error)."""
    clean, poisoned = attention_case(device, dtype, head_dim, group, mask_mode, cache_lens, capacity, seed=seed)
    scale = head_dim ** -0.5
    ref, torch_err = reference(clean, mask_mode, scale)
    out = backend.attention(*poisoned, int(mask_mode), THETA, scale)
    return judge(out, clean, ref, torch_err, cache_lens)


def check_append_kv(backend, device, dtype, head_dim, seed: int = 0) -> CheckResult:
    """``append_kv`` of 7 of 9 tokens into rows of lengths 0, 5 and 41 (capacity 48: the last
    row fills it): v exact, k within 2x the torch error + the floor, nothing else written."""
    gen = torch.Generator().manual_seed(seed)
    lens, L, n, cap = (0, 5, 41), 9, 7, 48
    B = len(lens)
    k = torch.randn(B, L, HKV, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(B, L, HKV, head_dim, generator=gen).to(dtype).to(device)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    positions = (torch.tensor(lens)[:, None] + torch.arange(L)[None] + 3).to(device)
    nan = torch.full((B, cap, HKV, head_dim), float("nan"), dtype=dtype, device=device)
    kc, vc = nan.clone(), nan.clone()
    backend.append_kv(k, v, positions, kc, vc, seqlens, THETA, n)
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
    """Check ``backend`` for ``config`` on ``device`` (every case); an exception is a failure.

    Runs under ``torch.no_grad`` with ``device`` as the current CUDA device."""
    device = torch.device(device)
    guard = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
    try:
        with torch.no_grad(), guard:
            if config.op == "append_kv":
                return check_append_kv(backend, device, config.dtype, config.head_dim)
            worst = None
            for lens, cap in (CASES_GPU if device.type == "cuda" else CASES_CPU):
                res = check_attention_case(backend, device, config.dtype, config.head_dim, config.group,
                                           config.mask_mode, lens, cap)
                if not res.ok:
                    return res
                worst = res if worst is None or res.max_err > worst.max_err else worst
            return worst
    except Exception as exc:  # a kernel that raises is a kernel that failed its check
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return CheckResult(False, float("nan"), float("nan"), f"{type(exc).__name__}: {msg}"[:300])

