#!/usr/bin/env python3
"""Static checks of the CUDA kernels on a machine without a GPU (run by .ci/cuda_check.sh).

Input: a directory of object files ``<tu>.o`` compiled for sm_90 with ``-Xptxas -v`` and their
logs ``<tu>.o.log``. Checks, failing with a list of offenders:

* every kernel: 0 bytes of register spills (``ptxas -v``);
* the tensor-core attention kernel, every (dtype, head_dim, query tile): registers and shared
  memory within ``simsd_kernels.split_plan.CUDA_FIGURES`` (the residency the split plan assumes);
* its SASS (``cuobjdump -sass``): the main loop -- the loop holding the HMMAs -- issues the
  asynchronous global->shared copies (LDGSTS) and reads fragments with LDSM, has no plain
  shared-memory loads or stores, and one barrier per K/V tile.

Prints the figures as a markdown table (registers, shared memory, CTAs/SM on an H100/H200).

    python .ci/kernel_static_check.py OBJ_DIR [--cuobjdump PATH]
"""
from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# split_plan.py alone (pure Python): no torch needed to run this check
_spec = importlib.util.spec_from_file_location("split_plan", os.path.join(ROOT, "simsd_kernels", "split_plan.py"))
split_plan = sys.modules["split_plan"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(split_plan)
CUDA_FIGURES, DeviceLimits, ctas_per_sm = split_plan.CUDA_FIGURES, split_plan.DeviceLimits, split_plan.ctas_per_sm

MMA = re.compile(r"attention_mma_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELi(\d)E")
DTYPES = {"6__half": "fp16", "13__nv_bfloat16": "bf16"}


def dynamic_smem(head_dim: int, warps_m: int) -> int:
    """``MmaCfg<D, WM>::smem_bytes``: kStages (3 for 64 rows, else 4) x (K + V tile of 64 x D) x 2 B."""
    stages = 3 if warps_m == 4 else 4
    return stages * 2 * 64 * head_dim * 2


def parse_ptxas(log: str) -> dict:
    """``{mangled kernel: {regs, spill_stores, spill_loads, static_smem}}`` from a ``ptxas -v`` log."""
    out, name = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
            out[name] = {"static_smem": 0}
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[name].update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[name]["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            out[name]["static_smem"] = int(s.group(1)) if s else 0
    return out


def sass_functions(sass: str) -> dict:
    """``{mangled kernel: [(address, instruction text)]}``; never-executed ``@!PT`` lines dropped."""
    funcs = {}
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", chunk)]
        funcs[name] = [(a, t) for a, t in ins if not t.startswith("@!PT")]
    return funcs


def opcode(text: str) -> str:
    words = text.split()
    op = words[1] if words[0].startswith("@") else words[0]
    return op.split(".")[0]


def main_loop(ins) -> collections.Counter | None:
    """Opcode counts of the innermost backward-branch loop that holds HMMA instructions."""
    best = None
    for addr, text in ins:
        m = re.search(r"\bBRA\b[^0-9x]*(0x[0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        lo, hi = int(m.group(1), 16), addr
        ops = collections.Counter(opcode(t) for a, t in ins if lo <= a <= hi)
        if ops["HMMA"] and (best is None or hi - lo < best[0]):
            best = (hi - lo, ops)
    return best[1] if best else None


def demangle(names):
    """Readable kernel names (``c++filt`` when present), without the parameter list."""
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        out = list(names)
    return [re.sub(r"\([^()]*\)$", "", n.replace("(anonymous namespace)::", "")).replace("void ", "") for n in out]


def find_cuobjdump(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        return path if os.path.exists(path) else None
    except ImportError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("obj_dir")
    ap.add_argument("--cuobjdump", default=None)
    args = ap.parse_args(argv)
    problems = []
    kernels = {}
    for log in sorted(glob.glob(os.path.join(args.obj_dir, "*.o.log"))):
        kernels.update(parse_ptxas(open(log).read()))
    if not kernels:
        problems.append(f"no ptxas -v output under {args.obj_dir} (compile with -Xptxas -v)")
    for name, k in kernels.items():
        if k.get("spill_stores", 1) or k.get("spill_loads", 1):
            problems.append(f"{name}: spills {k.get('spill_stores')} / {k.get('spill_loads')} bytes")

    limits = DeviceLimits()
    rows, seen = [], set()
    for name, k in kernels.items():
        m = MMA.search(name)
        if not m:
            continue
        dtype, d, wm = DTYPES[m.group(1)], int(m.group(2)), int(m.group(3))
        bm = 16 * wm
        smem = dynamic_smem(d, wm) + k["static_smem"]
        fig = CUDA_FIGURES[(d, bm)]
        if k["regs"] > fig.regs or smem != fig.smem:
            problems.append(f"{name}: {k['regs']} registers / {smem} B shared, split_plan.CUDA_FIGURES says "
                            f"{fig.regs} / {fig.smem}: update the table (and csrc/README.md)")
        seen.add((dtype, d, bm))
        rows.append((dtype, d, bm, k["regs"], smem, ctas_per_sm(k["regs"], 128, smem, limits)))
    want = {(t, d, bm) for t in ("fp16", "bf16") for d in (64, 128) for bm in (16, 32, 64)}
    if kernels and seen != want:
        problems.append(f"attention kernel instances missing from the logs: {sorted(want - seen)}")

    tool = find_cuobjdump(args.cuobjdump)
    if tool is None:
        problems.append("cuobjdump not found (PATH, or the triton wheel's backends/nvidia/bin)")
    else:
        for obj in sorted(glob.glob(os.path.join(args.obj_dir, "attention_fwd_*.o"))):
            sass = subprocess.run([tool, "-sass", obj], capture_output=True, text=True, check=True).stdout
            for name, ins in sass_functions(sass).items():
                if not MMA.search(name):
                    continue
                ops = main_loop(ins)
                if ops is None:
                    problems.append(f"{name}: no loop with HMMA found in the SASS")
                    continue
                if not ops["LDGSTS"] or not ops["LDSM"]:
                    problems.append(f"{name}: main loop lacks LDGSTS ({ops['LDGSTS']}) or LDSM ({ops['LDSM']})")
                if ops["LDS"] or ops["STS"]:
                    problems.append(f"{name}: main loop has {ops['LDS']} LDS / {ops['STS']} STS (fragments "
                                    "should come from LDSM)")
                if ops["BAR"] != 1:
                    problems.append(f"{name}: main loop has {ops['BAR']} barriers, expected one per tile")
                print(f"[kernel_static_check] SASS main loop {DTYPES[MMA.search(name).group(1)]} "
                      f"D{MMA.search(name).group(2)} BM{16 * int(MMA.search(name).group(3))}: "
                      f"HMMA {ops['HMMA']}, LDSM {ops['LDSM']}, LDGSTS {ops['LDGSTS']}, BAR {ops['BAR']}")

    print("| kernel | registers | shared memory (B) | CTAs/SM (H100/H200) |")
    print("|---|---|---|---|")
    for dtype, d, bm, regs, smem, ctas in sorted(rows):
        print(f"| attention_mma {dtype} D{d} BM{bm} | {regs} | {smem} | {ctas} |")
    others = sorted(n for n in kernels if not MMA.search(n))
    for name, short in zip(others, demangle(others)):
        print(f"| {short} | {kernels[name]['regs']} | {kernels[name]['static_smem']} | - |")
    if problems:
        print("[kernel_static_check] FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"[kernel_static_check] ok: {len(kernels)} kernels without spills; attention main loops pipelined")
    return 0


if __name__ == "__main__":
    sys.exit(main())
