"""``simsd check`` / ``python -m simsd_kernels.check``: is every attention backend right here?

Every available backend (and ``auto``) runs a set of configurations on the present device --
dtype x head_dim (64, 128 and 96, which the fused kernels do not support: an explicit backend
must refuse it with a ``ValueError``, ``auto`` must fall back to one that runs it) x mask mode x
cache (``empty``: lengths 0/0; ``short``: 37/5; ``split``: 700/300 in a 768-slot cache, past one
split-KV chunk on a GPU; ``long``: 100/3 with 70 new tokens, a 64-row query tile (under the
shape-invariant plan where the backend has one), the new keys spanning two 64-key tiles) x GQA
group (1, 4) -- on a small case (2 rows, 9 new tokens unless the cache says otherwise, 2 kv heads,
unread cache slots holding NaN) against the float64 reference on the same device. The groups and
caches together run each query tile height (16, 32 and 64 rows) of the CUDA kernel for every
dtype and head dim, and each of the Triton kernel's but its 32-row tile at head dim 64 (planned
only past 4k cache slots at batch 4 and more): a tile that cannot launch (the CUDA kernel's 64-row
tile at head dim 64 once could not, bench/results/device_h200) fails its rows. On
the CPU the Triton kernels run under the interpreter (``TRITON_INTERPRET=1`` is set when Triton
has not been imported yet).

Which configurations: by default the quick set :data:`QUICK` (every value of every axis at
least once per backend; seconds on a CPU); ``--full``, or any of the axis options
(``--dtypes``, ``--head-dims``, ``--mask-modes``, ``--caches``, ``--groups``; each defaults to
all its values), the product of the axes' values (the full matrix: 216 rows per backend, tens of
minutes for the Triton interpreter on a CPU, about a minute on a GPU with ``--jobs 8``).

Rows are printed as they finish (``--jobs N``: in the order they finish), then a per-backend
summary and the failures. Columns: ``status`` (``pass``; ``FAIL``: max error above ``tol`` = 2x
the torch backend's error + a dtype floor (:mod:`simsd_kernels.selfcheck`), NaN, a wrong shape
or an exception; ``refused``: an unsupported shape rejected cleanly), ``max_err`` against
float64, ``us`` (median microseconds of the backend call: CUDA events on a GPU after a warm-up
call, wall clock on the CPU counting the checked call), and for ``auto`` the backend it resolved
to. A row opens the backend's door for the call and runs its ``attend`` (the timed call includes
opening it). ``--json``: one JSON object per row on stdout, written as each row is produced; the table
then goes to stderr (``--quiet``: only the per-backend summary and the failures). Exit status 1
when a row fails.

The fused MoE experts (:mod:`simsd_kernels.moe`) follow as ``# fused MoE`` lines: for ``triton``
(when chosen and available) and ``auto``, per chosen dtype, the op's self-check on the device
(four small cases against float64, every tile height) and the backend ``auto`` resolves to; a
failure makes the exit status 1. With ``--json`` each is also a row, ``{"op": "fused_moe",
"backend", "device", "resolved", "dtype", "status", "max_err", "tol", "detail"}`` (attention rows
have no ``op``), so a failure names its path (bench/device_summary.py: ``check: fused MoE triton``).

A user with a GPU runs this first; ``bench/device_run.sh`` runs the full matrix.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import time
import warnings

MODES = ("bidirectional", "block_causal", "exact", "paper")
DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 128, 96)
#: name -> (cache lengths of the two rows, capacity, long: the self-check's long case's new tokens
#: (:data:`simsd_kernels.selfcheck.LONG_LQ`) instead of its usual :data:`~simsd_kernels.selfcheck.LQ`)
CACHES = {"empty": ((0, 0), 16, False), "short": ((37, 5), 64, False), "split": ((700, 300), 768, False),
          "long": ((100, 3), 192, True)}
GROUPS = (1, 4)
#: the default set, ``(dtype, head_dim, mask mode, GQA group, cache)``, run by every backend:
#: each dtype, head dim, mode, group and cache at least once; the split cache with the paper
#: layout (the most mask work), head dim 128 in a half type and in float32 (the fused kernels'
#: fp32 tiles differ on a GPU), 96 refused or fallen back, the 64-row query tile at head dim 64
QUICK = (
    ("float16", 64, "paper", 4, "split"),
    ("bfloat16", 128, "exact", 4, "short"),
    ("float32", 128, "block_causal", 1, "short"),
    ("bfloat16", 64, "bidirectional", 1, "empty"),
    ("float16", 96, "paper", 4, "short"),
    ("bfloat16", 64, "exact", 1, "long"),
)
#: the axis options (``args`` attributes): given any of them, the product of their values runs
AXES = ("dtypes", "head_dims", "mask_modes", "caches", "groups")
#: rows per backend of the full matrix
FULL_ROWS = len(DTYPES) * len(HEAD_DIMS) * len(MODES) * len(CACHES) * len(GROUPS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``simsd check`` (shared by ``python -m simsd_kernels.check``)."""
    p.add_argument("--device", default=None, help="device to check (default: cuda when available, else cpu)")
    p.add_argument("--backends", default="all",
                   help="comma list of backends (and/or 'auto'); default: every available one and auto")
    p.add_argument("--exclude", default="", help="comma list of backends to leave out of --backends all")
    p.add_argument("--full", action="store_true",
                   help=f"the full matrix (every dtype x head dim x mask mode x cache x group: {FULL_ROWS} rows per "
                        f"backend) instead of the quick set ({len(QUICK)} rows per backend)")
    def axis(values) -> str:
        return f"comma list (default {','.join(map(str, values))}); an axis option runs the product of the axes"

    p.add_argument("--dtypes", default=None, help=axis(DTYPES))
    p.add_argument("--head-dims", default=None, help=axis(HEAD_DIMS))
    p.add_argument("--mask-modes", default=None, help=axis(MODES) + " (attention mask modes, not decoding modes)")
    p.add_argument("--caches", default=None, help=axis(CACHES))
    p.add_argument("--groups", default=None, help=axis(GROUPS) + " (GQA groups Hq/Hkv)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per row (default 20 on a GPU, 1 on the CPU)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (compiles Triton kernels in parallel)")
    p.add_argument("--json", action="store_true", help="JSON rows on stdout as produced; the table on stderr")
    p.add_argument("--quiet", action="store_true", help="with --json: only the summary and the failures on stderr")


def _csv(value: str, allowed, what: str, cast=str) -> list:
    out = []
    for tok in (t.strip() for t in value.split(",")):
        if not tok:
            continue
        try:
            item = cast(tok)
        except ValueError:
            raise ValueError(f"--{what}: {tok!r} is not valid") from None
        if allowed is not None and item not in allowed:
            raise ValueError(f"--{what}: {tok!r} is not one of {', '.join(map(str, allowed))}")
        out.append(item)
    if not out:
        raise ValueError(f"--{what} is empty")
    return out


def is_full(args) -> bool:
    """True when ``args`` ask for the product of the axes (``--full`` or any axis option)."""
    return args.full or any(getattr(args, k) is not None for k in AXES)


def plan(args) -> tuple:
    """``(device, backends, unavailable, tasks)`` from the options; a task is one configuration
    ``(backend, dtype, head_dim, mode, group, caches)``: :data:`QUICK` for every backend, or with
    ``--full`` / an axis option the product of the axes' values.

    Raises:
        ValueError: an unknown or unavailable backend, dtype, mode, cache or a bad number.
    """
    import torch

    from .backends import availability, backend_names
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available")
    if device.type == "cpu" and "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"  # the only way Triton kernels run on the CPU (before import)
    names = [n for n in backend_names() if n != "auto"]
    unavailable = {}
    excluded = set(_csv(args.exclude, names, "exclude")) if args.exclude.strip() else set()
    if args.backends == "all":
        chosen = []
        for n in (n for n in names if n not in excluded):
            ok, why = availability(n, device)
            (chosen.append(n) if ok else unavailable.__setitem__(n, why))
        chosen.append("auto")
    else:
        chosen = _csv(args.backends, names + ["auto"], "backends")
        for n in chosen:
            ok, why = availability(n, device) if n != "auto" else (True, "")
            if not ok:
                raise ValueError(f"--backends: {n!r} cannot run on {device}: {why}")

    def axis(name: str, default, allowed, cast=str) -> list:  # an axis option's values (None: the default)
        given = getattr(args, name.replace("-", "_"))
        return _csv(",".join(map(str, default)) if given is None else given, allowed, name, cast)

    dtypes = axis("dtypes", DTYPES, DTYPES)
    head_dims = axis("head-dims", HEAD_DIMS, None, int)
    if any(d <= 0 or d % 2 for d in head_dims):
        raise ValueError(f"--head-dims: head dims must be positive and even, got {head_dims}")
    modes = axis("mask-modes", MODES, MODES)
    caches = axis("caches", tuple(CACHES), tuple(CACHES))
    groups = axis("groups", GROUPS, None, int)
    if any(g < 1 for g in groups):
        raise ValueError(f"--groups must be >= 1, got {groups}")
    if args.jobs < 1 or (args.reps is not None and args.reps < 1):
        raise ValueError("--jobs and --reps must be >= 1")
    if is_full(args):
        tasks = [(b, dt, d, m, g, tuple(caches))
                 for b, dt, d, m, g in itertools.product(chosen, dtypes, head_dims, modes, groups)]
    else:
        tasks = [(b, dt, d, m, g, (c,)) for b in chosen for dt, d, m, g, c in QUICK]
    return device, chosen, unavailable, tasks


def _time_us(fn, device, reps: int, first_us: float) -> float:
    """Median microseconds of ``reps`` calls of ``fn``: on a GPU after a warm-up call (CUDA
    events), on the CPU counting the checked call (``first_us``, wall clock) as the first."""
    import torch
    if device.type == "cuda":
        fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)
    times = [first_us]
    for _ in range(reps - 1):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run_task(task, device_str: str, reps: int | None) -> list:
    """The rows of one configuration (one per cache variant)."""
    import torch

    from .backends import OpConfig, get_backend, resolve_backend
    from .mask_rule import parse_mask_mode
    from .selfcheck import LONG_LQ, LQ, attend_once, attention_case, judge, reference
    name, dtype_name, head_dim, mode_name, group, caches = task
    device = torch.device(device_str)
    dtype = getattr(torch, dtype_name)
    mode = int(parse_mask_mode(mode_name))
    reps = reps or (20 if device.type == "cuda" else 1)
    base = dict(backend=name, device=str(device), dtype=dtype_name, head_dim=head_dim, mask_mode=mode_name,
                group=group)
    rows = []
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with torch.no_grad(), guard:
        note = ""
        try:
            if name == "auto":
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    impl = resolve_backend("auto", device, OpConfig("attention", dtype, head_dim, group, mode))
                note = "; ".join(str(w.message) for w in caught)
            else:
                impl = get_backend(name)
            supported = impl.supports(dtype, head_dim)[0]
        except Exception as exc:  # noqa: BLE001  (a row, not a crash)
            return [dict(base, cache=c, resolved=None, status="FAIL", max_err=None, tol=None, us=None,
                         detail=f"{type(exc).__name__}: {exc}"[:300]) for c in caches]
        for cache in caches:
            lens, capacity, long = CACHES[cache]
            row = dict(base, cache=cache, cache_lens=list(lens), resolved=impl.name, max_err=None, tol=None, us=None)
            try:
                clean, poisoned = attention_case(device, dtype, head_dim, group, mode, lens, capacity,
                                                Lq=LONG_LQ if long else LQ)
                scale = head_dim ** -0.5
                # the long case under the shape-invariant plan (exact mode's --invariant path): its
                # fixed 64-row query tile, which the other cases' plans need not choose
                plan = {"shape_invariant": True} if long and impl.plan_options else {}
                call = lambda: attend_once(impl, poisoned, mode, scale, **plan)  # noqa: E731  (the door, attend)
                if not supported:
                    try:
                        call()
                        row.update(status="FAIL", detail="ran a shape its supports() rejects")
                    except ValueError as exc:
                        row.update(status="refused", detail=str(exc).splitlines()[0][:200])
                    rows.append(row)
                    continue
                ref, torch_err = reference(clean, mode, scale)
                t0 = time.perf_counter()
                out = call()
                first_us = (time.perf_counter() - t0) * 1e6
                res = judge(out, clean, ref, torch_err, lens)
                row.update(status="pass" if res.ok else "FAIL", max_err=res.max_err, tol=res.tol)
                if note or not res.ok:
                    row["detail"] = (note + "; " if note else "") + res.detail
                if res.ok:
                    row["us"] = round(_time_us(call, device, reps, first_us), 2)
            except Exception as exc:  # noqa: BLE001
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                row.update(status="FAIL", detail=f"{type(exc).__name__}: {first}"[:300])
            rows.append(row)
    return rows


def _worker(payload):
    task, device, reps = payload
    return run_task(task, device, reps)


def _fmt(x, spec):
    ok = isinstance(x, (int, float)) and x == x
    return format(x, spec) if ok else "-".rjust(int(spec.split(".")[0]))


def summary(rows: list, out=sys.stdout) -> None:
    """A per-backend count of ``rows`` by status, then one line per failure."""
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        counts = {s: sum(r["status"] == s for r in mine) for s in ("pass", "FAIL", "refused")}
        print(f"# {backend}: {counts['pass']} pass, {counts['FAIL']} FAIL, {counts['refused']} refused "
              f"(of {len(mine)})", file=out)
    for r in rows:
        if r["status"] == "FAIL":
            print(f"# FAIL {r['backend']} {r['dtype']} D={r['head_dim']} {r['mask_mode']} {r['cache']} "
                  f"G={r['group']}: {r.get('detail')}", file=out)


HEADER = (f"{'backend':8} {'->':7} {'dtype':9} {'D':>4} {'mode':14} {'cache':6} {'G':>2} {'status':8} "
          f"{'max_err':>9} {'tol':>9} {'us':>9}")


def row_line(r: dict) -> str:
    """One row of the table (columns of :data:`HEADER`)."""
    return (f"{r['backend']:8} {(r.get('resolved') or '-'):7} {r['dtype']:9} {r['head_dim']:>4} {r['mask_mode']:14} "
            f"{r['cache']:6} {r['group']:>2} {r['status']:8} {_fmt(r.get('max_err'), '9.2e')} "
            f"{_fmt(r.get('tol'), '9.2e')} {_fmt(r.get('us'), '9.1f')}")


def run(args) -> int:
    """Run the check described by ``args`` (see :func:`add_arguments`); returns the exit status."""
    import torch
    device, chosen, unavailable, tasks = plan(args)
    info = sys.stderr if args.json else sys.stdout
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# simsd check on {device} ({gpu}), torch {torch.__version__}; backends {', '.join(chosen)}"
          + "".join(f"; {n} not available: {why}" for n, why in unavailable.items()), file=info, flush=True)
    if not is_full(args):
        which = f"the quick set (--full: the full matrix, {FULL_ROWS * len(chosen)} rows)"
    else:
        which = "the product of the chosen axes" if any(getattr(args, k) is not None for k in AXES) else \
            "the full matrix"
    print(f"# {sum(len(t[5]) for t in tasks)} rows, {which}; each row is printed as it finishes", file=info,
          flush=True)
    table_rows = not (args.json and args.quiet)
    if table_rows:
        print(HEADER, file=info, flush=True)
    rows = []

    def emit(batch):
        rows.extend(batch)
        for r in batch:
            if args.json:
                print(json.dumps(r), flush=True)
            if table_rows:
                print(row_line(r), file=info, flush=True)

    t0 = time.time()
    payloads = [(t, str(device), args.reps) for t in tasks]
    if args.jobs > 1 and len(tasks) > 1:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            for batch in pool.imap_unordered(_worker, payloads):
                emit(batch)
    else:
        for p in payloads:
            emit(_worker(p))
    order = {t[:5]: i for i, t in enumerate(tasks)}
    rows.sort(key=lambda r: (order[(r["backend"], r["dtype"], r["head_dim"], r["mask_mode"], r["group"])],
                             list(CACHES).index(r["cache"])))
    summary(rows, out=info)
    print(f"# {len(rows)} rows in {time.time() - t0:.1f} s", file=info)
    dtypes = _csv(args.dtypes, DTYPES, "dtypes") if args.dtypes else list(DTYPES)
    moe_ok = run_moe(device, chosen, dtypes, info, json_rows=args.json)
    return 1 if any(r["status"] == "FAIL" for r in rows) or not moe_ok else 0


def moe_row(name: str, resolved: str, device, dtype_name: str, res) -> dict:
    """The ``--json`` row of one fused-MoE self-check (module doc); NaN errors become None."""
    num = lambda x: x if isinstance(x, (int, float)) and x == x else None  # noqa: E731
    return dict(op="fused_moe", backend=name, device=str(device), resolved=resolved, dtype=dtype_name,
                status="pass" if res.ok else "FAIL", max_err=num(res.max_err), tol=num(res.tol), detail=res.detail)


def run_moe(device, chosen: list, dtypes: list, out, json_rows: bool = False) -> bool:
    """The ``# fused MoE`` lines (module doc), and with ``json_rows`` their rows on stdout; False when
    a check failed."""
    import torch

    from . import moe
    ok = True
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for name in [n for n in ("triton", "auto") if n in chosen]:
            if name == "triton" and not moe.triton_availability(device)[0]:
                continue
            resolved = "triton"
            if name == "auto":
                with warnings.catch_warnings(record=True):  # a failed check is this line's FAIL, not a warning
                    warnings.simplefilter("always")
                    resolved = moe.resolve_moe_backend("auto", device, dtype)
            res = moe.check_fused_moe(moe.fused_moe_triton if resolved == "triton" else moe.fused_moe_torch, device,
                                      dtype)
            ok = ok and res.ok
            print(f"# fused MoE {name:6} -> {resolved:6} {dtype_name:9} {'pass' if res.ok else 'FAIL':4} {res.detail}",
                  file=out, flush=True)
            if json_rows:
                print(json.dumps(moe_row(name, resolved, device, dtype_name, res)), flush=True)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m simsd_kernels.check", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"simsd check: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
