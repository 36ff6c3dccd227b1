"""bench/bench_costmodel.py: modelled ms/token from a bench run's counters and the H200's measured
per-forward latencies (or a roofline), every row labelled as modelled."""
import json
from pathlib import Path

import pytest

from tests.helpers import load_bench_script


def test_interpolation_and_rows(tmp_path, capsys):
    cm = load_bench_script("bench_costmodel")
    pts = [(4, 6.0), (8, 6.4), (16, 7.2)]
    assert cm.interpolate(pts, 4) == 6.0 and cm.interpolate(pts, 6) == pytest.approx(6.2)
    assert cm.interpolate(pts, 32) == pytest.approx(8.8) and cm.interpolate([(4, 2.5)], 9) == 2.5
    bench = {"meta": {}, "rows": [
        {"mode": "vanilla", "target_forwards_per_token": 1.0, "draft_forwards_per_token": 0.0,
         "target_query_tokens_per_forward": 4.0},
        {"mode": "exact-self", "target_forwards_per_token": 0.5, "draft_forwards_per_token": 0.0,
         "target_query_tokens_per_forward": 16.0},
        {"mode": "exact", "target_forwards_per_token": 0.5, "draft_forwards_per_token": 2.0,
         "target_query_tokens_per_forward": 8.0}]}
    rows = cm.model_rows(bench, lambda role, q: cm.interpolate(pts if role == "target" else [(4, 2.5)], q))
    by = {r["mode"]: r for r in rows}
    assert all(r["modelled"] for r in rows)
    assert by["vanilla"]["ms_per_token"] == 6.0 and by["exact-self"]["ms_per_token"] == pytest.approx(3.6)
    assert by["exact"]["ms_per_token"] == pytest.approx(0.5 * 6.4 + 2 * 2.5)
    assert by["exact-self"]["speedup_vs_vanilla"] == pytest.approx(6.0 / 3.6)


RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_the_committed_results_model_on_the_h200(tmp_path, capsys):
    cm = load_bench_script("bench_costmodel")
    out, counters = tmp_path / "model.json", str(RESULTS / "cpu_tiny_pair_self_fold.json")
    assert cm.main([counters, "--latency", str(RESULTS / "device_h200" / "e2e.jsonl"), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["modelled"] and data["meta"]["model"] == "measured"
    assert {r["mode"] for r in data["rows"]} == {"vanilla", "exact", "exact-self"}
    assert "modelled (not measured)" in capsys.readouterr().out
    assert cm.main([counters, "--gpu", "h200"]) == 0
    with pytest.raises(SystemExit):
        cm.main([counters])  # neither --latency nor --gpu


def test_the_wide_exact_forwards_are_latency_points(tmp_path):
    """bench_e2e's ``verify_exact_16`` / ``_32`` rows (64 and 128 query tokens) are points of the
    target's t(q): the wide trees are interpolated, not extended from 16 query tokens."""
    cm = load_bench_script("bench_costmodel")
    rows = [("draft_step", 4, 3.0), ("vanilla_step", 4, 6.0), ("verify_exact", 16, 6.5), ("verify_exact_16", 64, 6.9),
            ("verify_exact_32", 128, 7.5), ("commit", 4, 5.0)]
    path = tmp_path / "e2e.jsonl"
    path.write_text("".join(json.dumps(dict(kind="latency", pair="random-8b/1.7b", mode="graphs", forward=f, Lq=q,
                                            ms=ms)) + "\n" for f, q, ms in rows))
    points = cm.measured_latency(path)
    assert points["target"] == [(4, 6.0), (16, 6.5), (64, 6.9), (128, 7.5)] and points["draft"] == [(4, 3.0)]
    assert cm.interpolate(points["target"], 96) == pytest.approx(7.2)
