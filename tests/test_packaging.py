"""Packaging metadata: setup.py and pyproject.toml apply without setuptools deprecation warnings, and
give the licence in the form the installed setuptools reads (issue 34 item 5)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def egg_info(tmp_path, fake_setuptools_version=None):
    """``setup.py egg_info`` into ``tmp_path`` (optionally as if setuptools were that version):
    ``(stderr, PKG-INFO text)``."""
    fake = f"setuptools.__version__ = {fake_setuptools_version!r}; " if fake_setuptools_version else ""
    code = (f"import runpy, sys, setuptools; {fake}sys.argv = ['setup.py', '-q', 'egg_info', '--egg-base', "
            f"{str(tmp_path)!r}]; runpy.run_path('setup.py', run_name='__main__')")
    res = subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, SIMSD_SKIP_CUDA_BUILD="1"))
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stderr, (tmp_path / "simsd.egg-info" / "PKG-INFO").read_text()


def test_setup_applies_without_deprecation_warnings(tmp_path):
    pytest.importorskip("setuptools", minversion="77")  # PEP 639's license_expression from setuptools 77 on
    err, info = egg_info(tmp_path)
    assert "Warning" not in err, err
    assert "License-Expression: Apache-2.0" in info.splitlines()


def test_an_older_setuptools_gets_the_licence_field_and_nothing_needs_77(tmp_path):
    """Before, pyproject.toml's PEP 639 string ``license`` stopped setuptools < 77 (measured: 65.5.0,
    "`project.license` must be valid exactly by one definition") and setup.py refused it outright, so
    the device image's install lost every CUDA path. Now the licence comes from setup.py in the form
    the setuptools in use reads (measured: pip install --no-build-isolation -e . with 65.5.0, 76.1.0
    and 84.2.1 in scratch venvs: installed, License: or License-Expression: Apache-2.0)."""
    err, info = egg_info(tmp_path, "75.3.2")
    assert "simsd setup: setuptools 75.3.2: licence Apache-2.0 as license" in err
    assert "License: Apache-2.0" in info.splitlines()
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+; simsd runs on 3.10)
    assert 'dynamic = ["license"]' in pyproject and "\nlicense = " not in pyproject
    assert "setuptools>=77" not in pyproject.replace(" ", "")
