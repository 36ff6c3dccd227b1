"""docs/design.md is in the repository and every reference to it names a section it has; every
reference to a docs page or a README section (``docs/cli.md "CPU threads"``, ``README "Decoding
modes"``) names a page and a heading that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"
SOURCES = [p for d in ("simsd", "simsd_kernels", "triton_ops", "csrc", "tests", "bench", "tools", ".ci")
           for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".md", ".sh", ".cu", ".cuh", ".cpp", ".h")]
SOURCES += [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
SOURCES += sorted(p for p in (ROOT / "docs").glob("*.md") if p != DOC)


def sections() -> set:
    """``{"3", "3.5", "4.1", ...}``: headings, and the numbered items of a section as N.M."""
    found, current = set(), None
    for line in DOC.read_text().splitlines():
        m = re.match(r"(#{2,3}) (\d+(?:\.\d+)?)[. ]", line)
        if m:
            found.add(m.group(2))
            current = m.group(2).split(".")[0]
            continue
        item = re.match(r"(\d+)\. \*\*", line)
        if item and current:
            found.add(f"{current}.{item.group(1)}")
    return found


def test_design_doc_is_in_the_repository():
    assert DOC.is_file()
    assert {"3", "3.5", "3.6", "4", "4.1", "5", "6", "8"} <= sections()


def test_references_name_existing_sections():
    have = sections()
    refs, stale = [], []
    for path in SOURCES:
        text = path.read_text(errors="replace")
        if path.name != Path(__file__).name and "DESIGN.md" in text:
            stale.append(str(path.relative_to(ROOT)))
        for m in re.finditer(r"docs/design\.md`? §(\d+(?:\.\d+)?)", text):
            refs.append((str(path.relative_to(ROOT)), m.group(1)))
    assert not stale, f"references to a DESIGN.md outside the repository: {stale}"
    assert len(refs) >= 17
    missing = [r for r in refs if r[1] not in have]
    assert not missing, missing


def headings(path: Path) -> set:
    """The headings of a Markdown page, without their ``#`` marks and code backticks."""
    return {m.group(1).replace("`", "").strip() for m in re.finditer(r"^#{1,6} (.+)$", path.read_text(), re.M)}


def test_references_to_pages_and_sections_exist():
    refs, bad = 0, []
    for path in SOURCES:
        text = path.read_text(errors="replace")
        for m in re.finditer(r'(?<![\w/])(docs/[\w-]+\.md|README)(?:[`\'"]*(?:,|\'s)? "([^"\n]+)")?', text):
            page = ROOT / (m.group(1) if m.group(1) != "README" else "README.md")
            refs += 1
            if not page.is_file():
                bad.append(f"{path.relative_to(ROOT)}: {m.group(1)} is not in the repository")
            elif m.group(2) and m.group(2) not in headings(page):
                bad.append(f"{path.relative_to(ROOT)}: {m.group(1)} has no section {m.group(2)!r}")
    assert refs >= 30, refs
    assert not bad, "\n".join(bad)


def test_readme_and_docs_state_what_is():
    """History (per-issue narratives) lives in CHANGELOG.md: the README and the docs pages name no
    issue of the project (the mutation audit and the server probes are records, kept by issue)."""
    pages = [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").glob("*.md"))
                                    if p.name not in ("mutation_audit.md", "server_probes.md")]
    bad = [f"{p.relative_to(ROOT)}:{i}: {m.group()}" for p in pages
           for i, line in enumerate(p.read_text().splitlines(), 1)
           for m in re.finditer(r"\b[Ii]ssues? \d+|(?<![\w/])#\d+\b", line)]
    assert not bad, bad
