"""``simsd bench``: modes compared with vanilla in any order, repeated interleaved passes with
medians and spreads, unstable figures flagged, the output path checked without creating it."""
import json
from types import SimpleNamespace

import pytest

from simsd.decoding.config import DecodeConfig
from simsd.entrypoints.bench import UNSTABLE_SPREAD, is_unstable, print_table, spread
from simsd.entrypoints.cli import main
from tests.helpers import random_checkpoint


@pytest.fixture(scope="module")
def ck():
    return str(random_checkpoint("cli", tokenizer=True))


@pytest.fixture()
def prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_ids": [4 + i, 5, 6, 7, 8]}) for i in range(3)))
    return str(f)


def bench(capsys, ck, prompts, out, *flags):
    code = main(["bench", "--target", ck, "--draft", ck, "--prompts-file", prompts, "--max-new-tokens", "8",
                 "--json", str(out), *flags])
    o, e = capsys.readouterr()
    assert code == 0, e
    return {r["mode"]: r for r in json.loads(out.read_text())["rows"]}, json.loads(out.read_text())["meta"], o


def test_vanilla_is_the_reference_whatever_the_order(ck, prompts, tmp_path, capsys):
    rows, _, _ = bench(capsys, ck, prompts, tmp_path / "a.json", "--modes", "exact,vanilla", "--repeats", "1")
    assert rows["exact"]["identical_to_vanilla"] == 3 and rows["vanilla"]["identical_to_vanilla"] == 3
    assert rows["exact"]["speedup"] is not None and rows["vanilla"]["speedup"] == 1.0
    assert rows["exact"]["forwards_ratio_vs_vanilla"] < 1.0  # the target is its own draft


def test_repeats_give_medians_and_spreads(ck, prompts, tmp_path, capsys):
    rows, meta, out = bench(capsys, ck, prompts, tmp_path / "b.json", "--modes", "vanilla,exact", "--repeats", "3",
                            "--warmup", "2")
    assert meta["repeats"] == 3 and meta["unstable_spread"] == UNSTABLE_SPREAD and meta["threads"] >= 1
    for r in rows.values():
        runs = r["tokens_per_second_runs"]
        assert len(runs) == 3 and r["tokens_per_second"] == sorted(runs)[1]
        assert r["tokens_per_second_spread"] == pytest.approx((max(runs) - min(runs)) / sorted(runs)[1])
        assert len(r["speedup_runs"]) == 3 and isinstance(r["unstable"], bool)
        assert r["unstable"] == is_unstable(r, 3)
    assert rows["vanilla"]["speedup_runs"] == [1.0, 1.0, 1.0]
    assert "repeats=3" in out and "spread" in out
    # the counters: acceptance counted as the field counts it, and the draft's share of the output
    ex = rows["exact"]
    assert ex["acceptance_rate"] == ex["accepted"] / ex["proposed"]
    assert ex["draft_share"] == ex["from_draft"] / ex["new_tokens"] and 0 < ex["draft_share"] <= 1
    assert "draft share" in out


def test_unstable_rule_and_flag(capsys):
    assert spread([10.0, 11.0, 12.0]) == pytest.approx(2 / 11)
    stable = {"tokens_per_second_spread": 0.05, "speedup_spread": 0.08}
    assert not is_unstable(stable, 3)
    assert is_unstable({**stable, "speedup_spread": UNSTABLE_SPREAD + 0.01}, 3)
    assert is_unstable({**stable, "tokens_per_second_spread": 0.5}, 3)
    assert not is_unstable({**stable, "tokens_per_second_spread": 0.5}, 1)  # one pass: nothing to judge
    assert not is_unstable({"tokens_per_second_spread": 0.0, "speedup_spread": float("nan")}, 3)
    row = {"mode": "exact", "unstable": True, "tokens_per_second": 10.0, "tokens_per_second_spread": 0.4,
           "speedup": 0.9, "speedup_runs": [0.5, 0.9, 1.4], "target_forwards_per_token": 0.8,
           "forwards_ratio_vs_vanilla": 0.7, "draft_forwards_per_token": 1.5, "target_query_tokens_per_forward": 9.5,
           "repeats": 3, "prompts": 2, "batch_size": 1}
    print_table([row], DecodeConfig(), SimpleNamespace(gamma=None, repeats=3))
    out = capsys.readouterr().out
    assert "exact !" in out and "0.90x [0.50-1.40]" in out and "40%" in out and "# ! unstable: exact" in out


def test_json_folder_must_exist(ck, prompts, tmp_path, capsys):
    target = tmp_path / "missing" / "deeper" / "rows.json"
    code = main(["bench", "--target", ck, "--prompts-file", prompts, "--modes", "vanilla", "--json", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and "the folder" in err and "does not exist" in err
    assert not (tmp_path / "missing").exists()


def test_warmup_beyond_the_prompts_is_refused(ck, prompts, capsys):
    code = main(["bench", "--target", ck, "--prompts-file", prompts, "--modes", "vanilla", "--warmup", "5"])
    assert code == 2 and "--warmup 5 exceeds the 3 prompt(s)" in capsys.readouterr().err
