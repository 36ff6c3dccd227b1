"""bench/bench_kv_concurrency.py on a tiny setting: the rows it writes (timings are not asserted:
the shared CPU's load moves them), two contiguous rows' budget serving more requests at once
as pages, and every request's tokens equal between the layouts (the script refuses otherwise)."""
import json

from tests.helpers import load_bench_script


def test_two_rows_budget_as_pages_serves_more_requests(tmp_path):
    bench = load_bench_script("bench_kv_concurrency")
    out = tmp_path / "kvc.json"
    bench.main(["--requests", "6", "--rows", "2", "--max-model-len", "128", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["settings"]["rows"] == 2 and data["meta"]["environment"]["git_sha"]
    flat, paged = data["rows"]
    assert (flat["layout"], paged["layout"]) == ("contiguous", "paged")
    assert flat["peak_running"] == 2 and flat["pages"] is None and flat["kv_budget_bytes"] == paged["kv_budget_bytes"]
    assert paged["peak_running"] > 2 and paged["pages"] > 0 and paged["ratio"] == paged["peak_running"] / 2
    assert flat["tokens"] == paged["tokens"] and paged["tokens_equal"]
