"""The CUDA kernel's index maps, run on the CPU against a model of the PTX instructions.

``layout_check.cpp`` includes ``csrc/tile_layout.cuh`` (the swizzle, ldmatrix lane addresses,
split rule and tile-skip rule the kernel itself calls) and checks them against ldmatrix /
mma.m16n8k16 fragment definitions written from the PTX ISA: an emulated warp must reproduce the
exact S = Q K^T and O = S V of small-integer tiles for every (head_dim, warps along M) the kernel
instantiates, without bank conflicts; plus the cp.async pipeline schedule and the tile-skip rule.
Its split rule must equal :func:`simsd_kernels.split_plan.split_ranges` case for case.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from simsd_kernels.split_plan import active_splits, split_ranges

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "csrc")
CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.fixture(scope="module")
def layout_check(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler on PATH")
    exe = str(tmp_path_factory.mktemp("layout") / "layout_check")
    proc = subprocess.run([CXX, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{CSRC}",
                           os.path.join(HERE, "layout_check.cpp"), "-o", exe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


def test_fragment_maps_pipeline_and_skip_rule(layout_check):
    proc = subprocess.run([layout_check], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_device_split_rule_equals_python(layout_check):
    proc = subprocess.run([layout_check, "splits"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [tuple(map(int, line.split())) for line in proc.stdout.splitlines()]
    assert len(rows) > 10000
    cache = {}
    for cache_len, q_len, ns, mt, inv, z, active, clo, chi, nlo, nhi in rows:
        key = (ns, mt, bool(inv), cache_len, q_len)
        if key not in cache:
            cache[key] = split_ranges(*key)
            assert active == active_splits(*key), key
        assert cache[key][z] == ((clo, chi), (nlo, nhi)), (key, z)
    # the shape-invariant rule on the C++ rows themselves (equal mirrors can share a fault): the
    # cache cut depends on the row's cache length only, never on Lq; the new tiles all go to the
    # last active split
    invariant: dict = {}
    for cache_len, q_len, ns, mt, inv, z, active, clo, chi, nlo, nhi in rows:
        if inv:
            key = (cache_len, ns, mt, z)
            assert invariant.setdefault(key, (active, clo, chi)) == (active, clo, chi), (key, q_len)
            assert (nlo, nhi) == ((0, -(-q_len // 64)) if z == active - 1 else (0, 0)), (key, q_len)
    assert sum(1 for r in rows if r[4]) >= 3 * len(invariant)  # several Lq per cut: the check has teeth
