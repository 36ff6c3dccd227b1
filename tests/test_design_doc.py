"""docs/design.md is in the repository and every reference to it names a section it has."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"
SOURCES = [p for d in ("simsd", "simsd_kernels", "triton_ops", "csrc", "tests", "bench", "tools", ".ci")
           for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".md", ".sh", ".cu", ".cuh", ".cpp", ".h")]
SOURCES += [ROOT / "README.md"]


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
