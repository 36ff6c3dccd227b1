"""``simsd check`` / ``python -m simsd_kernels.check``: is every attention backend right here?

On the present device, every available backend (and ``auto``) x dtype x head_dim (64, 128 and
96, which the fused kernels do not support: an explicit backend must refuse it with a
``ValueError``, ``auto`` must fall back to one that runs it) x mask mode x cache (``empty``:
lengths 0/0; ``short``: 37/5; ``split``: 700/300 in a 768-slot cache, past one split-KV chunk on
a GPU) x GQA group (1, 4): the backend's output on a small case (2 rows, 9 new tokens, 2 kv
heads, unread cache slots holding NaN) against the float64 reference on the same device. On
the CPU the Triton kernels run under the interpreter (``TRITON_INTERPRET=1`` is set when Triton
has not been imported yet).

Columns: ``status`` (``pass``; ``FAIL``: max error above ``tol`` = 2x the torch backend's error
+ a dtype floor (:mod:`simsd_kernels.selfcheck`), NaN, a wrong shape or an exception;
``refused``: an unsupported shape rejected cleanly), ``max_err`` against float64, ``us``
(median microseconds of the backend call: CUDA events on a GPU, wall clock on the CPU), and for
``auto`` the backend it resolved to. ``--json``: one JSON object per row on stdout, written as
each row is produced; the table then goes to stderr (``--quiet``: only the per-backend summary
and the failures). Exit status 1 when a row fails.

A user with a GPU runs this first; it is the first check of ``bench/device_run.sh``.
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
#: name -> (cache lengths of the two rows, capacity)
CACHES = {"empty": ((0, 0), 16), "short": ((37, 5), 64), "split": ((700, 300), 768)}
GROUPS = (1, 4)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``simsd check`` (shared by ``python -m simsd_kernels.check``)."""
    p.add_argument("--device", default=None, help="device to check (default: cuda when available, else cpu)")
    p.add_argument("--backends", default="all",
                   help="comma list of backends (and/or 'auto'); default: every available one and auto")
    p.add_argument("--exclude", default="", help="comma list of backends to leave out of --backends all")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma list of float16, bfloat16, float32")
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)), help="comma list of head dims")
    p.add_argument("--mask-modes", default=",".join(MODES),
                   help=f"comma list of attention mask modes ({', '.join(MODES)}); not decoding modes")
    p.add_argument("--caches", default=",".join(CACHES), help=f"comma list of {', '.join(CACHES)}")
    p.add_argument("--groups", default=",".join(map(str, GROUPS)), help="comma list of GQA groups Hq/Hkv")
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


def plan(args) -> tuple:
    """``(device, backends, unavailable, tasks)`` from the options; a task is one configuration
    ``(backend, dtype, head_dim, mode, group, caches)``.

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
    dtypes = _csv(args.dtypes, DTYPES, "dtypes")
    head_dims = _csv(args.head_dims, None, "head-dims", int)
    if any(d <= 0 or d % 2 for d in head_dims):
        raise ValueError(f"--head-dims: head dims must be positive and even, got {head_dims}")
    modes = _csv(args.mask_modes, MODES, "mask-modes")
    caches = _csv(args.caches, tuple(CACHES), "caches")
    groups = _csv(args.groups, None, "groups", int)
    if any(g < 1 for g in groups):
        raise ValueError(f"--groups must be >= 1, got {groups}")
    if args.jobs < 1 or (args.reps is not None and args.reps < 1):
        raise ValueError("--jobs and --reps must be >= 1")
    tasks = [(b, dt, d, m, g, tuple(caches))
             for b, dt, d, m, g in itertools.product(chosen, dtypes, head_dims, modes, groups)]
    return device, chosen, unavailable, tasks


def _time_us(fn, device, reps: int) -> float:
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
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run_task(task, device_str: str, reps: int | None) -> list:
    """The rows of one configuration (one per cache variant)."""
    import torch

    from .backends import OpConfig, get_backend, resolve_backend
    from .mask_rule import parse_mask_mode
    from .selfcheck import THETA, attention_case, judge, reference
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
            lens, capacity = CACHES[cache]
            row = dict(base, cache=cache, cache_lens=list(lens), resolved=impl.name, max_err=None, tol=None, us=None)
            try:
                clean, poisoned = attention_case(device, dtype, head_dim, group, mode, lens, capacity)
                scale = head_dim ** -0.5
                call = lambda: impl.attention(*poisoned, mode, THETA, scale)  # noqa: E731
                if not supported:
                    try:
                        call()
                        row.update(status="FAIL", detail="ran a shape its supports() rejects")
                    except ValueError as exc:
                        row.update(status="refused", detail=str(exc).splitlines()[0][:200])
                    rows.append(row)
                    continue
                ref, torch_err = reference(clean, mode, scale)
                res = judge(call(), clean, ref, torch_err, lens)
                row.update(status="pass" if res.ok else "FAIL", max_err=res.max_err, tol=res.tol)
                if note or not res.ok:
                    row["detail"] = (note + "; " if note else "") + res.detail
                if res.ok:
                    row["us"] = round(_time_us(call, device, reps), 2)
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


def table(rows: list, out=sys.stdout, summary_only: bool = False) -> None:
    """The human-readable table of ``rows`` (unless ``summary_only``), a per-backend summary and
    the failures."""
    if not summary_only:
        _rows_table(rows, out)
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        counts = {s: sum(r["status"] == s for r in mine) for s in ("pass", "FAIL", "refused")}
        print(f"# {backend}: {counts['pass']} pass, {counts['FAIL']} FAIL, {counts['refused']} refused "
              f"(of {len(mine)})", file=out)
    for r in rows:
        if r["status"] == "FAIL":
            print(f"# FAIL {r['backend']} {r['dtype']} D={r['head_dim']} {r['mask_mode']} {r['cache']} "
                  f"G={r['group']}: {r.get('detail')}", file=out)


def _rows_table(rows: list, out) -> None:
    print(f"{'backend':8} {'->':7} {'dtype':9} {'D':>4} {'mode':14} {'cache':6} {'G':>2} {'status':8} "
          f"{'max_err':>9} {'tol':>9} {'us':>9}", file=out)
    for r in rows:
        print(f"{r['backend']:8} {(r.get('resolved') or '-'):7} {r['dtype']:9} {r['head_dim']:>4} {r['mask_mode']:14} "
              f"{r['cache']:6} {r['group']:>2} {r['status']:8} {_fmt(r.get('max_err'), '9.2e')} "
              f"{_fmt(r.get('tol'), '9.2e')} {_fmt(r.get('us'), '9.1f')}", file=out)


def run(args) -> int:
    """Run the check described by ``args`` (see :func:`add_arguments`); returns the exit status."""
    import torch
    device, chosen, unavailable, tasks = plan(args)
    info = sys.stderr if args.json else sys.stdout
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# simsd check on {device} ({gpu}), torch {torch.__version__}; backends {', '.join(chosen)}"
          + "".join(f"; {n} not available: {why}" for n, why in unavailable.items()), file=info, flush=True)
    rows = []

    def emit(batch):
        rows.extend(batch)
        if args.json:
            for r in batch:
                print(json.dumps(r), flush=True)

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
    table(rows, out=info, summary_only=args.json and args.quiet)
    print(f"# {len(rows)} rows in {time.time() - t0:.1f} s", file=info)
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


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
