"""Every figure that README.md and docs/*.md quote is in a committed result file.

The convention (docs/benchmarking.md, "Quoting a figure"): a measured figure is quoted only in a
*figure block*, which starts with a marker line naming the result files it quotes,

    <!-- figures: bench/results/reference_cpu_tiny_target.json bench/results/... -->

and runs from the next non-blank line to the first blank line, heading or list item after it
(a paragraph, a table); a list item that starts with the marker (``* <!-- figures: ... -->
text``) is a block of its own, to the next item. Every number in the block outside code spans
(`simsd bench --limit 8` is a command, not a figure) must be a number of one of the named files
at the precision printed: ``1.068`` matches a value that formats as ``1.068`` with three
decimals, ``8`` an integer value 8. Lists of numbers
inside the files (per-pass values) are not matched, so a figure is one of the file's named
fields. A table with a decimal number outside a figure block fails too: results are not pasted
without their source.

Out of scope: CHANGELOG.md (history: figures as they were measured then, each with its issue),
docs/mutation_audit.md and docs/server_probes.md (audit and probe records, each row naming its
own commit and result file), and numbers that are not measurements (defaults, ranges, sizes),
which stay outside figure blocks.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = {"mutation_audit.md", "server_probes.md"}
PAGES = [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in RECORDS]
# a marker line, or a list item that starts with a marker (a line between two items would split the list)
MARKER = re.compile(r"^(\s*(?:[*-]|\d+\.) )?<!-- figures: (.+?) -->(.*)$")
# a number not glued to a word (float32, sm_90, h512 are names): an optional unit x or % may follow
NUMBER = re.compile(r"(?<![\w.§])(\d+(?:\.\d+)?)(?=x\b|%|[^\w.]|\.(?!\d)|$)")
CODE = re.compile(r"(`+).*?\1")
ENDS = re.compile(r"^\s*$|^#{1,6} |^\s*(?:[*-]|\d+\.) ")


def blocks(text: str) -> list:
    """``[(line number, [file paths], block text)]``: the figure blocks of a page."""
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        item = m.group(1) is not None
        body = [m.group(3)] if item else []  # the item's text, without its bullet or number
        if not item and m.group(3).strip():
            continue  # a marker that is neither alone on its line nor an item's start marks nothing
        for j in range(i + 1, len(lines)):
            if not body and not lines[j].strip():
                continue  # the block starts at the marker's next non-blank line
            if (body and ENDS.match(lines[j])) or MARKER.match(lines[j]):
                break
            body.append(lines[j])
        found.append((i + 1, m.group(2).split(), "\n".join(body)))
    return found


def figures(block: str) -> list:
    """The numbers a block quotes, as written (``"1.068"``, ``"8"``), outside code spans and comments."""
    text = CODE.sub(" ", re.sub(r"<!--.*?-->", " ", block, flags=re.S))
    return NUMBER.findall(text)


def numbers(node) -> list:
    """The numbers of a result file: every int or float field, nested objects included, lists of
    objects walked, lists of plain numbers (per-pass values) left out."""
    if isinstance(node, bool):
        return []
    if isinstance(node, (int, float)):
        return [node]
    if isinstance(node, dict):
        return [x for v in node.values() for x in numbers(v)]
    if isinstance(node, list) and not all(isinstance(v, (int, float)) for v in node):
        return [x for v in node for x in numbers(v)]
    return []


def written(value, figure: str) -> bool:
    """Whether ``value`` prints as ``figure`` at the figure's precision."""
    if "." in figure:
        return f"{value:.{len(figure.split('.')[1])}f}" == figure
    return float(value) == int(figure)


def load(path: str):
    """A result file: one JSON document, or JSON lines (the device run's rows) as a list of rows."""
    text = (ROOT / path).read_text()
    if path.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def unmatched(block: str, files: list) -> list:
    """The figures of a block that none of ``files`` holds (a missing file: every figure)."""
    values = [v for f in files for v in numbers(load(f))]
    return [fig for fig in figures(block) if not any(written(v, fig) for v in values)]


def all_blocks():
    return [(page, line, files, body) for page in PAGES for line, files, body in blocks(page.read_text())]


def test_pages_quote_figures_under_the_convention():
    """The README's results table and the docs' measured figures use the markers (a page that
    lost its markers would pass the check below vacuously)."""
    per_page = {page.name: sum(len(figures(b)) for _, _, _, b in [x for x in all_blocks() if x[0] == page])
                for page in PAGES}
    assert per_page["README.md"] >= 15, per_page
    assert sum(per_page.values()) >= 120, per_page


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_figure_is_in_its_result_file(page):
    bad = []
    for line, files, body in blocks(page.read_text()):
        missing = [f for f in files if not (f.startswith("bench/results/") and (ROOT / f).is_file())]
        if missing:
            bad.append(f"{page.name}:{line}: no committed result file {missing}")
            continue
        if not figures(body):
            bad.append(f"{page.name}:{line}: a figure block without figures")
        wrong = unmatched(body, files)
        if wrong:
            bad.append(f"{page.name}:{line}: {wrong} not in {files}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_results_table_without_its_source(page):
    """A Markdown table row with a decimal number outside code spans stands in a figure block."""
    lines = page.read_text().splitlines()
    covered = set()
    for line, _, body in blocks(page.read_text()):
        covered.update(range(line, line + 1 + body.count("\n") + 1))
    bad = [f"{page.name}:{i}: {ln[:80]}" for i, ln in enumerate(lines, 1)
           if ln.startswith("|") and i not in covered and any("." in f for f in figures(ln))]
    assert not bad, "tables with figures but no <!-- figures: ... --> marker:\n" + "\n".join(bad)


def test_named_result_files_exist():
    """A result file named anywhere in README.md or docs/ is committed (a figure's source must not vanish)."""
    named = {(page.name, m) for page in PAGES
             for m in re.findall(r"bench/results/[\w./-]+\.jsonl?\b", page.read_text())}
    missing = sorted(f"{p}: {f}" for p, f in named if not (ROOT / f).is_file())
    assert not missing, missing


def test_an_altered_figure_fails():
    """The check can fail: every decimal figure quoted, changed in its last digit to a value
    its files do not hold, is reported (and nothing else in its block is)."""
    checked = 0
    for page, line, files, body in all_blocks():
        for m in NUMBER.finditer(CODE.sub(lambda c: " " * len(c.group()), body)):
            fig = m.group(1)
            if "." not in fig:
                continue
            for d in range(1, 10):
                alt = fig[:-1] + str((int(fig[-1]) + d) % 10)
                altered = body[:m.start(1)] + alt + body[m.end(1):]
                if alt not in figures(body) and unmatched(altered, files) == [alt]:
                    checked += 1
                    break
            else:
                pytest.fail(f"{page.name}:{line}: {fig}: no change of its last digit is caught")
    assert checked >= 50, checked


def test_the_convention_reads_numbers_as_written():
    block = "bundled 1.068 (range 0.96-1.26), 8/8 identical; `--limit 8` and float32 are not figures; 1.23x, 24%."
    assert figures(block) == ["1.068", "0.96", "1.26", "8", "8", "1.23", "24"]
    assert written(1.067915, "1.068") and not written(1.0674, "1.068") and written(8, "8") and not written(8.5, "8")
    assert numbers({"a": 1, "b": [1.5, 2.5], "c": [{"d": 3.0}], "e": True, "f": "2.13"}) == [1, 3.0]
    text = "x\n<!-- figures: bench/results/a.json -->\n| a | 1.0 |\n| b | 2.0 |\n\nafter 3.0\n"
    assert blocks(text) == [(2, ["bench/results/a.json"], "| a | 1.0 |\n| b | 2.0 |")]
    items = "* one 1.5\n* <!-- figures: bench/results/a.json --> two 2.5\n  more 2.75\n* three 3.5\n"
    assert blocks(items) == [(2, ["bench/results/a.json"], " two 2.5\n  more 2.75")]
    assert blocks("text <!-- figures: bench/results/a.json --> 1.5\n") == []
