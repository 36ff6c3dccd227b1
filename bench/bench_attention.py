"""Microbenchmark: temporal-mask attention of a short query over a long KV cache (GPU).

    python bench/bench_attention.py [--quick] [--models 8b,1.7b] [--caches 512,...] [--batches 1,...]

Shapes: SDAR-8B (Hq 32, Hkv 8, D 128) and SDAR-1.7B (Hq 16, Hkv 8, D 128), bf16. Query layouts
with block length Bk: ``paper`` (2*Bk tokens: D_1..D_Bk | M_1..M_Bk, four-quadrant mask),
``exact`` (Bk copies of the block, Bk*Bk tokens, copy-diagonal mask), ``denoise`` (Bk tokens,
bidirectional). Every row of the batch has the same cache length.

Providers (a provider that cannot run is reported and skipped):
* ``simsd-<name>``: every simsd backend available by name (``triton``, ``cuda`` once the
  compiled extension exists), RoPE fused (q, k un-rotated): its door opened once for the case,
  each launch one ``attend`` (a layer's call). Only backends that pass: each
  case's configuration goes through the backend's self-check first
  (:func:`simsd_kernels.backends.resolve_backend`), and with ``--check FILE`` (the rows of
  ``simsd check --json``) a backend with a failing row is not benchmarked at all;
* ``flex``: compiled FlexAttention, block mask from ``simsd_kernels.flex.make_mask_mod``; last
  in each case. Its ``torch.compile`` builds (slow when cold) run first, untimed, in a warm-up
  over every case's shape with ``--flex-budget`` seconds of its own; the timed loop runs flex only
  on shapes the warm-up compiled (the others' rows say why);
* ``sdpa-dense``: SDPA with a dense boolean mask (the torch backend's method);
* ``sdpa-nomask``: SDPA over the same keys with no mask, the speed-of-light for this token count
  (SDPA's ``is_causal`` is top-left aligned when Lq != Lk, so it is not a valid causal here);
* ``flash-kvcache``: ``flash_attn_with_kvcache`` (non-causal, over the cache), when importable.
Baselines get pre-rotated q/k and pre-concatenated K/V (untimed), so they do less work than ours.

Metrics: time per launch from CUDA events around replays of a CUDA graph holding
``GRAPH_LAUNCHES`` launches (:func:`graph_time_ms`: a batch-1 call lasts a few microseconds, as
long as its launch, so single launches would time the launch; ``timing: "graph"``), or, for a
provider that cannot be captured, around ``EVENT_LAUNCHES`` back-to-back launches
(``timing: "events"``); the median of the repetitions; bytes = K/V cache read
``2 * B * cache_len * Hkv * D * elt`` + q/k/v/out ``B * Lq * (2*Hq + 2*Hkv) * D * elt``;
GB/s = bytes / time; fractions of a 4 TB/s floor and of the measured device copy bandwidth;
TFLOP/s = ``4 * B * Hq * Lq * (cache_len + Lq) * D`` / time. ``max_diff`` is each provider's max
abs difference to ``sdpa-dense``; ``err`` its max abs error against SDPA on float32 copies of
the inputs, and ``tol = 2 * err(sdpa-dense) + REL_FLOOR[dtype] * max|reference|``: a row above
it has ``valid: false`` (printed INVALID) and must not be quoted (``sdpa-nomask`` computes
another function: ``valid: null``). Rows (json lines, with GPU name, versions, git sha) are
appended to ``--out`` (default ``bench/results/attention.jsonl``) and flushed one by one, so a
run killed by a time limit keeps what it measured.

A case whose set-up fails is recorded (an ``error`` row per provider) and the next runs; a
provider's exception gives its row an ``error`` and prints its traceback (once per message) to the
log.

``--cpu-smoke``: tiny float32 shapes on the CPU, the Triton kernels under the interpreter,
wall-clock timing: only checks this script's code paths (the device script's dry run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {"8b": (32, 8, 128), "1.7b": (16, 8, 128)}
SMOKE_MODELS = {"8b": (4, 2, 64), "1.7b": (2, 2, 64)}
FLOOR_BYTES_PER_S = 4e12
#: relative error floor per dtype name, times max |reference| (a couple of units in the last place)
REL_FLOOR = {"bf16": 2 ** -7, "fp16": 2 ** -10, "fp32": 1e-5}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention.jsonl")
#: launches per captured CUDA graph, and per timed loop of the events fallback
GRAPH_LAUNCHES, EVENT_LAUNCHES = 20, 50
_FLEX = {}  # the compiled flex_attention, one for the process (its compile cache keeps every shape)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small subset (8B, cache 4096/16384, batch 1/8, Bk 4)")
    p.add_argument("--models", default="8b,1.7b")
    p.add_argument("--caches", default="512,2048,4096,8192,16384,32768")
    p.add_argument("--batches", default="1,4,8,16,64")
    p.add_argument("--blocks", default="4,8", help="block lengths Bk of the query layouts")
    p.add_argument("--layouts", default="paper,exact,denoise")
    p.add_argument("--providers", default="", help="comma list to restrict providers (default: all)")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--check", default=None, help="simsd check --json rows: skip backends with a failing row")
    p.add_argument("--flex-budget", type=float, default=120.0,
                   help="seconds FlexAttention may use in all (compiles included); 0 = no flex rows")
    p.add_argument("--warm-only", action="store_true",
                   help="only compile (and self-check) the simsd providers of every case: no timing, no rows")
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.caches, args.batches, args.blocks = "8b", "4096,16384", "1,8", "4"
    if args.cpu_smoke:
        args.models, args.caches, args.batches, args.blocks = "8b", "40", "1,2", "4"
    return args


def layout_labels(layout, bk, batch, device):
    """``(labels (batch, Lq, 3) int32, positions (batch, Lq) int64 offsets, MaskMode)``."""
    import torch

    from simsd_kernels.mask_rule import MaskMode

    blk = torch.arange(bk)
    if layout == "paper":  # D_k at tau k+1, M_k the RoPE copy
        kind = torch.cat([torch.ones(bk), torch.full((bk,), 2)])
        tau = torch.cat([blk + 1, blk + 1])
        grp, pos, mode = torch.zeros(2 * bk), torch.cat([blk, blk]), MaskMode.PAPER
    elif layout == "exact":  # one copy of the block per verified step
        kind = torch.zeros(bk * bk)
        tau = torch.zeros(bk * bk)
        grp, pos, mode = torch.arange(bk).repeat_interleave(bk), blk.repeat(bk), MaskMode.EXACT
    else:
        kind, tau, grp, pos, mode = torch.zeros(bk), torch.zeros(bk), torch.zeros(bk), blk, MaskMode.BIDIRECTIONAL
    labels = torch.stack([kind, tau, grp], -1).to(torch.int32)[None].repeat(batch, 1, 1)
    return labels.to(device), pos[None].repeat(batch, 1).to(device), mode


def failed_backends(path) -> dict:
    """backend -> why, for every backend with a FAIL row in ``simsd check --json`` rows at ``path``
    (a missing file: none; the per-case self-checks still apply)."""
    bad = {}
    if not os.path.isfile(path):
        print(f"# --check {path}: no such file; relying on the per-case self-checks", flush=True)
        return bad
    with open(path) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("op", "attention") != "attention":  # the fused-MoE rows judge another op
                continue
            if r.get("status") == "FAIL" and r.get("backend") != "auto":
                bad.setdefault(r["backend"], f"failed simsd check ({r['dtype']} D={r['head_dim']} {r['mask_mode']} "
                                             f"{r['cache']} G={r['group']}: {r.get('detail', '')})"[:300])
    return bad


def build_providers(names_filter, failed=None):
    """name -> factory(case) returning a zero-argument callable (or raising to skip).

    Every callable returns ``(B, Lq, Hq, D)`` (baselines return a transposed view: no copy).
    ``failed``: backend -> reason, backends not to benchmark.
    """
    import torch
    import torch.nn.functional as F

    from simsd_kernels import backends
    from simsd_kernels.reference import full_mask
    from simsd_kernels.rope import apply_rope

    failed = failed or {}
    provs = {}  # sdpa-dense first: the others are diffed against it
    for name in ("triton", "cuda"):
        def simsd(c, name=name):
            if name in failed:
                raise RuntimeError(failed[name])
            q, k = c["args"][0], c["args"][1]
            config = backends.OpConfig("attention", q.dtype, q.shape[3], q.shape[2] // k.shape[2], int(c["mode"]))
            impl = backends.resolve_backend(name, q.device, config)  # raises if its self-check fails
            q, k, v, kc, vc, lens, labels, pos = c["args"]
            door = impl.open(q, k, kc, lens, labels, pos, mask_mode=c["mode"], rope_theta=1e6, softmax_scale=c["scale"])
            return lambda: door.attend(q, k, v, kc, vc)  # a layer's call (the plan is made once per forward)
        provs[f"simsd-{name}"] = simsd

    def dense_inputs(c):
        q, k, v, kc, vc, lens, labels, pos = c["args"]
        L = c["cache_len"]
        qr = apply_rope(q, pos, 1e6).transpose(1, 2).contiguous()
        keys = torch.cat([kc[:, :L], apply_rope(k, pos, 1e6)], 1).transpose(1, 2).contiguous()
        vals = torch.cat([vc[:, :L], v], 1).transpose(1, 2).contiguous()
        return qr, keys, vals

    def sdpa_dense(c):
        qr, keys, vals = dense_inputs(c)
        mask = full_mask(c["args"][5], c["args"][6], c["mode"], c["cache_len"])[:, None]
        return lambda: F.scaled_dot_product_attention(qr, keys, vals, attn_mask=mask,
                                                      enable_gqa=True).transpose(1, 2)
    provs["sdpa-dense"] = sdpa_dense

    def sdpa_nomask(c):
        qr, keys, vals = dense_inputs(c)
        return lambda: F.scaled_dot_product_attention(qr, keys, vals, enable_gqa=True).transpose(1, 2)
    provs["sdpa-nomask"] = sdpa_nomask

    def flex(c):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        from simsd_kernels.flex import make_mask_mod
        qr, keys, vals = dense_inputs(c)
        mask_mod = make_mask_mod(c["args"][6], c["args"][5], c["cache_len"], c["mode"])
        bm = create_block_mask(mask_mod, qr.shape[0], None, qr.shape[2], keys.shape[2], device=qr.device)
        if qr.is_cuda and "fn" not in _FLEX:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
            _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        fn = _FLEX["fn"] if qr.is_cuda else flex_attention
        return lambda: fn(qr, keys, vals, block_mask=bm, enable_gqa=True).transpose(1, 2)
    provs["flex"] = flex

    def flash_kvcache(c):
        from flash_attn import flash_attn_with_kvcache
        q, k, v, kc, vc, lens, labels, pos = c["args"]
        if c["mode"] != 0:
            raise RuntimeError("flash_attn_with_kvcache has no temporal mask: denoise layout only")
        qr, kr = apply_rope(q, pos, 1e6), apply_rope(k, pos, 1e6)
        return lambda: flash_attn_with_kvcache(qr, kc, vc, kr, v, cache_seqlens=lens, causal=False)
    provs["flash-kvcache"] = flash_kvcache

    provs = {"sdpa-dense": provs.pop("sdpa-dense"), **provs}
    provs["flex"] = provs.pop("flex")  # last: its compiles are slow and budgeted
    if names_filter:
        keep = set(names_filter.split(","))
        provs = {k: v for k, v in provs.items() if k in keep}
    return provs


def environment(device):
    import torch
    import triton

    from simsd.entrypoints.bench import git_sha
    sha = git_sha()  # $SIMSD_GIT_SHA on a copy without .git
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu-smoke"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                git_sha=sha, time=time.strftime("%Y-%m-%dT%H:%M:%S"))


def make_case(batch, Lq, Hq, Hkv, D, L, device="cuda", dtype=None):
    """``q, k, v, k_cache, v_cache, cache_seqlens`` (bf16 on the GPU; capacity L + Lq)."""
    import torch
    dtype = dtype or torch.bfloat16
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype)  # noqa: E731
    return [rnd(batch, Lq, Hq, D), rnd(batch, Lq, Hkv, D), rnd(batch, Lq, Hkv, D),
            rnd(batch, L + Lq, Hkv, D), rnd(batch, L + Lq, Hkv, D),
            torch.full((batch,), L, dtype=torch.int32, device=device)]


def reference_fp32(case):
    """SDPA with the dense mask on float32 copies of the (rotated) inputs: ``(B, Lq, Hq, D)``."""
    import torch
    import torch.nn.functional as F

    from simsd_kernels.reference import full_mask
    from simsd_kernels.rope import apply_rope
    q, k, v, kc, vc, lens, labels, pos = case["args"]
    L = case["cache_len"]
    f = lambda t: t.float()  # noqa: E731
    qr = apply_rope(f(q), pos, 1e6).transpose(1, 2)
    keys = torch.cat([f(kc[:, :L]), apply_rope(f(k), pos, 1e6)], 1).transpose(1, 2)
    vals = torch.cat([f(vc[:, :L]), f(v)], 1).transpose(1, 2)
    mask = full_mask(lens, labels, case["mode"], L)[:, None]
    return F.scaled_dot_product_attention(qr, keys, vals, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def copy_bandwidth():
    import torch
    from triton.testing import do_bench
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def wall_time_ms(fn, reps=3):
    """CPU (dry run): the median wall-clock time of ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_time_ms(fn, launches=GRAPH_LAUNCHES, replays=10):
    """Milliseconds per launch of ``fn``: ``launches`` calls captured in one CUDA graph, replayed
    ``replays`` times between CUDA events (the median). Raises when ``fn`` cannot be captured."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up off the capture (allocations, lazy initialisation)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches)
    del graph
    return statistics.median(times)


def events_time_ms(fn, launches=EVENT_LAUNCHES, reps=5):
    """Milliseconds per launch of ``fn`` from CUDA events around ``launches`` back-to-back calls
    (the median of ``reps``): for providers that cannot be captured in a graph."""
    import torch
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def time_ms(fn, device) -> tuple:
    """``(ms per launch, method)``: ``graph`` replays on CUDA, ``events`` when capture fails,
    ``wall`` on the CPU."""
    if device != "cuda":
        return wall_time_ms(fn), "wall"
    import torch
    try:
        return graph_time_ms(fn), "graph"
    except Exception:  # not capturable (a host sync, an allocation the capture refuses)
        torch.cuda.synchronize()
        return events_time_ms(fn), "events"


def cases(args, device, dtype, models):
    """``(model, layout, bk, batch, L, case, Hq, Hkv, D)`` for every combination of the options."""
    for model in args.models.split(","):
        Hq, Hkv, D = models[model]
        for layout in args.layouts.split(","):
            for bk in map(int, args.blocks.split(",")):
                for batch in map(int, args.batches.split(",")):
                    for L in map(int, args.caches.split(",")):
                        labels, offs, mode = layout_labels(layout, bk, batch, device)
                        Lq = labels.shape[1]
                        a = make_case(batch, Lq, Hq, Hkv, D, L, device, dtype) + [labels, offs + L]
                        yield model, layout, bk, batch, L, dict(args=a, q=a[0], mode=mode, scale=D ** -0.5,
                                                                  cache_len=L), Hq, Hkv, D


def case_key(model, layout, bk, batch, L):
    return (model, layout, bk, batch, L)


def flex_warmup(args, device, dtype, models, providers) -> dict:
    """Compile FlexAttention for every case's shape, untimed, within ``--flex-budget`` seconds:
    ``{case key: None (compiled) or the reason it is not}``."""
    done = {}
    if "flex" not in providers:
        return done
    t0 = time.perf_counter()
    for model, layout, bk, batch, L, case, *_ in cases(args, device, dtype, models):
        key = case_key(model, layout, bk, batch, L)
        if time.perf_counter() - t0 >= args.flex_budget:
            done[key] = f"not run: the FlexAttention warm-up budget of {args.flex_budget:.0f} s was spent compiling"
            continue
        try:
            providers["flex"](case)()
            done[key] = None
        except Exception as exc:  # the timed loop reports it
            done[key] = f"{type(exc).__name__}: {str(exc)[:300]}"
    if device == "cuda":
        import torch
        torch.cuda.synchronize()
    print(f"# flex warm-up: {sum(v is None for v in done.values())} of {len(done)} shapes compiled in "
          f"{time.perf_counter() - t0:.0f} s (budget {args.flex_budget:.0f} s)", flush=True)
    return done


def warm(args, device, dtype, models) -> int:
    """Compile and self-check the simsd providers of every case (the device script runs this
    while the CUDA extension builds, so the timed run finds the Triton kernels compiled)."""
    providers = build_providers("simsd-triton")
    t0 = time.time()
    for model, layout, bk, batch, L, case, *_ in cases(args, device, dtype, models):
        for pname, make in providers.items():
            try:
                make(case)()
                status = "ok"
            except Exception as exc:  # reported, the timed run will report it again
                status = f"{type(exc).__name__}: {str(exc)[:120]}"
            print(f"warm {model} {layout} Bk={bk} B={batch} cache={L} {pname}: {status} ({time.time() - t0:.0f} s)",
                  flush=True)
    return 0


def main(argv=None):
    args = parse_args(argv)
    import torch
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        device, dtype, dname, models = "cpu", torch.float32, "fp32", SMOKE_MODELS
        copy_bw = None
    elif not torch.cuda.is_available():
        print("bench_attention: no CUDA device; nothing to measure (this benchmark needs a GPU).")
        return 0
    else:
        device, dtype, dname, models = "cuda", torch.bfloat16, "bf16", MODELS
        copy_bw = None if args.warm_only else copy_bandwidth()
    if args.warm_only:
        return warm(args, device, dtype, models)
    env = environment(device)
    print(f"# {env['gpu']}  torch {env['torch']}  triton {env['triton']}  sha {env['git_sha']}  "
          f"copy bandwidth {copy_bw / 1e9 if copy_bw else float('nan'):.0f} GB/s", flush=True)
    failed = failed_backends(args.check) if args.check else {}
    for name, why in failed.items():
        print(f"# simsd-{name}: not benchmarked: {why}", flush=True)
    providers = build_providers(args.providers, failed)
    flex_ready = flex_warmup(args, device, dtype, models, providers) if args.flex_budget > 0 else {}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    print(f"{'model':6} {'layout':8} {'Bk':>3} {'B':>3} {'cache':>6} {'Lq':>4} {'provider':16} "
          f"{'ms':>8} {'GB/s':>7} {'%4TB':>5} {'%copy':>5} {'TF/s':>6} {'diff':>8} {'err/tol':>8}", flush=True)
    reported = set()

    def report(pname, exc):  # the traceback once per provider and message (the log)
        key = (pname, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        if key not in reported and not str(exc).startswith("not run"):
            reported.add(key)
            print(f"# {pname} raised:\n{traceback.format_exc()}", file=sys.stderr, flush=True)

    with open(args.out, "a") as f:
        def write(row):
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for model, layout, bk, batch, L, case, Hq, Hkv, D in cases(args, device, dtype, models):
            base = dict(env, model=model, layout=layout, block=bk, batch=batch, cache_len=L, Hq=Hq, Hkv=Hkv, D=D,
                        dtype=dname, copy_gbps=copy_bw / 1e9 if copy_bw else None)
            try:  # the case's set-up and reference
                Lq = case["q"].shape[1]
                elt = case["q"].element_size()
                nbytes = 2 * batch * L * Hkv * D * elt + batch * Lq * (2 * Hq + 2 * Hkv) * D * elt
                flops = 4 * batch * Hq * Lq * (L + Lq) * D
                ref32 = reference_fp32(case)
                ref_scale = ref32.abs().max().item()
            except Exception as exc:  # noqa: BLE001  (the case failed; the next one runs)
                report("case set-up", exc)
                for pname in providers:
                    write(dict(base, provider=pname, error=f"case set-up: {type(exc).__name__}: {str(exc)[:300]}"))
                continue
            ref, base_err = None, None
            for pname, make in providers.items():
                row = dict(base, Lq=Lq, provider=pname)
                try:
                    if pname == "flex" and flex_ready.get(case_key(model, layout, bk, batch, L), "not warmed up"):
                        raise RuntimeError(flex_ready.get(case_key(model, layout, bk, batch, L)) or
                                           "not run: no FlexAttention warm-up (--flex-budget 0)")
                    fn = make(case)
                    out = fn()
                    err = (out.float() - ref32).abs().max().item()
                    if pname == "sdpa-dense":
                        ref, base_err = out, err
                    diff = (out.float() - ref.float()).abs().max().item() if ref is not None else None
                    tol = 2 * (base_err or 0.0) + REL_FLOOR[dname] * ref_scale
                    valid = None if pname == "sdpa-nomask" else bool(err <= tol)
                    ms, method = time_ms(fn, device)
                    row.update(ms=ms, timing=method, gbps=nbytes / (ms * 1e-3) / 1e9,
                               frac_4tbs=nbytes / (ms * 1e-3) / FLOOR_BYTES_PER_S,
                               frac_copy=nbytes / (ms * 1e-3) / copy_bw if copy_bw else None,
                               tflops=flops / (ms * 1e-3) / 1e12, max_diff=diff, err=err, tol=tol,
                               valid=valid)
                    flag = "" if valid is not False else "  INVALID"
                    print(f"{model:6} {layout:8} {bk:3} {batch:3} {L:6} {Lq:4} {pname:16} "
                          f"{ms:8.4f} {row['gbps']:7.0f} {100 * row['frac_4tbs']:5.1f} "
                          f"{100 * (row['frac_copy'] or 0):5.1f} {row['tflops']:6.1f} "
                          f"{diff if diff is not None else float('nan'):8.1e} "
                          f"{err / tol if valid is not None and tol else float('nan'):8.2f}{flag}",
                          flush=True)
                except Exception as exc:  # record and go on: one provider failing is data
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"{model:6} {layout:8} {bk:3} {batch:3} {L:6} {Lq:4} {pname:16} "
                          f"skipped: {row['error'][:100]}", flush=True)
                    report(pname, exc)
                    if device == "cuda":
                        try:
                            torch.cuda.synchronize()
                            torch.cuda.empty_cache()
                        except Exception:  # noqa: BLE001  (a sticky CUDA error: later rows say so)
                            pass
                write(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
