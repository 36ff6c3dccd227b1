"""KV memory model: concurrent requests a fixed KV budget serves, contiguous rows vs pages.

    python bench/bench_kv_pages.py [--budget-gib 64] [--max-len 32768] [--page-sizes 16,64,256]
                                   [--requests 4000] [--seed 0] [--out FILE]

Modelled, not measured on a device: nothing is allocated but host bookkeeping. For each model set
(the SDAR-8B target with the SDAR-1.7B draft, and the 8B alone; bfloat16, shapes of the Qwen3
configs: 36 / 28 layers, 8 kv heads of 128) the budget is cut into pools of the
:class:`simsd.models.pages.PageAllocator` the cache uses, one pool per model with the same page
count (a request holds the same slots in both), ``bytes per page = page_size x 2 x layers x
kv_heads x head_dim x 2`` summed over the models (``simsd.engine.memory.kv_cache_bytes`` of one
row of ``page_size`` slots). Requests of a length mix arrive in a fixed order and each reserves the
pages of its own final length (prompt + output: the worst case the scheduler knows at admission)
in every pool; the row count is the number admitted before the first refusal
(:class:`~simsd.models.pages.PagesExhausted`).

* ``contiguous``: the engine today, a row of ``max_len`` slots per request: the same allocator
  with one page of ``max_len`` per row;
* ``paged``: pages of ``page_size`` slots.

Length mix: exponential with mean ``max_len / 4`` (seeded), clipped to ``[64, max_len]``; the
measured mean is reported. Rows go to ``--out`` (JSON with the settings) and a table to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from simsd.engine.memory import GIB, kv_cache_bytes  # noqa: E402
from simsd.models.pages import PageAllocator, PagesExhausted  # noqa: E402

#: (layers, kv heads, head_dim) of the SDAR checkpoints (Qwen3-8B / Qwen3-1.7B configs)
SHAPES = {"8b": (36, 8, 128), "1.7b": (28, 8, 128)}
MODEL_SETS = {"8b+1.7b": ("8b", "1.7b"), "8b": ("8b",)}


def token_bytes(name: str, dtype: str = "bfloat16") -> int:
    layers, kv, d = SHAPES[name]
    return kv_cache_bytes(SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=kv, head_dim=d), dtype, 1, 1)


def length_mix(n: int, max_len: int, seed: int) -> list:
    rng = random.Random(seed)
    return [min(max_len, max(64, int(rng.expovariate(4.0 / max_len)))) for _ in range(n)]


def concurrent(models: tuple, budget: int, page_size: int, max_len: int, lengths: list) -> dict:
    """Requests of ``lengths`` admitted (in order, until the first refusal) into one pool per model
    of ``page_size`` pages cut from ``budget`` bytes."""
    page_bytes = page_size * sum(token_bytes(m) for m in models)
    num_pages = budget // page_bytes
    rows = len(lengths)
    pools = [PageAllocator(num_pages, page_size, rows, -(-max_len // page_size)) for _ in models]
    admitted = 0
    for row, n in enumerate(lengths):
        try:
            for pool in pools:  # equal pools: the first refuses when any would
                pool.grow(row, n)
        except PagesExhausted:
            break
        admitted += 1
    used = pools[0].used_pages
    held = sum(lengths[:admitted])
    return {"num_pages": num_pages, "page_bytes": page_bytes, "requests": admitted, "pages_used": used,
            "slot_use": round(held / (used * page_size), 4) if used else 0.0}


def run(budget_gib: float, max_len: int, page_sizes: list, requests: int, seed: int) -> list:
    budget = int(budget_gib * GIB)
    lengths = length_mix(requests, max_len, seed)
    mean = sum(lengths) / len(lengths)
    rows = []
    for label, models in MODEL_SETS.items():
        base = concurrent(models, budget, max_len, max_len, lengths)
        if base["requests"] == requests:
            raise SystemExit(f"--requests {requests} all fit the contiguous layout of {label}: raise it")
        rows.append({"models": label, "layout": "contiguous", "page_size": max_len, **base, "ratio": 1.0})
        for p in page_sizes:
            got = concurrent(models, budget, p, max_len, lengths)
            if got["requests"] == requests:
                raise SystemExit(f"--requests {requests} all fit pages of {p} for {label}: raise it")
            rows.append({"models": label, "layout": "paged", "page_size": p, **got,
                         "ratio": round(got["requests"] / base["requests"], 2)})
    for r in rows:
        r.update(modelled=True, budget_gib=budget_gib, max_len=max_len, mean_len=round(mean, 1),
                 mean_over_max=round(mean / max_len, 3))
    return rows


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-gib", type=float, default=64.0, help="KV bytes of all models together, GiB")
    ap.add_argument("--max-len", type=int, default=32768, help="the longest request (a contiguous row's slots)")
    ap.add_argument("--page-sizes", default="16,64,256")
    ap.add_argument("--requests", type=int, default=4000, help="requests in the arrival order (more than fit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    rows = run(a.budget_gib, a.max_len, [int(p) for p in a.page_sizes.split(",")], a.requests, a.seed)
    print(f"modelled: {a.budget_gib} GiB of KV, max_len {a.max_len}, mean length {rows[0]['mean_len']} "
          f"({rows[0]['mean_over_max']} of max)")
    print(f"{'models':9} {'layout':11} {'page':>6} {'pages':>9} {'requests':>9} {'ratio':>6} {'slot use':>9}")
    for r in rows:
        print(f"{r['models']:9} {r['layout']:11} {r['page_size']:>6} {r['num_pages']:>9} {r['requests']:>9} "
              f"{r['ratio']:>6} {r['slot_use']:>9}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"settings": vars(a), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
