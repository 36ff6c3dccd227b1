"""setup.py: without a CUDA toolchain the install is pure Python, unless SIMSD_REQUIRE_CUDA_EXT=1
asks for the extension, which must then fail loudly (the device script relies on it)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _setup(**env):
    full = {k: v for k, v in os.environ.items() if k not in ("SIMSD_REQUIRE_CUDA_EXT", "SIMSD_SKIP_CUDA_BUILD")}
    full.update(env)
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(bool(torch.version.cuda), reason="a CUDA torch would start building the extension")
def test_require_cuda_ext_fails_loudly_without_a_cuda_torch():
    required = _setup(SIMSD_REQUIRE_CUDA_EXT="1")
    assert required.returncode != 0
    assert "SIMSD_REQUIRE_CUDA_EXT=1 but the CUDA extension cannot be built" in required.stderr
    assert "is not a CUDA build" in required.stderr


def test_require_cuda_ext_with_skip_is_a_contradiction():
    res = _setup(SIMSD_REQUIRE_CUDA_EXT="1", SIMSD_SKIP_CUDA_BUILD="1")
    assert res.returncode != 0 and "SIMSD_SKIP_CUDA_BUILD is set" in res.stderr


def test_the_setuptools_in_use_is_named_in_one_line():
    ok = _setup(SIMSD_SKIP_CUDA_BUILD="1")
    assert ok.returncode == 0 and "simsd setup: setuptools " in ok.stderr and "licence Apache-2.0 as" in ok.stderr
