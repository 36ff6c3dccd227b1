"""Chunked prefill: how long a long prompt's admission stalls the rows that decode.

    python bench/bench_chunked_prefill.py [--modes vanilla,exact] [--chunk 32] [--chunks 32]
                                          [--rows 3] [--dtype float32] [--threads 1] [--out FILE]

The bundled tiny pair on the CPU through :class:`simsd.LLM` (its scheduler stepped on this
thread): ``--rows`` requests decode (short prompts, ``ignore_eos``, enough tokens to outlast the
long prefill); after a few rounds a prompt of ``--chunks x --chunk`` tokens (whole blocks, plus
one tail token) is submitted, with ``max_prefill_tokens`` unset (one prefill forward per model)
and with ``max_prefill_tokens = --chunk``. Reported per mode and setting, over the window from
the long prompt's submission to the end of its prefill:

* ``longest_pause_s``: the longest wall time between two consecutive forwards that advance a
  decoding row (the end of one to the end of the next, any decoding row; the forwards are timed
  around :meth:`BatchEngine.forward`); the goal of chunking is one chunk's forward plus one
  decoding forward and the round's host work;
* ``longest_block_gap_s``: the longest time between two consecutive finished blocks of one
  decoding row (the streams' view);
* ``chunk_forward_s``: the median wall time of one chunk forward of the target,
  ``prefill_forward_s``: the whole prefill's forward time summed (every model), and
  ``decode_forward_s``: the median decoding forward from the submission on;
* ``ttft_s``: the long prompt's time to first token (submission to its first finished block);
* ``prefill_rounds``: the forwards of the long prompt's prefill, and ``rounds``: the forwards in
  the window.

Every decoding row's tokens are checked equal across the two settings (a request's tokens do
not depend on the chunk size). Rows go to ``--out`` (JSON with the environment) and a table to
stdout.
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchlib import ROOT, environment, prompt_ids, set_threads, write_json
from simsd import LLM, SamplingParams
from simsd.assets import DEFAULT_TARGET


def around(times: list, start: float, end: float) -> list:
    """The gaps between consecutive ``times`` (sorted) from the last one before ``start`` (or
    ``start``) to the first one after ``end``."""
    before = [t for t in times if t < start][-1:] or [start]
    inside = [t for t in times if start <= t <= end]
    after = [t for t in times if t > end][:1]
    span = before + inside + after
    return [b - a for a, b in zip(span, span[1:])]


def measure(mode: str, chunk: int | None, args) -> dict:
    """One run: ``args.rows`` decoding requests, then the long prompt (module doc)."""
    llm = LLM(str(DEFAULT_TARGET), mode=mode, device="cpu", dtype=args.dtype, batch_size=args.rows + 1,
              max_prefill_tokens=chunk, scheduler_thread=False, max_waiting=args.rows + 1)
    L = llm.block_length
    sched, engine = llm.scheduler, llm.engine
    forwards, forward = [], engine.forward

    def timed(name, mask_mode, reqs):
        t0 = time.perf_counter()
        out = forward(name, mask_mode, reqs)
        forwards.append((t0, time.perf_counter(), sorted(reqs), any(r.prefill for r in reqs.values()), name))
        return out
    engine.forward = timed
    blocks: dict = {}  # row handle index -> finished-block times

    def listener(k):
        def on_event(kind, payload):
            if kind == "delta":
                blocks.setdefault(k, []).append(time.perf_counter())
        return on_event
    short, _ = prompt_ids(llm.get_tokenizer(), args.rows)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    handles = [llm.submit(ids, params, listener=listener(k)) for k, ids in enumerate(short)]
    for _ in range(24):  # the rows decode (each has finished a block)
        sched.step()
    if args.chunk % L:
        raise SystemExit(f"--chunk must be a multiple of the block length {L}")
    long = [5 + (7 * j) % 4000 for j in range(args.chunks * args.chunk + 1)]
    submitted = time.perf_counter()
    lone = llm.submit(long, SamplingParams(max_tokens=L, ignore_eos=True), listener=listener("long"))
    while sched.step():
        pass
    done = lone.request.admitted  # the end of its prefill
    if not all(h.request.finished > done for h in handles):
        raise SystemExit("a decoding request ended before the long prefill did: raise --max-tokens")
    ends = [f[1] for f in forwards if not f[3] and any(i != lone.request.row for i in f[2])]
    pauses = around(ends, submitted, done)
    gaps = [g for k in range(args.rows) for g in around(blocks[k], submitted, done)]
    window = [f for f in forwards if submitted <= f[0] and f[1] <= done]
    chunk_fw = [f[1] - f[0] for f in window if f[3]]
    target_chunks = [f[1] - f[0] for f in window if f[3] and f[4] == "target"]
    decode_fw = [f[1] - f[0] for f in forwards if f[0] >= submitted and not f[3]]
    assert all(h.request.error is None for h in handles + [lone])
    out = {"mode": mode, "max_prefill_tokens": chunk, "long_prompt_tokens": len(long), "rows": args.rows,
           "longest_pause_s": max(pauses), "longest_block_gap_s": max(gaps),
           "chunk_forward_s": statistics.median(target_chunks), "prefill_forward_s": sum(chunk_fw),
           "decode_forward_s": statistics.median(decode_fw),
           "ttft_s": blocks["long"][0] - submitted, "prefill_rounds": len(chunk_fw), "rounds": len(window),
           "tokens": [h.result().token_ids for h in handles]}
    llm.shutdown()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="vanilla,exact")
    ap.add_argument("--chunk", type=int, default=32, help="max_prefill_tokens of the chunked runs (whole blocks)")
    ap.add_argument("--chunks", type=int, default=32, help="the long prompt is this many chunks (plus one token)")
    ap.add_argument("--rows", type=int, default=3, help="requests decoding when the long prompt arrives")
    ap.add_argument("--max-tokens", type=int, default=400, help="tokens each decoding request generates")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "chunked_prefill_cpu_tiny_pair.json"))
    args = ap.parse_args(argv)
    set_threads(args.threads)
    rows = []
    for mode in args.modes.split(","):
        measure(mode, args.chunk, args)  # warm-up
        pair = [measure(mode, None, args), measure(mode, args.chunk, args)]
        if pair[0]["tokens"] != pair[1]["tokens"]:
            raise SystemExit(f"{mode}: the decoding rows' tokens depend on the chunk size")
        for r in pair:
            r.pop("tokens")
        rows += pair
    print(f"{'mode':8} {'chunk':>6} {'pause ms':>9} {'block gap ms':>13} {'chunk fwd ms':>13} {'decode fwd ms':>14} "
          f"{'prefill ms':>11} {'ttft ms':>8} {'prefill fwds':>13}")
    for r in rows:
        print(f"{r['mode']:8} {str(r['max_prefill_tokens']):>6} {1e3 * r['longest_pause_s']:9.1f} "
              f"{1e3 * r['longest_block_gap_s']:13.1f} {1e3 * r['chunk_forward_s']:13.1f} "
              f"{1e3 * r['decode_forward_s']:14.1f} {1e3 * r['prefill_forward_s']:11.1f} {1e3 * r['ttft_s']:8.1f} "
              f"{r['prefill_rounds']:13d}")
    settings = {k: getattr(args, k) for k in ("modes", "chunk", "chunks", "rows", "max_tokens", "dtype", "threads")}
    write_json(args.out, {"settings": settings, "environment": environment()}, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
