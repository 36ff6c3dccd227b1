"""The device script and its helpers: test-shard outcomes and restarts, the final table's verdicts,
the benchmark's backend filter, and the script itself on the CPU with an injected failure in one
e2e case and one test group. (The whole script runs in CI as
``SIMSD_DEVICE_DRY_RUN=1 bash bench/device_run.sh``.)"""
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
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


def test_the_test_a_crash_killed_and_the_shards_of_each_group():
    dt = load("device_tests")
    log = "tests/a.py::test_x PASSED   [ 50%]\ntests/a.py::test_y Fatal Python error: Aborted\n\nThread 0x1 ..."
    assert dt.crashed_test(log, ["tests/a.py::test_y", "tests/a.py::test_z"]) == "tests/a.py::test_y"
    assert dt.crashed_test("collecting ...", ["tests/a.py::test_z"]) == "tests/a.py::test_z"
    shards = dt.deal({"big": [f"b{i}" for i in range(9)], "small": ["s0"], "empty": []}, 4)
    assert sorted(g for g, _ in shards) == ["big", "big", "big", "small"], "groups never share a shard"
    assert sorted(x for g, ids in shards if g == "big" for x in ids) == sorted(f"b{i}" for i in range(9))


def test_shards_are_dealt_by_cost_not_count():
    """Issue 34 item 4: the device run's groups (460 CUDA tests of a launch each, 144 Triton tests of
    a cold compile each, 14 engine tests of a model each) over 12 processes: by count the Triton group
    got 2 shards of 72 compiles; by cost every shard's estimate stays near the smallest possible."""
    dt = load("device_tests")
    ids = {"cuda": [f"c{i}" for i in range(460)], "triton": [f"t{i}" for i in range(144)],
           "engine": [f"e{i}" for i in range(14)]}
    cost = {"cuda": 0.05, "triton": 1.0, "engine": 8.0}
    shards = dt.deal(ids, 12, cost)
    share = {g: sum(1 for name, _ in shards if name == g) for g in ids}
    assert share == {"cuda": 1, "triton": 6, "engine": 5}, share
    longest = max(len(nids) * cost[g] for g, nids in shards)
    assert longest <= 24.0, longest  # seconds (estimated): the Triton shards' 24 tests, not 72
    for g in ids:  # every test dealt once
        assert sorted(x for name, nids in shards if name == g for x in nids) == sorted(ids[g])
    assert len(dt.deal({"few": ["a", "b"]}, 12, {"few": 5.0})) == 2, "never more shards than tests"
    with pytest.raises(SystemExit):
        dt.parse_args(["--log-dir", "x", "--group", "g=tests", "--cost", "h=2"])  # no such group


def _run_shards(tmp_path, body: str, *extra, env=None):
    """device_tests.py on one group of the tests in ``body`` (a test file): its JSON report and log."""
    (tmp_path / "test_sample.py").write_text(body)
    logs = tmp_path / "logs"
    cmd = [sys.executable, str(BENCH / "device_tests.py"), "--log-dir", str(logs), "--jobs", "1",
           "--group", f"g={tmp_path / 'test_sample.py'}", *extra]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    report = json.loads((logs / "tests.json").read_text())
    return report, (logs / "tests.log").read_text(), proc


SAMPLE = """
import time
def test_a(): pass
def test_b(): assert False, "planted"
def test_c(): pass
def test_d(): pass
"""


def test_a_failure_does_not_stop_its_shard(tmp_path):
    """The first device run stopped a shard at every failure (-x) and paid a process start (torch,
    the CUDA context) for each: 26 restarts in 140 s. A failure now costs no restart; only a broken
    CUDA context does (below)."""
    report, log, _ = _run_shards(tmp_path, SAMPLE)
    g = report["groups"]["g"]
    assert (g["passed"], g["failed"], g["error"], g["not_run"]) == (3, 1, 0, 0), g
    assert report["restarts"] == 0 and g["failures"] == ["test_sample.py::test_b"]


def test_a_broken_cuda_context_restarts_the_shard_without_blaming_a_crash(tmp_path):
    nid = "test_sample.py::test_b"  # node ids are relative to the shard's rootdir
    report, log, _ = _run_shards(tmp_path, SAMPLE, env={"SIMSD_DEVICE_BREAK_TEST": nid})
    g = report["groups"]["g"]
    assert (g["passed"], g["failed"], g["error"], g["not_run"]) == (3, 1, 0, 0), g
    assert report["restarts"] == 1 and "left the CUDA context broken" in log and "CRASHED" not in log


def test_the_test_running_at_the_deadline_is_not_run_not_crashed(tmp_path):
    """The first device run reported the CUDA test its deadline killed as ``crashed`` (an error)."""
    body = SAMPLE.replace('def test_c(): pass', 'def test_c(): time.sleep(60)')
    report, log, proc = _run_shards(tmp_path, body, "--timeout", "12")
    g = report["groups"]["g"]
    assert (g["passed"], g["failed"], g["error"]) == (1, 1, 0) and g["not_run"] == 2, g
    assert report["timed_out"] and "CRASHED" not in log and "(crashed)" not in json.dumps(g)
    assert proc.returncode == 1


def test_shards_run_with_one_thread_per_core_share(tmp_path):
    body = "import os\ndef test_threads(): assert os.environ['OMP_NUM_THREADS'] == str(max(1, os.cpu_count()))\n"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    (tmp_path / "test_sample.py").write_text(body)
    logs = tmp_path / "logs"
    subprocess.run([sys.executable, str(BENCH / "device_tests.py"), "--log-dir", str(logs), "--jobs", "1",
                    "--group", f"g={tmp_path / 'test_sample.py'}"], cwd=tmp_path, env=env, timeout=300)
    assert json.loads((logs / "tests.json").read_text())["groups"]["g"]["passed"] == 1


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_verdicts(tmp_path):
    ds = load("device_summary")
    (tmp_path / "env.txt").write_text("NVIDIA H200\n")
    (tmp_path / "steps.txt").write_text("install 0 60 150\nimport-check 0 3 60\ncheck 0 20 60\ntests 124 150 150\n"
                                        "bench-attention 1 9 70\nbench-e2e skip 0 90\n")
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
    tps = dict(kind="tokens_per_second", pair="random-8b/1.7b", prompts=2, tokens_per_second=10.0)
    _write(tmp_path / "e2e.jsonl", [dict(tps, mode="vanilla+graphs", identical_to_vanilla=2, case="tokens/s:v"),
                                    dict(tps, mode="exact+graphs", identical_to_vanilla=1, case="tokens/s:e"),
                                    dict(kind="error", pair="random-8b/1.7b", case="latency:verify_paper:graphs",
                                         error="RuntimeError: capture failed")])
    text, ok = ds.summary(str(tmp_path))
    verdict = {line[:44].strip(): line[45:53].strip() for line in text.splitlines()
               if line.startswith(("build:", "check:", "tests:", "bench:", "e2e", "self-checks"))}
    assert verdict["build: CUDA extension"] == "correct"
    assert verdict["check: cuda"] == "correct" and verdict["check: triton"] == "wrong"
    assert verdict["tests: CUDA kernels"] == "correct"
    assert verdict["tests: engine (graphs == eager, host reads)"] == "wrong", "tests left unrun are not a pass"
    assert verdict["bench: simsd-cuda"] == "correct" and verdict["bench: simsd-triton"] == "wrong"
    assert verdict["bench: flex"] == "not run"
    assert verdict["e2e: exact == vanilla tokens (info)"] == "info", "not promised on a GPU: information"
    assert "1/2 prompts identical" in text
    assert verdict["e2e: benchmark cases"] == "failed" and "latency:verify_paper:graphs" in text
    assert verdict["self-checks during the benchmarks"] == "wrong"
    status = {line.split()[0]: line.split()[1] for line in text.splitlines()[4:10] if line.strip()}
    assert status == {"install": "passed", "import-check": "passed", "check": "passed", "tests": "timed",
                      "bench-attention": "failed", "bench-e2e": "not"}
    assert "time simsd-cuda / sdpa-nomask: median 1.50" in text
    assert "simsd-triton / sdpa-nomask" not in text, "an INVALID row gives no ratio"
    assert not ok and "NOT OK" in text


def test_summary_of_an_empty_run(tmp_path):
    ds = load("device_summary")
    text, ok = ds.summary(str(tmp_path))
    assert "not run" in text and ok
    assert ds.main([str(tmp_path / "missing")]) == 2


def test_exact_differing_from_vanilla_is_information_not_a_failure(tmp_path):
    """docs/exactness.md: on a GPU the verify and denoise forwards run other tiles and GEMM kernels, so near-ties
    may flip; the count is reported, the correctness verdicts come from the checks and tests."""
    ds = load("device_summary")
    _write(tmp_path / "e2e.jsonl", [dict(kind="tokens_per_second", pair="p", mode=m, prompts=8, case=m,
                                         tokens_per_second=1.0, identical_to_vanilla=n)
                                    for m, n in (("vanilla", 8), ("exact", 5), ("exact+graphs", 6))])
    text, ok = ds.summary(str(tmp_path))
    assert ok and "11/16 prompts identical" in text and "NOT OK" not in text


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
    # a failed fused-MoE check (its own op) keeps the attention kernels benchmarked
    _write(path, [dict(row, backend="triton", status="pass"),
                  dict(op="fused_moe", backend="triton", dtype="bfloat16", status="FAIL", detail="case 3")])
    assert ba.failed_backends(str(path)) == {}


@pytest.mark.timeout(1500)  # two steps of the dry run: ~2 min alone on 2 cores, much more under load
def test_the_script_keeps_every_other_row_after_an_injected_failure(tmp_path):
    """The script itself (dry run, two steps): one e2e case raises and the first test of one group
    crashes its process; the other e2e rows, the other groups' results, the group's other tests and
    the summary survive, and at most 8 files come back, the logs with the tracebacks in the tarball.
    Also bench_e2e.py's CPU smoke rows of both random targets, the 8B-shaped and the 30B-A3B-shaped
    MoE one (its code paths; test_bench_e2e.py has the no-CUDA path), the door's and the fused MoE's
    test groups, and the environment file: versions (setuptools, NumPy) and the sha passed in to a
    copy without .git."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), SIMSD_DEVICE_DRY_RUN="1", PY=sys.executable, TMPDIR=str(tmp_path),
               SIMSD_DEVICE_STEPS="tests bench-e2e", SIMSD_ATTENTION_BACKEND="torch",
               SIMSD_DEVICE_INJECT="e2e:latency:verify_paper:graphs tests:triton-kernels",
               SIMSD_GIT_SHA="abc1234", GIT_DIR=str(tmp_path / "no-git"))
    proc = subprocess.run(["bash", str(BENCH / "device_run.sh")], env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["e2e.jsonl", "logs.tar.gz", "summary.txt", "tests.json"], files
    summary = (out / "summary.txt").read_text()
    assert proc.stdout.rstrip().endswith(summary.splitlines()[-1]) or summary.splitlines()[-1] in proc.stdout
    # e2e: the injected case failed, every other case has its rows
    rows = [json.loads(x) for x in (out / "e2e.jsonl").read_text().splitlines()]
    failed = [r for r in rows if r["kind"] == "error"]
    assert [(r["case"], r["pair"]) for r in failed] == [("latency:verify_paper:graphs", "random-8b/1.7b"),
                                                        ("latency:verify_paper:graphs", "random-30b-a3b/1.7b")]
    latency = {(r["forward"], r["mode"]) for r in rows if r["kind"] == "latency"}
    # 8 forwards (verify_exact of 4, 16 and 32 copies among them) x eager/graphs, less the injected failure
    assert len(latency) == 15 and ("verify_paper", "eager") in latency and ("verify_exact_32", "graphs") in latency
    assert {r["mode"] for r in rows if r["kind"] == "tokens_per_second" and r["pair"] != "bundled-tiny"} == \
        {"vanilla", "vanilla+graphs", "paper", "paper+graphs", "exact", "exact+graphs"}
    assert {r["mode"] for r in rows if r["kind"] == "modelled"} >= {"vanilla/graphs", "exact/graphs", "paper/eager"}
    assert all(r["git_sha"] == "abc1234" and "torch" in r for r in rows)
    assert all(r["modelled"] for r in rows if r["kind"] == "modelled")
    for pair in ("random-8b/1.7b", "random-30b-a3b/1.7b", "bundled-tiny"):
        measured = {r["mode"]: r for r in rows if r["kind"] == "tokens_per_second" and r["pair"] == pair}
        assert len(measured) == 6 and measured["exact"]["identical_to_vanilla"] == measured["exact"]["prompts"]
        assert all(measured[m + "+graphs"]["graphs_equal_eager"] for m in ("vanilla", "paper", "exact"))
    # tests: the crashed test is an error of its group, the group's other tests and the other groups ran
    groups = json.loads((out / "tests.json").read_text())["groups"]
    triton = groups["triton-kernels"]
    assert triton["error"] == 1 and triton["failures"][0].endswith("(crashed)") and triton["not_run"] == 0
    assert triton["passed"] == triton["collected"] - 1 >= 2, triton
    for name in ("engine", "door", "fused-moe"):
        assert groups[name]["passed"] >= 1 and not groups[name]["failures"], (name, groups[name])
    assert groups["fused-moe"]["collected"] == 3 and groups["door"]["collected"] >= 2  # bm64 x 3 dtypes; opcheck
    # the summary says what ran, what failed and why
    assert "tests: Triton kernels (GPU-compiled), ops    wrong" in summary
    assert "tests: engine (graphs == eager, host reads)  correct" in summary
    assert "tests: door (attention + append, opcheck)    correct" in summary
    assert "tests: fused MoE (16/32/64-row tiles)        correct" in summary
    assert "e2e: benchmark cases" in summary and "failed" in summary and "NOT OK" in summary
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
        assert {"env.txt", "steps.txt", "tests.log", "e2e.log"} <= names
        e2e_log = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("e2e.log"))).read().decode()
        tests_log = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("tests.log"))).read().decode()
        env_txt = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("env.txt"))).read().decode()
    assert "setuptools " in env_txt and "numpy " in env_txt and "triton interpreter: ok" in env_txt, env_txt
    assert "git abc1234\n" in env_txt, env_txt
    assert "Traceback" in e2e_log and "injected failure" in e2e_log and "goal" in e2e_log
    assert "CRASHED" in tests_log
