"""bench/bench_moe.py: forward kinds and experts touched on a tiny run (the counts, not the speed)."""
import json

import pytest

from tests.helpers import load_bench_script


def test_rows_and_table_on_a_tiny_run(tmp_path, capsys):
    bm = load_bench_script("bench_moe")
    out = tmp_path / "moe.json"
    assert bm.main(["--prompts", "1", "--max-new-tokens", "8", "--modes", "vanilla,exact", "--drafts", "self",
                    "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "experts/layer" in text and "verify" in text
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    E, K = rows["vanilla"]["num_experts"], rows["vanilla"]["experts_per_token"]
    for r in rows.values():
        assert r["new_tokens"] == 8
        for kind in r["kinds"].values():
            assert K <= kind["experts_touched"] <= E
            assert kind["experts_share"] == pytest.approx(kind["experts_touched"] / E)
    v, x = rows["vanilla"]["kinds"], rows["exact"]["kinds"]
    assert "verify" not in v and v["denoise"]["query_tokens"] == 4
    assert x["verify"]["query_tokens"] > v["denoise"]["query_tokens"]  # a verify forward carries copies
    assert rows["exact"]["acceptance_rate"] == 1.0  # the self draft
    assert rows["exact"]["target_forwards_per_token"] < rows["vanilla"]["target_forwards_per_token"]


def test_probe_counts_distinct_experts_per_forward():
    bm = load_bench_script("bench_moe")
    forwards = [("verify", 8, [3, 5]), ("verify", 8, [5, 5]), ("denoise", 4, [2, 2])]
    s = bm.summarise(forwards, 10)
    assert s["verify"] == {"forwards": 2, "query_tokens": 8, "experts_touched": 4.5, "experts_share": 0.45}
    assert s["denoise"]["experts_touched"] == 2


def test_bad_modes_are_refused(capsys):
    bm = load_bench_script("bench_moe")
    with pytest.raises(SystemExit):
        bm.main(["--modes", "vanila"])
    assert "--modes: vanila" in capsys.readouterr().err
