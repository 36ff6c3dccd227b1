"""``simsd check`` / ``python -m simsd_kernels.check`` on the CPU: torch, the Triton interpreter,
``auto``, a deliberately wrong registered backend, unsupported head dims, bad options."""
import json

import pytest
import torch

from simsd_kernels import backends, check
from tests.kernels.helpers import function_backend, torch_attention

SMALL = ["--dtypes", "float32,bfloat16", "--head-dims", "64,96", "--mask-modes", "paper,exact", "--groups", "4",
         "--caches", "empty,short"]


def _rows(out: str, op: str = "attention") -> list:
    """The ``--json`` rows of ``op`` (attention rows carry no ``op``; the fused MoE's ``op: fused_moe``)."""
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r for r in rows if r.get("op", "attention") == op]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.delenv(backends.TRUST_ENV_VAR, raising=False)
    yield
    backends.reset()


def test_quick_default_set_torch_triton_auto(capsys):
    """No axis option: the quick set, every dtype, head dim, mask mode, cache and group at least
    once per backend, and every row right."""
    pytest.importorskip("triton")
    names = ["torch", "auto"] + (["triton"] if backends.availability("triton", torch.device("cpu"))[0] else [])
    code = check.main(["--device", "cpu", "--backends", ",".join(names), "--json"])
    out, err = capsys.readouterr()
    rows = _rows(out)
    assert code == 0, err
    assert len(rows) == len(names) * len(check.QUICK)
    by = lambda **kw: [r for r in rows if all(r[k] == v for k, v in kw.items())]  # noqa: E731
    for name in names:
        mine = by(backend=name)
        for key, values in (("dtype", check.DTYPES), ("head_dim", check.HEAD_DIMS), ("mask_mode", check.MODES),
                            ("cache", tuple(check.CACHES)), ("group", check.GROUPS)):
            assert {r[key] for r in mine} == set(values), (name, key)
    assert all(r["status"] == "pass" and r["max_err"] <= r["tol"] for r in by(head_dim=64) + by(head_dim=128))
    assert all(r["status"] == "pass" and r["resolved"] == "torch" for r in by(backend="auto"))
    assert all(r["status"] == "pass" for r in by(backend="torch"))
    if "triton" in names:  # head_dim 96: the kernel refuses it by name, auto ran torch (above)
        assert {r["status"] for r in by(backend="triton", head_dim=96)} == {"refused"}
        assert all("head_dim" in r["detail"] for r in by(backend="triton", head_dim=96))
        assert all(r["us"] > 0 for r in by(backend="triton", head_dim=64))
    bf16 = by(dtype="bfloat16", backend="torch")
    assert bf16 and all(1e-4 < r["max_err"] < 5e-2 for r in bf16), \
        "bf16 errors are bf16-sized (the reference is float64)"
    assert f"# torch: {len(check.QUICK)} pass, 0 FAIL, 0 refused (of {len(check.QUICK)})" in err
    assert f"rows, the quick set (--full: the full matrix, {check.FULL_ROWS * len(names)} rows)" in err
    assert "backend  ->" in err  # the table went to stderr
    for dtype in check.DTYPES:  # the fused MoE op's self-check lines (auto: torch on the CPU)
        assert f"# fused MoE auto   -> torch  {dtype:9} pass" in err
        if "triton" in names:
            assert f"# fused MoE triton -> triton {dtype:9} pass" in err
    moe_rows = {(r["backend"], r["dtype"]): r for r in _rows(out, "fused_moe")}
    assert set(moe_rows) == {(n, d) for n in ("triton", "auto") if n in names for d in check.DTYPES}
    assert all(r["status"] == "pass" and r["max_err"] <= r["tol"] for r in moe_rows.values())


def test_a_failed_fused_moe_check_is_a_json_row_naming_its_path(capsys, monkeypatch, tmp_path):
    """Issue 34 item 6: a fused-MoE check failure was a ``# fused MoE`` line on stderr only, so the
    device run's table said NOT OK without a path; now it is a row, and the table names it."""
    import importlib.util
    from pathlib import Path

    from simsd_kernels import moe
    from simsd_kernels.selfcheck import CheckResult
    monkeypatch.setattr(moe, "check_fused_moe", lambda run, device, dtype: CheckResult(
        False, float("nan"), float("nan"), "case 3: shape (100, 96), dtype torch.bfloat16 or non-finite values"))
    code = check.main(["--device", "cpu", "--backends", "torch,auto", "--dtypes", "bfloat16", "--head-dims", "64",
                       "--mask-modes", "exact", "--groups", "1", "--caches", "empty", "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 1 and all(r["status"] == "pass" for r in _rows(out))
    (row,) = _rows(out, "fused_moe")
    assert row == dict(op="fused_moe", backend="auto", device="cpu", resolved="torch", dtype="bfloat16", status="FAIL",
                       max_err=None, tol=None, detail="case 3: shape (100, 96), dtype torch.bfloat16 or non-finite "
                                                      "values")
    (tmp_path / "check.jsonl").write_text(out)
    spec = importlib.util.spec_from_file_location(
        "device_summary", Path(__file__).resolve().parents[2] / "bench" / "device_summary.py")
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    text, ok = ds.summary(str(tmp_path))
    line = next(x for x in text.splitlines() if x.startswith("check: fused MoE auto"))
    assert line[45:53].strip() == "wrong" and "FAIL bfloat16: case 3" in line and not ok
    assert "paths: check: fused MoE auto wrong" in text
    assert next(x for x in text.splitlines() if x.startswith("check: torch"))[45:53].strip() == "correct"


def test_axis_options_run_their_product(capsys):
    code = check.main(["--device", "cpu", "--backends", "torch", "--json", *SMALL])
    out, err = capsys.readouterr()
    rows = _rows(out)
    assert code == 0, err
    assert len(rows) == 2 * 2 * 2 * 2 and all(r["status"] == "pass" for r in rows)
    assert {(r["dtype"], r["head_dim"], r["mask_mode"], r["cache"]) for r in rows} == {
        (dt, d, m, c) for dt in ("float32", "bfloat16") for d in (64, 96) for m in ("paper", "exact")
        for c in ("empty", "short")}
    assert "16 rows, the product of the chosen axes" in err


def _args(argv):
    import argparse
    p = argparse.ArgumentParser()
    check.add_arguments(p)
    return p.parse_args(argv)


def test_full_is_the_product_of_every_axis():
    _, chosen, _, tasks = check.plan(_args(["--device", "cpu", "--backends", "torch,auto", "--full"]))
    assert chosen == ["torch", "auto"]
    got = sorted((b, dt, d, m, g, c) for b, dt, d, m, g, caches in tasks for c in caches)
    want = sorted((b, dt, d, m, g, c) for b in chosen for dt in check.DTYPES for d in check.HEAD_DIMS
                  for m in check.MODES for g in check.GROUPS for c in check.CACHES)
    assert got == want and len(got) == 2 * check.FULL_ROWS == 2 * 288
    _, _, _, quick = check.plan(_args(["--device", "cpu", "--backends", "torch,auto"]))
    assert [t[1:5] + t[5] for t in quick] == [tuple(q) for q in check.QUICK] * 2


def test_rows_are_printed_as_they_finish(capsys, monkeypatch):
    """Each row is on stdout (the table) before the next configuration starts, after the header
    lines; the summary comes last. The configurations themselves are stand-ins here (the rows'
    contents are checked by the tests above)."""
    seen = []

    def fake_worker(payload):
        task = payload[0]
        seen.append(capsys.readouterr().out)  # what was printed before this configuration ran
        return [dict(backend=task[0], device="cpu", dtype=task[1], head_dim=task[2], mask_mode=task[3],
                     group=task[4], cache=c, resolved=task[0], status="pass", max_err=0.0, tol=1.0, us=1.0)
                for c in task[5]]
    monkeypatch.setattr(check, "_worker", fake_worker)
    assert check.main(["--device", "cpu", "--backends", "torch", "--full"]) == 0
    tail = capsys.readouterr().out
    assert len(seen) == check.FULL_ROWS // len(check.CACHES)
    assert "# 288 rows, the full matrix; each row is printed as it finishes" in seen[0]
    assert check.HEADER in seen[0] and "# torch:" not in seen[0]
    for printed in seen[1:]:  # exactly the previous configuration's rows, one per cache
        lines = printed.splitlines()
        assert len(lines) == len(check.CACHES) and all(x.startswith("torch    torch ") for x in lines), printed
    assert "# torch: 288 pass, 0 FAIL, 0 refused (of 288)" in tail


def test_a_wrong_backend_fails_its_rows_and_auto_avoids_it(capsys):
    def wrong(q, k, v, kc, vc, lens, labels, pos, mode, theta, scale):
        out = torch_attention(q, k, v, kc, vc, lens, labels, pos, mode, theta, scale)
        out[:, -1] = 0  # the last new token's output is lost
        return out
    backends.register_backend(function_backend("wrong", wrong), auto_rank=0)
    try:
        code = check.main(["--device", "cpu", "--backends", "wrong,auto", "--dtypes", "float32", "--head-dims", "64",
                           "--mask-modes", "paper", "--groups", "1", "--caches", "short"])
    finally:
        backends.unregister_backend("wrong")
    out = capsys.readouterr().out
    assert code == 1
    lines = [line for line in out.splitlines() if line.startswith(("wrong ", "auto "))]
    assert len(lines) == 2
    assert " FAIL " in lines[0] and " pass " in lines[1] and lines[1].split()[1] == "torch"
    assert "# FAIL wrong float32 D=64 paper short G=1: max error" in out
    assert "# wrong: 0 pass, 1 FAIL" in out


def test_table_without_json(capsys):
    assert check.main(["--device", "cpu", "--backends", "torch", "--dtypes", "float16", "--head-dims", "128",
                       "--mask-modes", "block_causal", "--groups", "1", "--caches", "split", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("torch ")]
    assert line.split()[:8] == ["torch", "torch", "float16", "128", "block_causal", "split", "1", "pass"]


@pytest.mark.parametrize("argv,needle", [
    (["--dtypes", "float64"], "--dtypes: 'float64' is not one of"),
    (["--mask-modes", "causal"], "--mask-modes: 'causal'"),
    (["--head-dims", "63"], "--head-dims"),
    (["--caches", ""], "--caches is empty"),
    (["--groups", "0"], "--groups must be >= 1"),
    (["--backends", "cuda"], "--backends: 'cuda' cannot run on cpu"),
    (["--backends", "nope"], "--backends: 'nope' is not one of"),
])
def test_bad_options_are_one_line_errors(capsys, argv, needle):
    from simsd.entrypoints.cli import main
    assert main(["check", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("simsd: error: ") and needle in err and len(err.strip().splitlines()) == 1


def test_simsd_check_subcommand(capsys):
    from simsd.entrypoints.cli import main
    assert main(["check", "--device", "cpu", "--backends", "auto", "--dtypes", "bfloat16", "--head-dims", "48",
                 "--mask-modes", "exact", "--groups", "2", "--caches", "short", "--json"]) == 0
    (row,) = _rows(capsys.readouterr().out)
    assert row["status"] == "pass" and row["resolved"] == "torch" and row["head_dim"] == 48


def test_device_script_runs_the_full_matrix():
    """bench/device_run.sh checks the GPU with the product of the axes, never the quick set."""
    import re
    import shlex
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "bench" / "device_run.sh").read_text()
    arrays = re.findall(r"^\s*(CHECK_\w+)=\(([^)]*)\)", text, flags=re.M)
    assert {name for name, _ in arrays} == {"CHECK_TRITON", "CHECK_REST"} and len(arrays) == 4  # dry run and GPU
    for name, body in arrays:
        assert check.is_full(_args(shlex.split(body))), name


def test_the_full_matrix_runs_every_query_tile_height():
    """The H200 run found the CUDA kernel's 64-row tile at head_dim 64 unable to launch while `simsd
    check --full` passed: no case of the matrix planned that tile. Now the groups and caches plan
    each tile height (16, 32, 64 rows) of the CUDA kernel for every head dim and element size, and
    every one of the Triton kernel's but its 32-row tile at head dim 64, which its planner picks only
    past 4k cache slots at batch 4 and more (compiled for sm_90 by test_sm90_compile)."""
    from simsd_kernels import selfcheck, split_plan
    for figures, name in ((split_plan.CUDA_FIGURES, "cuda"), (split_plan.TRITON_FIGURES, "triton")):
        for head_dim in (64, 128):
            for elt in (2, 4):
                tiles = set()
                for g in check.GROUPS:
                    for lens, capacity, long in check.CACHES.values():
                        q_len = selfcheck.LONG_LQ if long else selfcheck.LQ
                        invariant = long and name == "cuda"  # run_task's plan: plan_options backends only
                        plan = split_plan.plan_for_shape(len(lens), q_len, 2 * g, 2, head_dim, capacity, elt, None,
                                                         figures=figures, invariant=invariant)
                        tiles.add(plan.block_m)
                want = {16, 64} if (name, head_dim) == ("triton", 64) else {16, 32, 64}
                assert tiles == want, (name, head_dim, elt, tiles)
