"""bench/bench_chunked_prefill.py on a tiny setting: the rows it writes (timings are not asserted:
the shared CPU's load moves them), the long prompt's chunks interleaved with the decoding rows'
forwards, and the decoding rows' tokens equal with and without chunking (the script refuses
otherwise)."""
import json

from tests.helpers import load_bench_script


def test_rows_of_a_four_chunk_prompt(tmp_path):
    bench = load_bench_script("bench_chunked_prefill")
    out = tmp_path / "chunked.json"
    assert bench.main(["--modes", "vanilla", "--chunk", "16", "--chunks", "4", "--max-tokens", "80",
                       "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["settings"]["chunk"] == 16 and data["meta"]["environment"]["git_sha"]
    whole, chunked = data["rows"]
    assert (whole["max_prefill_tokens"], chunked["max_prefill_tokens"]) == (None, 16)
    assert whole["long_prompt_tokens"] == chunked["long_prompt_tokens"] == 4 * 16 + 1
    assert (whole["prefill_rounds"], chunked["prefill_rounds"]) == (1, 4)
    assert whole["rounds"] == 1 and chunked["rounds"] >= 2 * 4 - 1  # a decoding forward between two chunks
    for r in (whole, chunked):
        assert 0 < r["chunk_forward_s"] <= r["prefill_forward_s"] and r["longest_pause_s"] > 0
        assert r["ttft_s"] > 0 and r["longest_block_gap_s"] > 0 and r["decode_forward_s"] > 0
