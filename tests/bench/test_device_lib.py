"""bench/device_lib.sh (the device script's log packs and step limits) sourced alone, and the device
script's plan (``SIMSD_DEVICE_PLAN=1``: its test groups, costs and benchmark options, nothing run) on
the GPU branch and the dry run's, without a GPU (issue 34 items 2-4 and 6)."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "bench" / "device_lib.sh"


def bash(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f". {LIB}\n{script}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, **env))


def test_concurrent_packs_each_leave_one_whole_archive(tmp_path):
    """Steps in the background pack while the install step packs: eight packs at once, while a log
    grows, each succeed and leave one readable archive of every log, and nothing else, in OUT."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    logs.mkdir()
    out.mkdir()
    for i in range(4):
        (logs / f"big{i}.log").write_bytes(os.urandom(2_000_000))  # incompressible: each tar takes a while
    (logs / "steps.txt").write_text("env 0 1 10\n")
    res = bash("""
        ( for i in $(seq 200); do echo "line $i" >> "$LOGS/check.log"; sleep 0.01; done ) &
        writer=$!
        pids=()
        for i in 1 2 3 4 5 6 7 8; do pack & pids+=($!); done
        bad=0
        for p in "${pids[@]}"; do wait "$p" || bad=$((bad + 1)); done
        kill "$writer" 2>/dev/null; wait "$writer" 2>/dev/null
        echo "failed packs: $bad"
        pack && echo "final pack ok"
    """, LOGS=str(logs), OUT=str(out))
    assert "failed packs: 0" in res.stdout and "final pack ok" in res.stdout, res.stdout + res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
        assert {"big0.log", "big3.log", "steps.txt", "check.log"} <= names
        assert tar.extractfile("./big2.log").read() == (logs / "big2.log").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "out"], "no temporary archive or lock left"


def test_every_step_before_bench_e2e_leaves_it_its_floor():
    """bench-e2e comes last: the earlier steps' limits are cut so that it keeps E2E_FLOOR seconds of
    the budget (before, a late step absorbed every overrun); it takes what is left itself."""
    res = bash("""
        wanted() { [ "$STEPS" = all ] || [[ " $STEPS " == *" $1 "* ]]; }
        DEADLINE=$(( $(date +%s) + 100 )) RESERVE=8 E2E_FLOOR=60
        STEPS=all
        echo "tests $(step_limit tests 150) bench-attention $(step_limit bench-attention 20)" \
            "e2e $(step_limit bench-e2e 120)"
        STEPS="tests check"
        echo "alone $(step_limit tests 150)"
    """)
    first, alone = res.stdout.splitlines()
    got = dict(zip(first.split()[::2], map(int, first.split()[1::2])))
    assert 30 <= got["tests"] <= 32 and got["bench-attention"] == 20 and 90 <= got["e2e"] <= 92, got
    assert 90 <= int(alone.split()[1]) <= 92, "without bench-e2e to come, no floor is kept"


def plan(tmp_path, **env) -> dict:
    """``SIMSD_DEVICE_PLAN=1 bash bench/device_run.sh``: ``{group name: pytest args, "costs": ..., ...}``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SIMSD_")}
    full.update(OUT=str(tmp_path / "out"), SIMSD_DEVICE_PLAN="1", **env)
    res = subprocess.run(["bash", str(ROOT / "bench" / "device_run.sh")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=full)
    assert res.returncode == 0, res.stdout + res.stderr
    got = {}
    for line in res.stdout.splitlines():
        key, _, rest = line.partition(" ")
        if key == "group":
            name, _, args = rest.partition("=")
            got[name] = " ".join(args.split())
        else:
            got[key] = rest
    assert not any((tmp_path / "out").iterdir()), "the plan runs nothing"
    return got


def test_the_gpu_run_tests_the_door_and_the_fused_moe_and_benchmarks_the_moe_target(tmp_path):
    """The GPU branch (no dry run): the door's and the fused MoE's tests are groups of their own
    (before: in no group), every group has a cost, bench_e2e runs the 30B-A3B-shaped target too."""
    p = plan(tmp_path, SIMSD_GIT_SHA="0ea1f32")
    assert p["door"] == "tests/kernels/test_door.py tests/kernels/test_paged_door.py"  # the paged door too
    assert p["fused-moe"] == "tests/kernels/test_fused_moe.py"
    assert p["engine"] == "-m gpu tests/simsd"
    for name in ("cuda-kernels", "triton-kernels", "door", "fused-moe", "engine"):
        assert f"--cost {name}=" in p["costs"], name
    assert "--quick --target-shape 8b,30b-a3b" in p["bench-e2e"]
    assert p["budget"].split() == ["570", "floor", "60", "sha", "0ea1f32"]


def test_a_copy_without_git_takes_the_sha_it_is_given(tmp_path, monkeypatch):
    """The lender copies the working tree without .git: the sha passed in is the run's (env.txt, the
    rows through simsd.entrypoints.bench.git_sha, the build record), else "none"."""
    nogit = dict(GIT_DIR=str(tmp_path / "no-such-git-dir"))
    assert plan(tmp_path, **nogit)["budget"].endswith("sha none")
    assert plan(tmp_path, SIMSD_GIT_SHA="abc1234", **nogit)["budget"].endswith("sha abc1234")
    from simsd.entrypoints.bench import git_sha
    monkeypatch.setenv("SIMSD_GIT_SHA", "abc1234")
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "no-such-git-dir"))
    assert git_sha() == "abc1234"
    monkeypatch.delenv("SIMSD_GIT_SHA")
    assert git_sha() == ""


def test_the_dry_run_groups_collect_the_door_and_a_bm64_fused_moe_case(tmp_path):
    p = plan(tmp_path, SIMSD_DEVICE_DRY_RUN="1")
    assert "--target-shape 8b,30b-a3b" in p["bench-e2e"]
    for name, want in (("door", "test_opcheck_attention_with_kvcache"), ("fused-moe", "[bm64-bfloat16]")):
        res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=",
                              "--collect-only", "-q", *p[name].split()], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        ids = [x for x in res.stdout.splitlines() if "::" in x]
        assert ids and any(want in x for x in ids), (name, res.stdout[-2000:])


@pytest.mark.parametrize("name,label", [("door", "tests: door (attention + append, opcheck)"),
                                        ("fused-moe", "tests: fused MoE (16/32/64-row tiles)")])
def test_the_summary_names_the_new_groups(tmp_path, name, label):
    """A failure in the door's or the fused MoE's group is a wrong path of its own name."""
    import importlib.util
    import json
    spec = importlib.util.spec_from_file_location("device_summary", ROOT / "bench" / "device_summary.py")
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    (tmp_path / "tests.json").write_text(json.dumps({"groups": {name: dict(
        passed=40, failed=1, error=0, skipped=0, not_run=0, failures=[f"tests/kernels/x.py::test_{name}"])}}))
    text, ok = ds.summary(str(tmp_path))
    line = next(x for x in text.splitlines() if x.startswith(label))
    assert line[45:53].strip() == "wrong" and f"test_{name}" in line and not ok
