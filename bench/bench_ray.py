"""Ray benchmark (docs/scaling.md "Measured"): 1 vs 2 Ray Serve replicas and 1 vs 2 Ray Data workers
on the bundled pair, in one local Ray instance.

    OMP_NUM_THREADS=1 python bench/bench_ray.py [--cpus 2] [--requests 16] [--prompts 16]
                                                [--max-tokens 32] [--batch-size 4] [--mode exact]

Serve: ``simsd serve --ray --replicas R`` (its deployment, on 127.0.0.1 and a free port), one
warm-up request, then ``--requests`` sampled completions (the bundled held-out prompts in turn,
seed 1000 + i) sent all at once; requests/s = completed / wall time from the first send to the
last answer. Data: ``simsd generate --ray --num-workers W`` on ``--prompts`` held-out prompts
(prompt i with seed 1 + i); prompts/s = prompts / wall time of the whole map, the workers' start
and loading included (the figure a user sees). Each pair of rows also says whether their tokens
are identical (they must be: batch invariance). CPU numbers of the tiny pair: compare ratios
within one run; each replica or worker takes one of ``--cpus``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simsd.engine.tp import free_port  # noqa: E402
from simsd.entrypoints.cli import parse  # noqa: E402
from simsd.entrypoints.prompts import load_prompts  # noqa: E402


def bench_serve(replicas: int, a) -> tuple:
    """``(requests/s, [(text, token count)] per request)`` of ``replicas`` Ray Serve replicas."""
    import httpx
    from ray import serve

    from simsd.entrypoints.ray_serve import start
    args = parse(["serve", "--ray", "--replicas", str(replicas), "--mode", a.mode, "--batch-size",
                  str(a.batch_size), "--host", "127.0.0.1", "--port", str(free_port()), "--device", "cpu"])
    url = start(args)
    texts = [p.text for p in load_prompts("bundled")]
    bodies = [{"model": "tiny-sdar-target", "prompt": texts[i % len(texts)], "max_tokens": a.max_tokens,
               "temperature": 0.8, "seed": 1000 + i} for i in range(a.requests)]

    def post(body):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        c = r.json()["choices"][0]
        return c["text"], r.json()["usage"]["completion_tokens"]
    post(bodies[0])  # warm-up
    start_time = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(post, bodies))
    seconds = time.perf_counter() - start_time
    serve.shutdown()
    return len(bodies) / seconds, answers


def bench_data(workers: int, a) -> tuple:
    """``(prompts/s, [token ids] per prompt)`` of ``workers`` Ray Data workers."""
    from simsd.entrypoints.commands import prepare
    from simsd.entrypoints.ray_data import map_chunks
    args = parse(["generate", "--mode", a.mode, "--prompt-set", "bundled", "--limit", str(a.prompts),
                  "--max-tokens", str(a.max_tokens), "--temperature", "0.8", "--seed", "1", "--batch-size",
                  str(a.batch_size), "--device", "cpu", "--ray", "--num-workers", str(workers)])
    run = prepare(args, [a.mode])
    outs = [None] * len(run.prompts)
    start_time = time.perf_counter()
    for indices, chunk in map_chunks(run, {a.mode: (a.mode, "described")}, list(range(len(outs))), workers):
        for i, o in zip(indices, chunk[a.mode]):
            outs[i] = o.token_ids
    return len(outs) / (time.perf_counter() - start_time), outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--mode", default="exact")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args()
    import ray
    ray.init(num_cpus=a.cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    try:
        serve = {r: bench_serve(r, a) for r in (1, 2)}
        data = {w: bench_data(w, a) for w in (1, 2)}
    finally:
        ray.shutdown()
    print(f"# bundled pair, {a.mode} mode, sampled, max_tokens={a.max_tokens}, batch size {a.batch_size} per "
          f"replica/worker, {a.cpus} Ray CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print("| what | 1 | 2 | ratio 2/1 | tokens identical |")
    print("|---|---|---|---|---|")
    same = serve[1][1] == serve[2][1]
    print(f"| Ray Serve replicas: requests/s ({a.requests} concurrent) | {serve[1][0]:.2f} | {serve[2][0]:.2f} | "
          f"{serve[2][0] / serve[1][0]:.2f} | {same} |")
    same = data[1][1] == data[2][1]
    print(f"| Ray Data workers: prompts/s ({a.prompts} prompts, start included) | {data[1][0]:.2f} | "
          f"{data[2][0]:.2f} | {data[2][0] / data[1][0]:.2f} | {same} |")
    if a.json:
        import json
        import subprocess

        import ray as ray_module
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        rows = [{"what": "serve", "count": r, "requests_per_second": serve[r][0], "requests": a.requests}
                for r in (1, 2)] + [{"what": "data", "count": w, "prompts_per_second": data[w][0],
                                     "prompts": a.prompts} for w in (1, 2)]
        meta = {"mode": a.mode, "max_tokens": a.max_tokens, "batch_size": a.batch_size, "ray_cpus": a.cpus,
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "ray": ray_module.__version__,
                "git_sha": git, "load_average_1min": os.getloadavg()[0],
                "serve_tokens_identical": serve[1][1] == serve[2][1], "data_tokens_identical": same}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
