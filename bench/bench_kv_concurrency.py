"""Requests served together for a fixed KV budget, measured on the engine: contiguous rows vs pages.

    python bench/bench_kv_concurrency.py [--mode vanilla] [--max-model-len 512] [--rows 4]
                                         [--requests 24] [--page-size 16] [--seed 0]
                                         [--dtype float32] [--threads 1] [--out FILE]

The measured companion of ``bench/bench_kv_pages.py`` (which models SDAR-8B shapes): the bundled
tiny pair on the CPU through :class:`simsd.LLM`, its scheduler stepped on this thread. The KV budget
is ``--rows`` contiguous rows of ``--max-model-len`` positions (``kv_cache_memory`` = that many
rows' bytes, every model). ``--requests`` requests of a length mix (prompt + output: exponential
with mean ``max_model_len / 4``, seeded, clipped to ``[64, max_model_len]``; a 16-token prompt
from the bundled held-out prompts, ``ignore_eos``) are all submitted at once to

* ``contiguous``: ``batch_size = --requests`` within the budget: ``--rows`` rows of
  ``max_model_len`` positions each, whatever a request's real length;
* ``paged``: ``page_size = --page-size`` and the same budget as one pool of pages:
  ``batch_size = --requests`` rows, admitted while pages are free (the latest preempted when
  they run out).

Reported per layout: ``peak_running`` (the most requests decoding in one round), the mean over
rounds (``mean_running``), ``preemptions``, the pool's pages, ``wall_s`` and generated
``tokens_per_s``; every request's tokens are checked equal between the layouts (a request's
tokens do not depend on its neighbours or on being preempted). Rows go to ``--out`` (JSON with
the settings and environment) and a table to stdout.
"""
from __future__ import annotations

import argparse
import random
import time

from benchlib import ROOT, environment, held_out_ids, set_threads, write_json
from simsd import LLM, SamplingParams
from simsd.assets import DEFAULT_TARGET


def length_mix(n: int, max_len: int, seed: int) -> list:
    """``n`` request lengths (prompt + output): exponential with mean ``max_len / 4``, clipped."""
    rng = random.Random(seed)
    return [min(max_len, max(64, int(rng.expovariate(4.0 / max_len)))) for _ in range(n)]


def serve(layout: str, prompts: list, params: list, args) -> tuple:
    kw = dict(mode=args.mode, device="cpu", dtype=args.dtype, max_model_len=args.max_model_len,
              batch_size=len(prompts), max_waiting=len(prompts), scheduler_thread=False)
    probe = LLM(str(DEFAULT_TARGET), batch_size=1, **{k: v for k, v in kw.items() if k != "batch_size"})
    budget = args.rows * probe.engine.caches["target"].max_len * sum(
        2 * m.config.num_hidden_layers * m.config.num_key_value_heads * m.config.head_dim * m.dtype.itemsize
        for m in probe.engine.models.values())
    probe.shutdown()
    if layout == "paged":
        kw["page_size"] = args.page_size
    llm = LLM(str(DEFAULT_TARGET), kv_cache_memory=budget, **kw)
    handles = [llm.submit(p, q) for p, q in zip(prompts, params)]
    running, t0 = [], time.perf_counter()
    while not all(h.done for h in handles):
        llm.scheduler.step()
        running.append(llm.scheduler.num_running)
    wall = time.perf_counter() - t0
    outs = [h.result() for h in handles]
    m = llm.metrics()
    pages = m["kv_pages"]
    tokens = sum(len(o.token_ids) for o in outs)
    row = {"layout": layout, "rows": llm.batch_size if pages is None else len(prompts),
           "kv_budget_bytes": int(budget), "pages": None if pages is None else pages["target"]["pages_total"],
           "peak_running": max(running), "mean_running": round(sum(running) / len(running), 2),
           "preemptions": m["preemptions"], "rounds": len(running), "wall_s": round(wall, 3),
           "tokens": tokens, "tokens_per_s": round(tokens / wall, 1)}
    llm.shutdown()
    return row, [o.token_ids for o in outs]


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="vanilla")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--rows", type=int, default=4, help="the KV budget, in contiguous rows")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_concurrency_cpu_tiny_pair.json"))
    args = ap.parse_args(argv)
    set_threads(args.threads)
    base = held_out_ids()
    lengths = length_mix(args.requests, args.max_model_len, args.seed)
    prompts = [base[7 * i:7 * i + 16] for i in range(args.requests)]
    params = [SamplingParams(max_tokens=n - 16, ignore_eos=True, temperature=1.0, seed=args.seed + i)
              for i, n in enumerate(lengths)]
    (flat, want), (paged, got) = (serve(layout, prompts, params, args) for layout in ("contiguous", "paged"))
    if got != want:
        raise SystemExit("a request's tokens differ between the layouts")
    rows = [flat, paged]
    mean = sum(lengths) / len(lengths)
    for r in rows:
        r.update(mean_len=round(mean, 1), mean_over_max=round(mean / args.max_model_len, 3), tokens_equal=True,
                 ratio=round(r["peak_running"] / flat["peak_running"], 2))
    write_json(args.out, {"settings": vars(args), "environment": environment()}, rows)
    print(f"KV budget: {args.rows} rows of {args.max_model_len} positions; {args.requests} requests, mean length "
          f"{mean:.0f} ({mean / args.max_model_len:.2f} of max)")
    print(f"{'layout':11} {'pages':>6} {'peak':>5} {'mean':>6} {'preempt':>8} {'ratio':>6} {'wall s':>7} {'tok/s':>7}")
    for r in rows:
        print(f"{r['layout']:11} {str(r['pages'] or '-'):>6} {r['peak_running']:>5} {r['mean_running']:>6} "
              f"{r['preemptions']:>8} {r['ratio']:>6} {r['wall_s']:>7} {r['tokens_per_s']:>7}")
    return rows


if __name__ == "__main__":
    main()
