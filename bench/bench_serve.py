"""Serving benchmark: a bounded Poisson load against ``simsd serve`` on localhost.

    python bench/bench_serve.py [--modes vanilla,exact] [--batch-sizes 1,4,8] [--rates 2,8]
                                [--requests 24] [--time-limit 120] [--max-tokens 48]
                                [--target DIR --draft DIR] [--device cpu] [--out FILE]

For each mode x batch limit (``--max-batch-size``) a fresh ``simsd serve`` process starts on
127.0.0.1 and a free port (only localhost is ever contacted); after one warm-up request, for
each rate, ``--requests`` streaming chat requests (the bundled held-out prompts in turn,
greedy, ``--max-tokens``) are sent at Poisson arrival times (exponential gaps, fixed seed);
no request is sent after ``--time-limit`` seconds and the run stops waiting at twice that.

Per run: ``requests_per_s`` (completed / wall time from the first send to the last token),
``output_tokens_per_s`` (completion tokens / the same time), time to first token (send to
the first streamed text, seconds) and per-token latency (``(last - first token time) /
(tokens - 1)`` per request, vLLM's TPOT) at p50/p99 over the requests, refusals (503) and
failures; from the server's ``/metrics``: ``target_forwards_per_token``, ``acceptance_rate``
and ``rows_per_target_forward`` (rows that shared a batched target forward, on average).
Greedy vanilla and exact produce the same tokens, so their rows compare the same work.

Rows go to ``--out`` (JSON with the settings, versions, git sha) and a table to stdout.
CPU numbers of the tiny pair measure the engine's scheduling, not a GPU's speed; compare
ratios within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="vanilla,exact")
    p.add_argument("--batch-sizes", default="1,4,8")
    p.add_argument("--rates", default="2,8", help="Poisson arrival rates, requests per second")
    p.add_argument("--requests", type=int, default=24, help="requests per run")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds of sending per run")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--out", default=os.path.join(HERE, "results", "cpu_serve_tiny_pair.json"))
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list, q: float):
    """The ``q``-th percentile (0-100, linear interpolation) or None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


async def one_request(client, url: str, model: str, messages: list, max_tokens: int) -> dict:
    """Send one streaming chat request; returns its timings and token count."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}
    rec = {"sent": time.perf_counter(), "first": None, "end": None, "tokens": 0, "status": None}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        rec["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            return rec
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                rec["status"] = 500
                break
            for c in chunk["choices"]:
                if c["delta"].get("content") and rec["first"] is None:
                    rec["first"] = time.perf_counter()
            if chunk.get("usage"):
                rec["tokens"] = chunk["usage"]["completion_tokens"]
    rec["end"] = time.perf_counter()
    return rec


async def run_load(url: str, model: str, prompts: list, rate: float, n: int, time_limit: float,
                   max_tokens: int, seed: int = 0, progress=None) -> list:
    """``n`` requests at Poisson arrivals of ``rate`` per second (none after ``time_limit`` s);
    returns one record per sent request."""
    import httpx
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(2 * time_limit + 60), limits=limits) as client:
        start, tasks = time.perf_counter(), []
        at = 0.0
        for i in range(n):
            at += rng.expovariate(rate)
            if at > time_limit:
                break
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            task = asyncio.ensure_future(one_request(client, url, model, prompts[i % len(prompts)], max_tokens))
            if progress is not None:
                task.add_done_callback(lambda _: progress.update())
            tasks.append(task)
        done, pending = await asyncio.wait(tasks, timeout=2 * time_limit + 60)
        for t in pending:
            t.cancel()
        return [t.result() if t in done and t.exception() is None else {"status": "timeout"} for t in tasks]


def summarize(records: list) -> dict:
    ok = [r for r in records if r.get("status") == 200 and r.get("end") is not None]
    row = {"sent": len(records), "completed": len(ok), "refused": sum(r.get("status") == 503 for r in records),
           "failed": len(records) - len(ok) - sum(r.get("status") == 503 for r in records)}
    if not ok:
        return row
    span = max(r["end"] for r in ok) - min(r["sent"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["first"] - r["sent"] for r in ok if r["first"] is not None]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["first"] is not None and r["tokens"] > 1]
    row.update({"duration_s": span, "output_tokens": tokens, "requests_per_s": len(ok) / span,
                "output_tokens_per_s": tokens / span, "ttft_p50_s": percentile(ttft, 50),
                "ttft_p99_s": percentile(ttft, 99), "tpot_p50_s": percentile(tpot, 50),
                "tpot_p99_s": percentile(tpot, 99)})
    return row


def scrape(url: str) -> dict:
    import httpx
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def server_counters(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    gen, row_fw = d.get("simsd_generation_tokens_total", 0), d.get("simsd_target_forwards_total", 0)
    batched = d.get('simsd_batched_forwards_total{model="target"}', 0)
    prop, acc = d.get("simsd_draft_tokens_proposed_total", 0), d.get("simsd_draft_tokens_accepted_total", 0)
    return {"target_forwards_per_token": row_fw / gen if gen else None,
            "acceptance_rate": acc / prop if prop else None,
            "rows_per_target_forward": row_fw / batched if batched else None}


def start_server(args, mode: str, batch: int):
    import httpx
    port = free_port()
    cmd = [sys.executable, "-m", "simsd.entrypoints.cli", "serve", "--port", str(port), "--mode", mode,
           "--max-batch-size", str(batch), "--max-waiting", str(args.requests + 8), "--device", args.device,
           "--log-level", "warning"]
    for flag, value in (("--target", args.target), ("--draft", None if mode == "vanilla" else args.draft),
                        ("--dtype", args.dtype)):
        if value:
            cmd += [flag, value]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 300
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"simsd serve exited: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("simsd serve did not become healthy in 300 s")


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                             timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx
    import torch
    from tqdm import tqdm

    from simsd.entrypoints.prompts import bundled_prompts
    prompts = [[{"role": "user", "content": p.text}] for p in bundled_prompts()]
    rows = []
    modes = [m for m in args.modes.split(",") if m]
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    rates = [float(r) for r in args.rates.split(",") if r]
    for mode in modes:
        for batch in batches:
            proc, url = start_server(args, mode, batch)
            try:
                model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
                asyncio.run(run_load(url, model, prompts, 100.0, 1, 60, args.max_tokens))  # warm-up
                for rate in rates:
                    before = scrape(url)
                    with tqdm(total=args.requests, desc=f"{mode} batch {batch} rate {rate:g}/s", unit="req",
                              file=sys.stderr) as bar:
                        recs = asyncio.run(run_load(url, model, prompts, rate, args.requests, args.time_limit,
                                                    args.max_tokens, args.seed, bar))
                    row = {"mode": mode, "max_batch_size": batch, "rate": rate, **summarize(recs),
                           **server_counters(before, scrape(url))}
                    rows.append(row)
            finally:
                proc.send_signal(2)  # SIGINT: drain and exit
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print_table(rows)
    meta = {"what": "bench/bench_serve.py", "argv": sys.argv[1:] if argv is None else argv,
            "settings": vars(args), "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "git_sha": git_sha(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"rows written to {args.out}")
    return 0


def print_table(rows: list) -> None:
    cols = [("mode", "{}"), ("max_batch_size", "{}"), ("rate", "{:g}"), ("completed", "{}"),
            ("requests_per_s", "{:.2f}"), ("output_tokens_per_s", "{:.1f}"), ("ttft_p50_s", "{:.3f}"),
            ("ttft_p99_s", "{:.3f}"), ("tpot_p50_s", "{:.4f}"), ("tpot_p99_s", "{:.4f}"),
            ("target_forwards_per_token", "{:.3f}"), ("rows_per_target_forward", "{:.2f}")]
    table = [[c for c, _ in cols]] + [[fmt.format(r[c]) if r.get(c) is not None else "-" for c, fmt in cols]
                                      for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    for t in table:
        print("  ".join(v.rjust(w) for v, w in zip(t, widths)))


if __name__ == "__main__":
    sys.exit(main())
