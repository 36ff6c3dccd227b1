"""The device script's helpers: test-shard outcomes, the final table's verdicts, the benchmark's
backend filter. (The script itself runs in CI as ``SIMSD_DEVICE_DRY_RUN=1 bash bench/device_run.sh``.)"""
import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shard_outcomes_and_counts():
    dt = load("device_tests")
    text = "\n".join([
        "tests/a.py::test_x[p 1] PASSED                      [ 10%]",
        "tests/a.py::test_y FAILED                          [ 20%]",
        "tests/a.py::test_z PASSED                          [ 30%]",
        "tests/a.py::test_z ERROR                           [ 30%]",  # teardown error after a pass
        "tests/b.py::test_s SKIPPED (needs a CUDA device)   [ 40%]",
        "FAILED tests/a.py::test_y - AssertionError: no",   # the -rfE summary line is not an outcome
    ])
    seen = dt.outcomes(text)
    assert seen == {"tests/a.py::test_x[p 1]": "PASSED", "tests/a.py::test_y": "FAILED",
                    "tests/a.py::test_z": "ERROR", "tests/b.py::test_s": "SKIPPED"}
    ids = {"g": list(seen) + ["tests/b.py::test_never"]}
    (g,) = dt.summarize({"g": []}, ids, seen, {}).values()
    assert (g["passed"], g["failed"], g["error"], g["skipped"], g["not_run"]) == (1, 1, 1, 1, 1)
    assert g["not_run_ids"] == ["tests/b.py::test_never"] and "tests/a.py::test_y" in g["failures"]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_verdicts(tmp_path):
    ds = load("device_summary")
    (tmp_path / "env.txt").write_text("NVIDIA H200\n")
    (tmp_path / "steps.txt").write_text("install 0 60 150\nimport-check 0 3 60\ncheck 0 20 60\nbench-e2e skip 0 90\n")
    (tmp_path / "install.log").write_text('BUILD_INFO {"cuda_extension": true, "archs": [90], "nvcc": "12.8"}\n')
    row = dict(dtype="bfloat16", head_dim=128, mask_mode="paper", cache="split", group=4, max_err=0.01, tol=0.03)
    _write(tmp_path / "check.jsonl", [dict(row, backend="cuda", status="pass"),
                                      dict(row, backend="triton", status="FAIL", max_err=0.5),
                                      dict(row, backend="auto", status="pass", resolved="cuda")])
    (tmp_path / "tests.json").write_text(json.dumps({"groups": {
        "cuda-kernels": dict(passed=300, failed=0, error=0, skipped=2, not_run=0, failures=[]),
        "engine": dict(passed=3, failed=0, error=0, skipped=0, not_run=4, failures=[])}}))
    case = dict(model="8b", layout="paper", block=4, batch=1, cache_len=4096)
    _write(tmp_path / "attention.jsonl", [
        dict(case, provider="sdpa-nomask", ms=0.02, valid=None, frac_4tbs=0.5),
        dict(case, provider="simsd-cuda", ms=0.03, valid=True, frac_4tbs=0.4),
        dict(case, provider="simsd-triton", ms=0.05, valid=False, frac_4tbs=0.2),
        dict(case, provider="flex", error="RuntimeError: not run: flex time budget of 25 s spent")])
    (tmp_path / "e2e.log").write_text("x.py:1: GraphCheckWarning: simsd: CUDA graph on cuda:0: the first replay ...\n")
    text, ok = ds.summary(str(tmp_path))
    verdict = {line[:44].strip(): line[45:53].strip() for line in text.splitlines()
               if line.startswith(("build:", "check:", "tests:", "bench:", "e2e", "self-checks"))}
    assert verdict["build: CUDA extension"] == "correct"
    assert verdict["check: cuda"] == "correct" and verdict["check: triton"] == "wrong"
    assert verdict["tests: CUDA kernels"] == "correct"
    assert verdict["tests: engine (graphs == eager, host reads)"] == "wrong", "tests left unrun are not a pass"
    assert verdict["bench: simsd-cuda"] == "correct" and verdict["bench: simsd-triton"] == "wrong"
    assert verdict["bench: flex"] == "not run" and verdict["e2e"] == "not run"
    assert verdict["self-checks during the benchmarks"] == "wrong"
    assert "time simsd-cuda / sdpa-nomask: median 1.50" in text
    assert "simsd-triton / sdpa-nomask" not in text, "an INVALID row gives no ratio"
    assert not ok and "NOT OK" in text


def test_summary_of_an_empty_run(tmp_path):
    ds = load("device_summary")
    text, ok = ds.summary(str(tmp_path))
    assert "not run" in text and ok
    assert ds.main([str(tmp_path / "missing")]) == 2


def test_bench_skips_backends_that_failed_the_check(tmp_path):
    ba = load("bench_attention")
    path = tmp_path / "check.jsonl"
    row = dict(dtype="bfloat16", head_dim=64, mask_mode="exact", cache="short", group=1)
    _write(path, [dict(row, backend="cuda", status="pass"), dict(row, backend="triton", status="FAIL", detail="x"),
                  dict(row, backend="auto", status="FAIL")])
    bad = ba.failed_backends(str(path))
    assert list(bad) == ["triton"] and "failed simsd check" in bad["triton"]
    providers = ba.build_providers("simsd-triton", bad)
    with pytest.raises(RuntimeError, match="failed simsd check"):
        providers["simsd-triton"]({})
