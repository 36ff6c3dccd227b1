"""bench/bench_e2e.py: exits 0 without CUDA. Its code paths (the CPU smoke mode, every row kind,
a failed case among the others) run in the device script's test, tests/bench/test_device_run.py."""
import importlib.util
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


@pytest.mark.timeout(900)
def test_cpu_smoke_with_a_30b_a3b_shaped_moe_target(tmp_path):
    """``--target-shape 30b-a3b``: the random MoE target (tiny in the smoke mode) goes through every
    case; exact decoding gives vanilla's tokens on every prompt, the graph variants equal eager."""
    import json
    import os
    import subprocess
    import sys
    out = tmp_path / "e.jsonl"  # a subprocess: the smoke mode replaces the graph capture for its process
    env = dict(os.environ, OMP_NUM_THREADS="1", SIMSD_ATTENTION_BACKEND="torch")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--quick", "--target-shape", "30b-a3b",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert not [r for r in rows if r["kind"] == "error"]
    measured = {r["mode"]: r for r in rows if r["kind"] == "tokens_per_second" and r["pair"] == "random-30b-a3b/1.7b"}
    assert len(measured) == 6 and measured["exact"]["identical_to_vanilla"] == measured["exact"]["prompts"] >= 1
    assert all(measured[m + "+graphs"]["graphs_equal_eager"] for m in ("vanilla", "paper", "exact"))
    from simsd.models.moe import SparseMoeBlock
    mod = load()
    mod.DEV, mod.DTYPE = "cpu", "float32"
    model = mod.random_model("30b-a3b", 4)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)
    assert model.model.layers[0].mlp.experts.gate_up_proj.std() > 0.01


def test_target_shapes_are_a_comma_list():
    """The device script runs both random targets, one pair after the other (issue 34 item 2)."""
    mod = load()
    assert mod.parse_args(["--quick", "--target-shape", "8b,30b-a3b"]).target_shapes == ["8b", "30b-a3b"]
    assert mod.parse_args([]).target_shapes == ["8b"]
    with pytest.raises(SystemExit):
        mod.parse_args(["--target-shape", "8b,70b"])
