"""``triton.compile`` of the simsd kernels for an sm_90 target, on any machine (no GPU needed).

Catches GPU-only compile errors (layouts, dot shapes, shared memory) that the interpreter does
not see. Runs ``tests/kernels/sm90_compile.py`` in a subprocess without ``TRITON_INTERPRET``.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

SCRIPT = os.path.join(os.path.dirname(__file__), "sm90_compile.py")


def _ptxas_available():
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return os.path.exists(bundled) or shutil.which("ptxas") is not None


@pytest.mark.skipif(not _ptxas_available(), reason="no ptxas (neither in the triton wheel nor on PATH)")
def test_all_kernel_variants_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in rows if not r["ok"]]
    assert rows and not failed and proc.returncode == 0, (failed or proc.stderr[-3000:])
    fwd = [r for r in rows if r["name"].startswith("fwd")]
    assert all(r["shared"] <= 227 * 1024 for r in fwd)  # fits an H100/H200 SM
    assert not any(r["approx_trig"] for r in rows)  # RoPE angles need precise sin/cos
