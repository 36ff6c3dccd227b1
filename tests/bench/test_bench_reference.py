"""bench/bench_reference.py: simsd's vanilla decoding gives the tokens of an independent
block-diffusion loop on transformers' Qwen3 (SDPA) on the bundled target, and the report's form."""
import json
import math

import pytest

from tests.helpers import load_bench_script


def load():
    return load_bench_script("bench_reference")


def test_identical_tokens_on_the_bundled_target(tmp_path, capsys):
    br = load()
    out = tmp_path / "ref.json"
    assert br.main(["--prompts", "2", "--max-new-tokens", "16", "--passes", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "identical tokens: 2/2 prompts" in text
    assert "ratio simsd/transformers:" in text
    (row,) = json.loads(out.read_text())["rows"]
    assert row["identical"] == row["prompts"] == 2 and row["differ"] == []
    assert row["new_tokens"] == row["new_tokens_transformers"] > 0
    assert len(row["simsd_tokens_per_second_all"]) == len(row["transformers_tokens_per_second_all"]) == 2
    assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
    ratio = row["simsd_tokens_per_second"] / row["transformers_tokens_per_second"]
    assert row["ratio_of_medians"] == pytest.approx(ratio)


def test_a_difference_is_reported_with_its_margin(monkeypatch, capsys):
    br = load()
    real = br.simsd_generate

    def shifted(target, prompt, cfg, index):  # simsd's tokens with token 3 of prompt 1 changed
        toks, sec = real(target, prompt, cfg, index)
        if index == 1:
            toks = toks[:3] + [toks[3] + 1] + toks[4:]
        return toks, sec
    monkeypatch.setattr(br, "simsd_generate", shifted)
    assert br.main(["--prompts", "2", "--max-new-tokens", "8", "--passes", "1"]) == 0
    text = capsys.readouterr().out
    assert "identical tokens: 1/2 prompts" in text
    line = next(x for x in text.splitlines() if "first difference" in x)
    assert "at token 3 " in line
    margin = float(line.split("logit margin ")[1].split(",")[0])
    assert math.isfinite(margin) and margin >= 0  # a number: the top-1 logit minus the top-2 one


def test_fold_commit_folds_and_keeps_the_tokens(tmp_path, monkeypatch, capsys):
    """``--fold-commit``: simsd decodes with ``fold_commit`` (fewer target forwards per block than
    without), the tokens are still those of the reference, and the row and header say so."""
    br = load()
    real, forwards = br.vanilla_generate_batch, {}

    def counted(model, prompts, cfg, *args, **kwargs):
        out = real(model, prompts, cfg, *args, **kwargs)
        forwards.setdefault(cfg.fold_commit, []).append(out.results[0].stats["target_forwards"])
        return out
    monkeypatch.setattr(br, "vanilla_generate_batch", counted)
    for fold in (False, True):
        out = tmp_path / f"ref{fold}.json"
        args = ["--prompts", "1", "--max-new-tokens", "16", "--passes", "1", "--json", str(out)]
        assert br.main(args + (["--fold-commit"] if fold else [])) == 0
        (row,) = json.loads(out.read_text())["rows"]
        assert row["fold_commit"] is fold and row["identical"] == row["prompts"] == 1
        assert ("simsd folds commits" in capsys.readouterr().out) is fold
    assert min(forwards[False]) > max(forwards[True]), forwards


def test_first_difference():
    br = load()
    assert br.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert br.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert br.first_difference([1, 2], [1, 2, 7]) == 2
    assert br.cut([4, 2, 9, 2], {2}, 10) == [4, 2]
    assert br.cut([4, 5, 9], {2}, 2) == [4, 5]
