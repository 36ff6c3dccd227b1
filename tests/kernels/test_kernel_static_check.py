""".ci/kernel_static_check.py fails when it should: spills, figures off the plan's table, and a
SASS main loop without asynchronous copies or ldmatrix (synthetic ptxas logs and SASS; the real
objects are checked by .ci/cuda_check.sh)."""
from __future__ import annotations

import importlib.util
import os

import pytest

from simsd_kernels.split_plan import CUDA_FIGURES

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".ci",
                    "kernel_static_check.py")
spec = importlib.util.spec_from_file_location("kernel_static_check", PATH)
ksc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ksc)

KERNEL = "_ZN5simsd20attention_mma_kernelI13__nv_bfloat16Li128ELi4EEEv22simsd_attention_params"


def _log(name, regs, spill=0, smem=128):
    return (f"ptxas info    : Compiling entry function '{name}' for 'sm_90'\n"
            f"ptxas info    : Function properties for {name}\n"
            f"    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads\n"
            f"ptxas info    : Used {regs} registers, used 1 barriers, {smem} bytes smem\n")


def _sass(loop_ops):
    lines = ["\tcode for sm_90", "        Function : " + KERNEL,
             "        /*0000*/                   MOV R1, c[0x0][0x28] ;"]
    addr = 0x10
    for op in loop_ops:
        lines.append(f"        /*{addr:04x}*/                   {op} ;")
        addr += 0x10
    lines.append(f"        /*{addr:04x}*/                   @P0 BRA 0x10 ;")
    lines.append(f"        /*{addr + 0x10:04x}*/                   EXIT ;")
    return "\n".join(lines) + "\n"


def test_parse_ptxas_log_and_spills():
    k = ksc.parse_ptxas(_log(KERNEL, 244) + _log("_Z5otherv", 30, spill=8, smem=0))
    assert k[KERNEL] == {"static_smem": 128, "spill_stores": 0, "spill_loads": 0, "regs": 244}
    assert k["_Z5otherv"]["spill_stores"] == 8


def test_main_loop_opcodes():
    ops = ["LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]", "BAR.SYNC.DEFER_BLOCKING 0x0", "LDSM.16.M88.4 R4, [R5]",
           "HMMA.16816.F32.BF16 R8, R4, R6, R8", "@!PT LDS RZ, [RZ]"]
    good = ksc.main_loop(ksc.sass_functions(_sass(ops))[KERNEL])
    assert good["LDGSTS"] == 1 and good["LDSM"] == 1 and good["HMMA"] == 1 and good["LDS"] == 0
    bad = ksc.main_loop(ksc.sass_functions(_sass(["LDS.U16 R4, [R5]", "HMMA.16816.F32.BF16 R8, R4, R6, R8"]))[KERNEL])
    assert bad["LDS"] == 1 and bad["LDGSTS"] == 0


@pytest.mark.parametrize("case", ["ok", "spill", "regs", "no_ldgsts"])
def test_check_fails_on_each_problem(tmp_path, monkeypatch, capsys, case):
    """A full run over a synthetic object directory: one attention instance per (dtype, D, tile)."""
    names = [f"_ZN5simsd20attention_mma_kernelI{t}Li{d}ELi{wm}EEEv22simsd_attention_params"
             for t in ("6__half", "13__nv_bfloat16") for d in (64, 128) for wm in (1, 2, 4)]
    log = ""
    for n in names:
        d, wm = int(n.split("Li")[1].split("E")[0]), int(n.split("ELi")[1][0])
        regs = CUDA_FIGURES[(d, 16 * wm)].regs + (1 if case == "regs" and n == KERNEL else 0)
        log += _log(n, regs, spill=4 if case == "spill" and n == KERNEL else 0)
    (tmp_path / "attention_fwd_bf16.o.log").write_text(log)
    (tmp_path / "attention_fwd_bf16.o").write_bytes(b"")
    loop = ["LDSM.16.M88.4 R4, [R5]", "HMMA.16816.F32.BF16 R8, R4, R6, R8", "BAR.SYNC 0x0"]
    if case != "no_ldgsts":
        loop.append("LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]")
    sass = "".join(_sass(loop).replace(KERNEL, n) for n in names if "nv_bfloat16" in n)
    fake = tmp_path / "cuobjdump"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{sass}EOF\n")
    fake.chmod(0o755)
    rc = ksc.main([str(tmp_path), "--cuobjdump", str(fake)])
    err = capsys.readouterr().err
    if case == "ok":
        assert rc == 0, err
    else:
        assert rc == 1 and {"spill": "spills", "regs": "CUDA_FIGURES", "no_ldgsts": "LDGSTS"}[case] in err
