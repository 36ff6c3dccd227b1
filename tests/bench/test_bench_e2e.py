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
