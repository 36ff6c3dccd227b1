"""The block-level prefix cache on a shared-system-prompt workload: prefill tokens computed and time
to first token, with and without the cache.

    python bench/bench_prefix_cache.py [--modes vanilla,exact] [--system 1024] [--requests 8]
                                       [--rows 4] [--page-size 16] [--dtype float32] [--threads 1]
                                       [--out FILE]

The bundled tiny pair on the CPU through :class:`simsd.LLM` (a KV page pool of ``--page-size``
tokens, its scheduler stepped on this thread). Every request is a ``--system``-token system prompt
(the held-out prompts' ids, repeated) followed by its own few tokens, 16 new tokens. One request
runs first (a server that has seen the system prompt before); then the other ``--requests - 1``
arrive at once on ``--rows`` rows. With ``enable_prefix_caching`` and without, reported per mode:

* ``prefill_tokens``: prompt tokens the target's prefill forwards computed (the engine's
  counter; the draft's are the same), over all requests, and ``system_computed``: that count
  over the system prompt's block-aligned length: the goal of the cache is 1 (the shared part
  computed once);
* ``prefix_hit_tokens``: prompt tokens found in the cache;
* ``ttft_s``: the mean time to first token of the requests that arrive together (submission to
  their first finished block), and ``wall_s``: their whole run.

Every request's tokens are checked equal with and without the cache (shape-invariant numerics,
``invariant=True``: a cached page holds the bits a prefill writes). Rows go to ``--out`` (JSON
with the environment) and a table to stdout.
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchlib import ROOT, environment, held_out_ids, set_threads, write_json
from simsd import LLM, SamplingParams
from simsd.assets import DEFAULT_TARGET


def measure(mode: str, cache: bool, system: list, args) -> dict:
    llm = LLM(str(DEFAULT_TARGET), mode=mode, device="cpu", dtype=args.dtype, batch_size=args.rows,
              page_size=args.page_size, enable_prefix_caching=cache, invariant=True, scheduler_thread=False,
              max_waiting=args.requests)
    prompts = [system + [40 + 3 * i, 41, 42 + i] for i in range(args.requests)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    first = llm.generate([prompts[0]], params)[0]
    t0 = time.perf_counter()
    outs = llm.generate(prompts[1:], params)
    wall = time.perf_counter() - t0
    m = llm.metrics()
    aligned = len(system) // llm.block_length * llm.block_length
    tokens = m["prefill_tokens"]["target"]
    llm.shutdown()
    return {"mode": mode, "prefix_caching": cache, "requests": args.requests, "system_tokens": len(system),
            "prefill_tokens": tokens, "system_computed": round(tokens / aligned, 2),
            "prefix_hit_tokens": m["kv_pages"]["prefix_hit_tokens"],
            "ttft_s": statistics.mean(o.stats["time_to_first_token"] for o in outs), "wall_s": wall,
            "token_ids": [first.token_ids] + [o.token_ids for o in outs]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="vanilla,exact")
    ap.add_argument("--system", type=int, default=1024, help="system prompt tokens")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefix_cache_cpu_tiny_pair.json"))
    args = ap.parse_args(argv)
    set_threads(args.threads)
    base = held_out_ids()
    system = (base * (args.system // len(base) + 1))[:args.system]
    rows = []
    for mode in args.modes.split(","):
        pair = [measure(mode, cache, system, args) for cache in (False, True)]
        if pair[0]["token_ids"] != pair[1]["token_ids"]:
            raise SystemExit(f"{mode}: the prefix cache changed a request's tokens")
        for r in pair:
            r["tokens_equal"] = True
            del r["token_ids"]
        rows += pair
    settings = {k: getattr(args, k) for k in ("modes", "system", "requests", "rows", "page_size", "dtype", "threads")}
    write_json(args.out, {"settings": settings, "environment": environment()}, rows)
    print(f"{'mode':8} {'cache':5} {'prefill tok':>11} {'system x':>8} {'hits':>6} {'ttft s':>7} {'wall s':>7}")
    for r in rows:
        print(f"{r['mode']:8} {str(r['prefix_caching']):5} {r['prefill_tokens']:>11} {r['system_computed']:>8} "
              f"{r['prefix_hit_tokens']:>6} {r['ttft_s']:>7.3f} {r['wall_s']:>7.3f}")


if __name__ == "__main__":
    main()
