"""The documentation site builds with ``mkdocs build --strict`` (``make docs``; CI runs it) without
importing torch: the API reference is read from the source (griffe's static analysis and
``tools/docs_griffe.py``), so a docs build needs neither torch nor a GPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strict_without_torch(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') is not installed")
    pytest.importorskip("mkdocstrings")
    blocker = tmp_path / "block" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("the docs build imported torch")\n')
    env = dict(os.environ, PYTHONPATH=str(blocker.parent), NO_MKDOCS_2_WARNING="1")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "index.html").read_text()
    # each setting's help, read from its declaration (simsd/config/engine.py, request.py)
    assert "the most requests decoded together (engine rows)" in page
    assert "most tokens generated per request" in page
