"""bench/bench_e2e.py: exits 0 without CUDA; its code paths run in the CPU smoke mode."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_e2e.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_e2e", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path of bench_e2e.py (a GPU runs the benchmark)")
def test_no_cuda_message(capsys, tmp_path):
    assert load().main(["--quick", "--out", str(tmp_path / "e.jsonl")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "e.jsonl").exists()


def test_cpu_smoke_rows(capsys, tmp_path, monkeypatch):
    import simsd.engine.graphs
    # restored after the test
    monkeypatch.setattr(simsd.engine.graphs, "cuda_capture", simsd.engine.graphs.cuda_capture)
    monkeypatch.setattr(simsd.engine.graphs, "check_graphable", simsd.engine.graphs.check_graphable)
    monkeypatch.setenv("SIMSD_ATTENTION_BACKEND", "torch")
    out = tmp_path / "e.jsonl"
    assert load().main(["--cpu-smoke", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    kinds = {r["kind"] for r in rows}
    assert kinds == {"latency", "modelled", "tokens_per_second"}
    assert all(r["git_sha"] is not None and "torch" in r for r in rows)
    assert all(r["modelled"] for r in rows if r["kind"] == "modelled")
    measured = {r["mode"]: r for r in rows if r["kind"] == "tokens_per_second"}
    assert set(measured) == {"vanilla", "vanilla+graphs", "paper", "paper+graphs", "exact", "exact+graphs"}
    assert measured["exact"]["identical_to_vanilla"] == measured["exact"]["prompts"]
    assert all(measured[m + "+graphs"]["graphs_equal_eager"] for m in ("vanilla", "paper", "exact"))
    assert "goal" in capsys.readouterr().out
