"""``triton.compile`` of the simsd kernels for an sm_90 target, on any machine (no GPU needed).

Catches GPU-only compile errors (layouts, dot shapes, shared memory) that the interpreter does
not see, and holds the static figures: every fp16/bf16 variant compiles without a register spill
(``ptxas -v`` of its PTX), within an SM's shared memory, with at most the registers and exactly the
shared memory that :data:`simsd_kernels.split_plan.TRITON_FIGURES` (the split plan's residency)
records. Runs ``tests/kernels/sm90_compile.py`` in a subprocess without ``TRITON_INTERPRET``.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from simsd_kernels.split_plan import TRITON_FIGURES

triton = pytest.importorskip("triton")

SCRIPT = os.path.join(os.path.dirname(__file__), "sm90_compile.py")


def _ptxas_available():
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return os.path.exists(bundled) or shutil.which("ptxas") is not None


@pytest.fixture(scope="module")
def rows():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in out if not r["ok"]]
    assert out and not failed and proc.returncode == 0, (failed or proc.stderr[-3000:])
    return out


@pytest.mark.skipif(not _ptxas_available(), reason="no ptxas (neither in the triton wheel nor on PATH)")
def test_all_kernel_variants_compile_for_sm90(rows):
    fwd = [r for r in rows if r["name"].startswith("fwd")]
    assert {int(re.search(r"BM(\d+)", r["name"]).group(1)) for r in fwd} == {16, 32, 64}
    assert all(r["shared"] <= 227 * 1024 for r in fwd)  # fits an H100/H200 SM
    moe = {r["name"] for r in rows if r["name"].startswith("moe")}  # the fused-MoE kernels, every tile
    assert {f"moe_{k} bf16 BM{bm}" for k in ("gate_up", "down") for bm in (16, 32, 64)} | {"moe_combine bf16 K8"} <= moe
    assert not any(r["approx_trig"] for r in rows)  # RoPE angles need precise sin/cos
    assert not any("sin." in r["name"] for r in rows)


@pytest.mark.skipif(not _ptxas_available(), reason="no ptxas (neither in the triton wheel nor on PATH)")
def test_no_spills_and_figures_match_the_plan(rows):
    half = [r for r in rows if " fp32 " not in r["name"]]  # fp32 is the register-bound test path
    assert half and all(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in half), \
        [(r["name"], r["spill_stores"]) for r in half if r["spill_stores"] or r["spill_loads"]]
    for r in half:
        m = re.match(r"fwd \w+ D(\d+) G\d+ BM(\d+)", r["name"])
        if not m:
            continue
        fig = TRITON_FIGURES[(int(m.group(1)), int(m.group(2)))]
        assert r["shared"] == fig.smem and r["regs"] <= fig.regs and 32 * r["warps"] == fig.threads, (r, fig)
    assert all(r["ptx_lines"] < 10000 for r in half)  # no trigonometry in the attention kernel any more
