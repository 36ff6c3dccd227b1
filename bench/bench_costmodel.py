"""Modelled GPU decoding speed from the counters of a ``simsd bench`` run: ms per token on a named GPU.

    python bench/bench_costmodel.py bench/results/cpu_tiny_pair_self_fold.json \
        --latency bench/results/device_h200/e2e.jsonl --json bench/results/costmodel_h200_8b.json

Device-independent counters (target and draft forwards per token, query tokens per forward:
``simsd bench --json``) times what a forward of that width costs on the GPU:

    ms/token = target_forwards/token x t_target(target query tokens per forward)
             + draft_forwards/token  x t_draft(draft query tokens per forward)

Two ways to get ``t(q)``, stated on every row:

* ``measured`` (``--latency``, a ``bench/bench_e2e.py`` result): the per-forward latencies
  replayed as CUDA graphs on that GPU with the SDAR-8B-shaped target and SDAR-1.7B-shaped draft
  (``vanilla_step`` 4, ``verify_paper`` 8, ``verify_exact`` 16 query tokens for the target, and
  ``verify_exact_16`` / ``_32``, 64 and 128, where the run timed them; ``draft_step`` 4 for the
  draft), interpolated linearly in the query tokens and extended linearly past the widest
  measured forward (the draft's one point: flat);
* ``roofline`` (``--gpu``): the weights' and KV cache's bytes read once per forward at a fraction
  of the GPU's memory bandwidth, the matrix products' FLOPs at a fraction of its bf16 rate
  (whichever bound is larger), plus a fixed cost per forward (kernel launches: small with CUDA
  graphs, ``--per-forward-us``).

The rows say ``"modelled": true``: they are predictions from counters, not measurements of
decoding. A bundled pair's counters stand in for a real pair's: its block length is SDAR's (4),
its acceptance is its own (tiny models agree less often than SDAR-8B and -1.7B do).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: named GPUs: HBM bandwidth (bytes/s) and dense bf16 rate (FLOP/s), the vendors' datasheets
GPUS = {"h200": (4.8e12, 989e12), "h100": (3.35e12, 989e12), "a100": (2.0e12, 312e12)}
#: parameters and KV bytes per token of the SDAR shapes (bf16): (parameters, KV bytes per cached token)
SHAPES = {"8b": (8.19e9, 36 * 2 * 8 * 128 * 2), "1.7b": (2.03e9, 28 * 2 * 8 * 128 * 2)}


def measured_latency(path: Path, pair: str = "random-8b/1.7b") -> dict:
    """``{"target": [(q, ms)], "draft": [(q, ms)]}`` from a bench_e2e result (JSON lines): the
    forwards replayed as graphs of ``pair``."""
    points = {"target": {}, "draft": {}}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") != "latency" or row.get("pair") != pair or row.get("mode") != "graphs":
            continue
        role = "draft" if row["forward"] == "draft_step" else "target"
        name = row["forward"]
        if name in ("draft_step", "vanilla_step", "verify_paper") or name.startswith("verify_exact"):
            points[role][row["Lq"]] = row["ms"]
    if not points["target"] or not points["draft"]:
        raise ValueError(f"{path}: no graph latencies of {pair} (a bench/bench_e2e.py result)")
    return {role: sorted(p.items()) for role, p in points.items()}


def interpolate(points: list, q: float) -> float:
    """Piecewise-linear ``t(q)`` through ``points`` ``[(q, ms)]``, extended with the last
    segment's slope (flat with one point)."""
    if len(points) == 1:
        return points[0][1]
    for (q0, t0), (q1, t1) in zip(points, points[1:]):
        if q <= q1:
            return t0 + (t1 - t0) * (q - q0) / (q1 - q0)
    (q0, t0), (q1, t1) = points[-2], points[-1]
    return t1 + (t1 - t0) * (q - q1) / (q1 - q0)


def roofline(shape: str, q: float, gpu: str, cache_len: int, bw_eff: float, flop_eff: float,
             per_forward_us: float) -> float:
    """Milliseconds of one forward of ``q`` query tokens over a cache of ``cache_len`` tokens."""
    params, kv_per_token = SHAPES[shape]
    bw, flops = GPUS[gpu]
    memory = (2 * params + kv_per_token * cache_len) / (bw * bw_eff)
    compute = 2 * params * q / (flops * flop_eff)
    return 1e3 * max(memory, compute) + per_forward_us / 1e3


def model_rows(bench: dict, cost) -> list:
    """The modelled rows of a ``simsd bench`` JSON result: ``cost(role, q) -> ms``."""
    rows = []
    for r in bench["rows"]:
        tf, df = r["target_forwards_per_token"], r.get("draft_forwards_per_token", 0.0)
        tq = r.get("target_query_tokens_per_forward")
        if tq is None:
            raise ValueError(f"{r['mode']}: no target_query_tokens_per_forward (a simsd bench result of this version)")
        dq = 4.0  # a draft forward denoises one block (B = 4)
        ms = tf * cost("target", tq) + (df * cost("draft", dq) if df else 0.0)
        rows.append({"mode": r["mode"], "modelled": True, "target_forwards_per_token": tf,
                     "draft_forwards_per_token": df, "target_query_tokens_per_forward": tq,
                     "ms_per_token": ms, "tokens_per_second": 1e3 / ms})
    base = next((x for x in rows if x["mode"] == "vanilla"), None)
    for x in rows:
        x["speedup_vs_vanilla"] = base["ms_per_token"] / x["ms_per_token"] if base else None
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench", type=Path, help="a simsd bench --json result (its rows' counters)")
    p.add_argument("--latency", type=Path, help="a bench/bench_e2e.py result: measured per-forward latencies")
    p.add_argument("--gpu", choices=sorted(GPUS), help="the roofline model of this GPU instead of --latency")
    p.add_argument("--cache-len", type=int, default=1024, help="cached tokens per forward (roofline; default 1024)")
    p.add_argument("--bandwidth-efficiency", type=float, default=0.8, help="fraction of HBM bandwidth (roofline)")
    p.add_argument("--flop-efficiency", type=float, default=0.5, help="fraction of the bf16 rate (roofline)")
    p.add_argument("--per-forward-us", type=float, default=50.0,
                   help="fixed cost per forward, microseconds (roofline; CUDA graphs: tens of us)")
    p.add_argument("--json", type=Path, help="write the modelled rows here")
    args = p.parse_args(argv)
    if (args.latency is None) == (args.gpu is None):
        p.error("give one of --latency (measured latencies) or --gpu (the roofline model)")
    bench = json.loads(args.bench.read_text())
    if args.latency is not None:
        points = measured_latency(args.latency)
        cost = lambda role, q: interpolate(points[role], q)  # noqa: E731
        source = {"model": "measured", "latency": str(args.latency), "points_ms": points}
        formula = ("ms/token = target_forwards/token x t_target(q) + draft_forwards/token x t_draft(4), t(q) "
                   "interpolated linearly in the measured graph latencies (SDAR-8B / 1.7B shapes)")
    else:
        def cost(role, q):
            return roofline("8b" if role == "target" else "1.7b", q, args.gpu, args.cache_len,
                            args.bandwidth_efficiency, args.flop_efficiency, args.per_forward_us)
        source = {"model": "roofline", "gpu": args.gpu, "cache_len": args.cache_len,
                  "bandwidth_efficiency": args.bandwidth_efficiency, "flop_efficiency": args.flop_efficiency,
                  "per_forward_us": args.per_forward_us}
        formula = ("ms/token = target_forwards/token x t_target(q) + draft_forwards/token x t_draft(4), t(q) = "
                   "max(bytes / (bandwidth x eff), FLOPs / (rate x eff)) + per-forward cost (SDAR-8B / 1.7B shapes)")
    rows = model_rows(bench, cost)
    print(f"# modelled (not measured): {formula}")
    print(f"# counters: {args.bench} ({bench['meta'].get('target')}, block {bench['meta'].get('block_length')}, "
          f"strategy {bench['meta'].get('strategy')}); t(q): {source['model']}")
    print(f"{'mode':>12} {'tgt fwd/tok':>11} {'q tok/fwd':>9} {'drf fwd/tok':>11} {'ms/tok':>7} {'tok/s':>7} "
          f"{'vs vanilla':>10}")
    for r in rows:
        vs = f"{r['speedup_vs_vanilla']:.2f}x" if r["speedup_vs_vanilla"] else "-"
        print(f"{r['mode']:>12} {r['target_forwards_per_token']:11.3f} {r['target_query_tokens_per_forward']:9.1f} "
              f"{r['draft_forwards_per_token']:11.3f} {r['ms_per_token']:7.2f} {r['tokens_per_second']:7.1f} {vs:>10}")
    if args.json:
        args.json.write_text(json.dumps({"meta": {"modelled": True, "formula": formula, "counters": str(args.bench),
                                                  **source}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
