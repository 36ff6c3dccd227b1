"""bench/bench_serve.py: the load generator and its summary against an in-process server."""
import asyncio
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_serve.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_percentile():
    p = load().percentile
    assert p([], 50) is None and p([3.0], 99) == 3.0
    assert p([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and p(list(range(101)), 99) == 99


def test_poisson_load_against_a_server():
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from simsd import LLM
    from simsd.entrypoints.openai.api_server import build_app
    from tests.simsd.entrypoints.serving import running_server
    bench = load()
    llm = LLM(mode="vanilla", dtype="float32", device="cpu", batch_size=2)
    prompts = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Reverse a list."}]]
    with running_server(build_app(llm)) as url:
        before = bench.scrape(url)
        recs = asyncio.run(bench.run_load(url, "tiny-sdar-target", prompts, rate=50.0, n=3, time_limit=30,
                                          max_tokens=8))
        counters = bench.server_counters(before, bench.scrape(url))
    row = bench.summarize(recs)
    assert (row["sent"], row["completed"], row["refused"], row["failed"]) == (3, 3, 0, 0)
    assert 3 <= row["output_tokens"] <= 24 and row["requests_per_s"] > 0
    assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
    assert counters["target_forwards_per_token"] > 0 and counters["acceptance_rate"] is None
    assert 1 <= counters["rows_per_target_forward"] <= 2
