"""bench/bench_prefix_cache.py on a tiny setting: the rows it writes (timings are not asserted: the
shared CPU's load moves them), the system prompt computed once with the cache and once per request
without it, and every request's tokens equal with and without the cache (the script refuses
otherwise)."""
import json

from tests.helpers import load_bench_script


def test_a_system_prompt_is_computed_once_with_the_cache(tmp_path):
    bench = load_bench_script("bench_prefix_cache")
    out = tmp_path / "prefix.json"
    bench.main(["--modes", "vanilla", "--system", "70", "--requests", "3", "--rows", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["settings"]["system"] == 70 and data["meta"]["environment"]["git_sha"]
    plain, cached = data["rows"]
    assert (plain["prefix_caching"], cached["prefix_caching"]) == (False, True)
    # 70 tokens, blocks of 4: 68 prefilled per request (72 with a request's own 3 tokens: 18 blocks)
    assert plain["prefill_tokens"] == 3 * 72 and plain["prefix_hit_tokens"] == 0
    assert cached["prefix_hit_tokens"] == 2 * 64  # four whole pages of 16 each for the two later requests
    assert cached["prefill_tokens"] == 3 * 72 - 2 * 64
    assert plain["tokens_equal"] and cached["tokens_equal"] and cached["ttft_s"] > 0 and plain["wall_s"] > 0
