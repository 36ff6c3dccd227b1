"""bench/bench_kv_pages.py: the memory model computed from the page allocator."""
from bench.bench_kv_pages import concurrent, length_mix, run, token_bytes


def test_rows_come_from_the_allocator_and_pages_serve_3x_a_quarter_length_mix():
    rows = run(budget_gib=64, max_len=32768, page_sizes=[64], requests=4000, seed=0)
    assert all(r["modelled"] for r in rows)
    assert 0.23 < rows[0]["mean_over_max"] < 0.27  # the mix's mean is a quarter of the maximum
    by = {(r["models"], r["layout"]): r for r in rows}
    pair = by[("8b+1.7b", "contiguous")]
    # 64 GiB over 32k-slot rows of 8B + 1.7B bf16 KV (147456 + 114688 bytes per token): 8 rows
    assert token_bytes("8b") == 147456 and token_bytes("1.7b") == 114688
    assert pair["num_pages"] == pair["requests"] == 64 * 2 ** 30 // (32768 * (147456 + 114688))
    for models in ("8b+1.7b", "8b"):
        assert by[(models, "paged")]["ratio"] >= 3.0, by[(models, "paged")]


def test_admission_stops_at_the_first_request_that_does_not_fit():
    per_token = token_bytes("8b")
    budget = 10 * 16 * per_token  # ten pages of 16 slots
    got = concurrent(("8b",), budget, 16, 64, [16, 40, 48, 64, 1])  # 1 + 3 + 3 pages; 64 needs 4 of 3 left
    assert got["num_pages"] == 10 and got["requests"] == 3 and got["pages_used"] == 7
    got = concurrent(("8b",), budget, 16, 64, [64, 64, 64])  # 4 pages each
    assert got["requests"] == 2
    assert length_mix(5, 1000, 1) == length_mix(5, 1000, 1)
