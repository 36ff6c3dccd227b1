"""``simsd check`` / ``python -m simsd_kernels.check`` on the CPU: torch, the Triton interpreter,
``auto``, a deliberately wrong registered backend, unsupported head dims, bad options."""
import json

import pytest
import torch

from simsd_kernels import backends, check
from simsd_kernels.backends import Backend
from simsd_kernels.reference import append_kv_torch, temporal_attention_torch

SMALL = ["--dtypes", "float32,bfloat16", "--head-dims", "64,96", "--mask-modes", "paper,exact", "--groups", "4",
         "--caches", "empty,short"]


def _rows(out: str) -> list:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.delenv(backends.TRUST_ENV_VAR, raising=False)
    yield
    backends.reset()


def test_check_torch_triton_auto(capsys):
    pytest.importorskip("triton")
    names = ["torch", "auto"] + (["triton"] if backends.availability("triton", torch.device("cpu"))[0] else [])
    code = check.main(["--device", "cpu", "--backends", ",".join(names), "--json", *SMALL])
    out, err = capsys.readouterr()
    rows = _rows(out)
    assert code == 0, err
    assert len(rows) == len(names) * 2 * 2 * 2 * 2
    by = lambda **kw: [r for r in rows if all(r[k] == v for k, v in kw.items())]  # noqa: E731
    assert all(r["status"] == "pass" and r["max_err"] <= r["tol"] for r in by(head_dim=64))
    assert all(r["status"] == "pass" and r["resolved"] == "torch" for r in by(backend="auto"))
    assert all(r["status"] == "pass" for r in by(backend="torch"))
    if "triton" in names:  # head_dim 96: the kernel refuses it by name, auto ran torch (above)
        assert {r["status"] for r in by(backend="triton", head_dim=96)} == {"refused"}
        assert all("head_dim" in r["detail"] for r in by(backend="triton", head_dim=96))
        assert all(r["us"] > 0 for r in by(backend="triton", head_dim=64))
    bf16 = by(dtype="bfloat16", head_dim=64, backend="torch")
    assert all(1e-4 < r["max_err"] < 5e-2 for r in bf16), "bf16 errors are bf16-sized (the reference is float64)"
    assert "# torch: 16 pass, 0 FAIL, 0 refused (of 16)" in err
    assert "backend  ->" in err  # the table went to stderr


def test_a_wrong_backend_fails_its_rows_and_auto_avoids_it(capsys):
    def wrong(q, k, v, kc, vc, lens, labels, pos, mode, theta, scale):
        out = temporal_attention_torch(q, k, v, kc, vc, lens, labels, pos, mode, theta, scale)
        out[:, -1] = 0  # the last new token's output is lost
        return out
    backends.register_backend(Backend("wrong", wrong, append_kv_torch, lambda d: (True, ""),
                                       auto_devices=("cpu",)), auto_rank=0)
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
