"""bench/bench_fold.py: a folded commit gives the bits of a separate one under ``--invariant``
(by construction, docs/design.md §4.2), and the rows say so for every setting asked for."""
import json

from tests.helpers import load_bench_script


def test_invariant_rows_are_equal_and_every_setting_has_a_row(tmp_path, capsys):
    out = tmp_path / "fold.json"
    assert load_bench_script("bench_fold").main(["--dtypes", "float32,bfloat16", "--block-lengths", "2,4",
                                                 "--states", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["dtype"], r["block_length"], r["numerics"]) for r in rows} == {
        (d, L, n) for d in ("float32", "bfloat16") for L in (2, 4) for n in ("default", "invariant")}
    for r in rows:
        assert r["states"] == 2 and 0 <= r["logits_equal"] <= 2 and 0 <= r["cache_equal"] <= 2
        if r["numerics"] == "invariant":
            assert r["logits_equal"] == r["cache_equal"] == 2 and r["max_abs_diff"] == 0, r
    assert "logits equal" in capsys.readouterr().out
