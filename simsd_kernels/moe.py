"""The expert computation of a mixture-of-experts layer (Qwen3-MoE / SDAR-MoE): every token's
top-k experts, each a SwiGLU MLP, and their weighted sum.

``fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)`` computes, for every token ``t``::

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

with ``gate_e`` the first ``I`` rows of ``w_gate_up[e]``, ``up_e`` the last ``I`` (transformers'
``Qwen3MoeExperts`` layout). Numerics of the torch path (the reference and the CPU path): the
expert products in the dtype of ``x``; the weighted sum in float32 (float64 for float64 inputs),
slot ``j = 0`` first, then one cast to the dtype of ``x``. A token's result depends only on its
own row and the rows that share its experts in the call (the matrix products' rounding may
depend on the number of rows); the model's shape-invariant mode runs each unit of tokens in its
own call (:func:`simsd.models.model.per_unit`).

Backends (the attention ops' rules, :mod:`simsd_kernels.backends`): ``torch`` (the reference and
the CPU path: one grouped product per expert that holds any pair), ``triton`` (the fused kernels
of :mod:`triton_ops.fused_moe`: sort by expert, grouped GEMMs, combine; CUDA, or the CPU under
``TRITON_INTERPRET=1``), ``auto`` (``triton`` on a CUDA device once it passed its self-check
there, else ``torch``; the interpreter is never chosen automatically). Self-check
(:func:`check_fused_moe`): the first time a backend would run a dtype on a device, it runs four
small cases against float64 on that device (:data:`CHECK_CASES`: every tile height the kernels
use); its max error may be at most 1.5x the torch path's at the same dtype, its mean error 1.25x,
plus the attention check's floors (the kernels round less than the torch path, SiLU-and-mul in
fp32: measured under the interpreter their errors are 0.5-0.8x the torch path's; a 1% scale error
in bfloat16 reaches about 2x in the mean). A failure makes ``auto`` warn once and use ``torch``,
and an explicit ``triton`` raise; ``SIMSD_TRUST_BACKENDS=1`` skips the check.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .backends import BackendCheckError, BackendCheckWarning, trusted
from .selfcheck import ERR_FLOOR, MEAN_ERR_FLOOR, CheckResult

MOE_BACKENDS = ("auto", "triton", "torch")
MOE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the self-check's cases: (tokens, hidden, expert width, experts, top-k), one or more per tile
#: height the kernels choose (``triton_ops.ops.moe_block_m``: 16, 16, 32, 64 rows; 32 and 64 are the
#: prefill and batched-decode tiles, 64 the only wgmma one). In every case expert 0 takes more pairs
#: than a tile (two tiles), the last expert none, and the 32- and 64-row tiles hold pairs past row 16
#: and 32; hidden sizes and widths are not multiples of the kernels' 64 / 32 blocks
CHECK_CASES = ((37, 96, 80, 8, 3), (70, 128, 64, 16, 2), (64, 80, 48, 6, 2), (100, 96, 40, 4, 2))
#: the bounds: max and mean error at most these multiples of the torch path's, plus the floors
MAX_ERR_FACTOR, MEAN_ERR_FACTOR = 1.5, 1.25
_VERDICTS: dict = {}  # (device, dtype) -> CheckResult
_WARNED: set = set()
_RESOLVED: dict = {}  # (requested, device, dtype, trusted) -> ("triton" | "torch", why) (a lookup per call)


def check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids) -> None:
    """Raise ``ValueError`` naming the tensor whose shape, dtype or device does not fit."""
    if x.dim() != 2:
        raise ValueError(f"fused_moe: x must be (T, H), got shape {tuple(x.shape)}")
    T, H = x.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != H or w_gate_up.shape[1] % 2:
        raise ValueError(f"fused_moe: w_gate_up must be (E, 2I, H={H}), got shape {tuple(w_gate_up.shape)}")
    E, I2 = w_gate_up.shape[:2]
    if tuple(w_down.shape) != (E, H, I2 // 2):
        raise ValueError(f"fused_moe: w_down must be (E={E}, H={H}, I={I2 // 2}), got shape {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"fused_moe: topk_ids and topk_weights must both be (T={T}, k), got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"fused_moe: weights ({w_gate_up.dtype}, {w_down.dtype}) must have the dtype of x ({x.dtype})")
    devices = {t.device for t in (x, w_gate_up, w_down, topk_weights, topk_ids)}
    if len(devices) > 1:
        raise ValueError(f"fused_moe: tensors on several devices: {sorted(map(str, devices))}")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise (the weighted sum)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """The torch path of :func:`fused_moe` (module doc): the (token, slot) pairs sorted by expert,
    one SwiGLU per expert that holds any, the weighted sum over the slots; ``(T, H)`` in x's dtype."""
    T, H = x.shape
    K = topk_ids.shape[1]
    I = w_down.shape[2]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    y = x.new_empty(T * K, H)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        gate, up = F.linear(x[slots // K], w_gate_up[e]).split(I, dim=-1)
        y[slots] = F.linear(F.silu(gate) * up, w_down[e])
    acc = accumulation_dtype(x.dtype)
    y = y.view(T, K, H).to(acc)
    w = topk_weights.to(acc)
    out = y[:, 0] * w[:, :1]
    for j in range(1, K):
        out = out + y[:, j] * w[:, j:j + 1]
    return out.to(x.dtype)


def triton_availability(device) -> tuple:
    """``(ok, reason)`` of the Triton kernels on ``device`` (the attention backend's rule)."""
    try:
        from .triton_backend import TritonAttention
    except ImportError as exc:
        return False, f"triton does not import: {exc}"
    return TritonAttention.is_available(device)


def fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    from triton_ops.ops import fused_moe_fwd

    from .triton_backend import device_guard
    with device_guard(x.device):
        return fused_moe_fwd(x, w_gate_up, w_down, topk_weights, topk_ids)


def _case(device, dtype, T, H, I, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) * H ** -0.5
    w_down = torch.randn(E, H, I, generator=g, dtype=torch.float64) * I ** -0.5
    logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 2
    logits[: T // 2, 0] += 8  # expert 0 takes half the tokens: more pairs than one tile
    logits[:, -1] -= 1e3      # the last expert takes none
    weights, ids = torch.topk(torch.softmax(logits, -1).float(), K)
    to = dict(device=device)
    return [t.to(**to) for t in (x, w_gate_up, w_down)], weights.to(**to), ids.to(**to)


def check_fused_moe(run, device, dtype) -> CheckResult:
    """``run(x, w_gate_up, w_down, topk_weights, topk_ids)`` against float64 on ``device`` over
    :data:`CHECK_CASES` (module doc); an exception, a NaN or a wrong shape or dtype fails."""
    device = torch.device(device)
    worst = CheckResult(True, 0.0, 0.0, "")
    try:
        with torch.no_grad():
            for n, (T, H, I, E, K) in enumerate(CHECK_CASES):
                (x, wgu, wd), w, ids = _case(device, dtype, T, H, I, E, K, seed=n)
                ref = fused_moe_torch(x, wgu, wd, w, ids)
                args = (x.to(dtype), wgu.to(dtype), wd.to(dtype), w, ids)
                out = run(*args)
                if out.shape != ref.shape or out.dtype != dtype or not torch.isfinite(out).all():
                    return CheckResult(False, float("nan"), float("nan"), f"case {n}: shape {tuple(out.shape)}, "
                                       f"dtype {out.dtype} or non-finite values")
                base = (fused_moe_torch(*args).double() - ref).abs()
                err = (out.double() - ref).abs()
                tol = MAX_ERR_FACTOR * base.max().item() + ERR_FLOOR[dtype]
                mean_tol = MEAN_ERR_FACTOR * base.mean().item() + MEAN_ERR_FLOOR[dtype]
                res = CheckResult(err.max().item() <= tol and err.mean().item() <= mean_tol, err.max().item(), tol,
                                  f"case {n} (T={T} H={H} I={I} E={E} k={K}): max error {err.max().item():.3g} "
                                  f"(tol {tol:.3g}), mean {err.mean().item():.3g} (tol {mean_tol:.3g})")
                if not res.ok:
                    return res
                worst = res if res.max_err >= worst.max_err else worst
    except Exception as exc:  # a kernel that raises is a kernel that failed its check
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return CheckResult(False, float("nan"), float("nan"), f"{type(exc).__name__}: {msg}"[:300])
    return worst


def moe_verdict(device, dtype) -> CheckResult:
    """The Triton kernels' self-check for ``dtype`` on ``device`` (run once per process)."""
    if trusted():
        return CheckResult(True, 0.0, 0.0, "not checked")
    key = (torch.device(device), dtype)
    if key not in _VERDICTS:
        if key[0].type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"simsd: the fused MoE kernels have not been checked for {dtype} on {device}; run "
                               f"the op once before capturing a CUDA graph")
        _VERDICTS[key] = check_fused_moe(fused_moe_triton, key[0], dtype)
    return _VERDICTS[key]


def resolve_moe_backend(requested: str, device, dtype) -> str:
    """``"triton"`` or ``"torch"`` for ``requested`` (``auto | triton | torch``) on ``device``.

    Raises:
        ValueError: an unknown name; ``triton`` unavailable on the device or for the dtype.
        BackendCheckError: ``triton`` failed its self-check.
    """
    return moe_backend_choice(requested, device, dtype)[0]


def moe_backend_choice(requested: str, device, dtype) -> tuple:
    """``(name, why)``: what :func:`resolve_moe_backend` chooses, and why it is ``torch`` (empty for
    ``triton``): ``"the 'torch' backend was requested"``, or why ``auto`` did not use ``triton`` (the
    device type, Triton's availability, the dtype, the self-check's failure). Raises as
    :func:`resolve_moe_backend`; cached per ``(requested, device, dtype, trusted)``."""
    key = (requested, device, dtype, trusted())
    hit = _RESOLVED.get(key)
    if hit is None:
        hit = _RESOLVED[key] = _resolve(requested, torch.device(device), dtype)
    return hit


def _resolve(requested: str, device: torch.device, dtype) -> tuple:
    if requested not in MOE_BACKENDS:
        raise ValueError(f"fused_moe: backend must be one of {MOE_BACKENDS}, got {requested!r}")
    if requested == "torch":
        return "torch", "the 'torch' backend was requested"
    if requested == "auto" and device.type != "cuda":
        return "torch", f"auto uses triton on CUDA devices only, not on {device}"
    ok, why = triton_availability(device)
    if ok and dtype not in MOE_DTYPES:
        ok, why = False, f"dtype {dtype} is not one of {MOE_DTYPES}"
    if ok:
        res = moe_verdict(device, dtype)
        ok, why = res.ok, res.detail
        if not ok and requested == "triton":
            raise BackendCheckError(f"fused MoE backend 'triton' failed its self-check on {device} for {dtype}: {why} "
                                    f"(SIMSD_TRUST_BACKENDS=1 skips the check)")
        why = "" if ok else f"triton failed its self-check: {why}"
    if ok:
        return "triton", ""
    if requested == "triton":
        raise ValueError(f"fused MoE backend 'triton' cannot run on {device}: {why}")
    if (device, dtype) not in _WARNED:
        _WARNED.add((device, dtype))
        warnings.warn(f"simsd: fused MoE backend 'triton' is not used on {device} for {dtype}: {why}; using torch",
                      BackendCheckWarning, stacklevel=4)
    return "torch", why


def fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, *, backend: str = "auto") -> torch.Tensor:
    """Weighted top-k SwiGLU experts (module doc).

    Args:
        x: ``(T, H)`` float16 / bfloat16 / float32 / float64 hidden states.
        w_gate_up: ``(E, 2I, H)`` gate rows then up rows of every expert, x's dtype.
        w_down: ``(E, H, I)`` x's dtype.
        topk_weights: ``(T, k)`` routing weights (any float dtype; float32 in the model).
        topk_ids: ``(T, k)`` int32 / int64 expert ids in ``[0, E)``.
        backend: ``auto | triton | torch`` (module doc).

    Returns:
        ``(T, H)`` in x's dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit (named), an unknown backend, an
            explicit ``triton`` that cannot run here.
        BackendCheckError: an explicit ``triton`` that failed its self-check.
    """
    check_moe_args(x, w_gate_up, w_down, topk_weights, topk_ids)
    if resolve_moe_backend(backend, x.device, x.dtype) == "triton":
        return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids)
    return fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids)
