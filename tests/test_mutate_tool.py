"""tools/mutate.py, the mutation runner: edits apply exactly once and are always undone, a
failing test kills a mutant, a hanging one counts as killed (timeout)."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mutate():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "tools" / "mutate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("mutate", None)


#: the kinds of blind spot of issue 13 and of the code merged since: each keeps mutants that apply
KINDS = {"verdict", "schedule", "strategy", "confidence", "sampling", "reveal step", "rejection", "stop ids",
         "mask rule (all mirrors)", "mask rule (one mirror)", "mask padding", "cache commit", "layout", "user path",
         "hang", "counters", "noise", "split plan", "backend self-check", "graph self-check", "batch retry",
         "api counters", "protocol", "prompt bounds", "tp check", "admission", "memory", "stop-id bounds",
         "chunked prefill"}


def test_the_mutant_list_is_usable(mutate):
    """At least 40 mutants apply to today's code (a mutant whose line was rewritten since is
    reported as stale by the tool, and should be renewed), every kind among them; every named
    test file exists; no two mutants make the same change."""
    applying = [mu for mu in mutate.MUTANTS if mutate.applies(mu)]
    assert len(applying) >= 40
    missing = KINDS - {mu.kind for mu in applying}
    assert not missing, f"no applicable mutant of the kinds {sorted(missing)}"
    assert len({mu.edits for mu in mutate.MUTANTS}) == len(mutate.MUTANTS), "a mutant is listed twice"
    for i, mu in enumerate(mutate.MUTANTS, 1):
        assert mu.tests and mu.note and all(old != new for _, old, new in mu.edits), i
        for t in mu.tests:
            assert (ROOT / t).is_file(), f"mutant {i}: no test file {t}"


def test_edits_are_undone_on_interrupt(mutate, tmp_path, monkeypatch):
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    (tmp_path / "a.py").write_text("x = 1\ny = 2\n")
    mu = mutate.Mutant("k", (("a.py", "y = 2", "y = 3"),), ())
    with pytest.raises(KeyboardInterrupt):
        with mutate.Applied(mu):
            assert (tmp_path / "a.py").read_text() == "x = 1\ny = 3\n"
            raise KeyboardInterrupt
    assert (tmp_path / "a.py").read_text() == "x = 1\ny = 2\n"
    twice = mutate.Mutant("k", (("a.py", "= ", "== "),), ())
    with pytest.raises(ValueError, match="occurs 2 times"):
        with mutate.Applied(twice):
            pass
    assert (tmp_path / "a.py").read_text() == "x = 1\ny = 2\n"


def test_results_are_classified(mutate, tmp_path, monkeypatch):
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    (tmp_path / "test_bad.py").write_text("def test_bad():\n    assert False\n")
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_hang():\n    while True:\n"
                                           "        time.sleep(0.05)\n")
    assert mutate.run_tests(["test_ok.py"], 120)[0] == "survived"
    assert mutate.run_tests(["test_bad.py"], 120)[0] == "killed"
    assert mutate.run_tests(["test_hang.py"], 4)[0] == "killed (timeout)"
    assert mutate.run_tests(["test_none.py"], 120)[0].startswith("error")
