"""Ahead-of-time compile of every simsd Triton kernel variant for an sm_90 (H100/H200) target.

Run as a script in a process *without* ``TRITON_INTERPRET`` (the interpreter replaces
``@triton.jit`` functions, which then cannot be compiled)::

    python tests/kernels/sm90_compile.py [--full] [--no-spills]

Prints one JSON line per variant (name, ok, registers, spill bytes, shared memory, approx sin/cos
used, error) and exits non-zero when a variant fails, or with ``--no-spills`` when an fp16/bf16
variant spills registers (the fp32 test path is register-bound and may). Needs no GPU: Triton
ships ``ptxas`` in its wheel; registers and spills come from ``ptxas -v`` on the variant's PTX with
Triton's own options. Runs with whichever Triton imports first (.ci/triton_compile_check.sh puts
another version first on PYTHONPATH).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ELT = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


def _attrs(fn, names):
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def fwd_source(dtype, head_dim, group, block_m):
    """The attention kernel as the launcher specialises it: one variant per (dtype, D, G, BLOCK_M);
    mask mode, split count, least tiles per split and the invariant flag are runtime arguments."""
    import triton

    from triton_ops.attention import temporal_attn_fwd_kernel as fn

    ptr = ELT[dtype]
    sig = {n: ptr for n in ("QR", "KR", "V", "KC", "VC", "OUT")}
    sig.update(SEQLENS="*i32", LABELS="*i32", O_PART="*fp32", LSE_PART="*fp32", BT="*i32")
    strides = ("sqb sqt sqh skb skt skh svb svt svh skcp skct skch svcp svct svch slb slt sob sot soh").split()
    runtime = "Lq Hq Lmax total_rows mask_mode num_splits min_tiles invariant page_size sbt".split()
    sig.update({n: "i32" for n in strides + runtime})
    sig.update(qk_scale="fp32")
    consts = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=64, UPCAST=False, ONE_PAGE=True,
                  DOT_PREC="ieee" if dtype == "fp32" else "tf32")
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fn.arg_names}
    aligned = ["QR", "KR", "V", "KC", "VC", "OUT", "O_PART", "LSE_PART"] + strides[:15] + ["sob", "sot", "soh"]
    return triton.compiler.ASTSource(fn, signature=sig, constexprs=consts, attrs=_attrs(fn, aligned))


def merge_source(dtype, head_dim):
    import triton

    from triton_ops.attention import merge_splits_kernel as fn

    sig = dict(O_PART="*fp32", LSE_PART="*fp32", OUT=ELT[dtype], SEQLENS="*i32")
    for n in fn.arg_names:
        sig.setdefault(n, "i32")
    consts = dict(HEAD_DIM=head_dim, BLOCK_N=64)
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fn.arg_names}
    return triton.compiler.ASTSource(fn, signature=sig, constexprs=consts)


def rope_source(dtype, head_dim):
    import triton

    from triton_ops.attention import rope_qk_kernel as fn

    ptr = ELT[dtype]
    sig = dict(Q=ptr, K=ptr, POS="*i64", QR=ptr, KR=ptr, log2_theta_hi="fp32", log2_theta_lo="fp32")
    for n in fn.arg_names:
        sig.setdefault(n, "i32")
    consts = dict(HEAD_DIM=head_dim, BLOCK_H=16)
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fn.arg_names}
    return triton.compiler.ASTSource(fn, signature=sig, constexprs=consts)


def append_source(dtype, head_dim):
    import triton

    from triton_ops.append_kv import append_kv_kernel as fn

    ptr = ELT[dtype]
    sig = dict(K=ptr, V=ptr, POS="*i64", KC=ptr, VC=ptr, SEQLENS="*i32", BT="*i32", log2_theta_hi="fp32",
               log2_theta_lo="fp32")
    for n in fn.arg_names:
        sig.setdefault(n, "i32")
    consts = dict(HEAD_DIM=head_dim, BLOCK_T=16)
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fn.arg_names}
    return triton.compiler.ASTSource(fn, signature=sig, constexprs=consts)


def moe_gemm_source(kernel, dtype, block_m):
    """A fused-MoE grouped GEMM (``gate_up`` or ``down``) as :func:`triton_ops.ops.fused_moe_fwd`
    launches it: one variant per (dtype, BLOCK_M); sizes and strides are runtime arguments."""
    import triton

    from triton_ops import fused_moe
    from triton_ops.ops import MOE_BLOCK_K, MOE_BLOCK_N

    fn = fused_moe.moe_gate_up_kernel if kernel == "gate_up" else fused_moe.moe_down_kernel
    ptr = ELT[dtype]
    sig = dict(X=ptr, ACT=ptr, W=ptr, SORTED="*i32", EXPERT_OF_TILE="*i32", TOPK_W="*fp32", Y="*fp32")
    for n in fn.arg_names:
        sig.setdefault(n, "i32")
    consts = dict(BLOCK_M=block_m, BLOCK_N=MOE_BLOCK_N, BLOCK_K=MOE_BLOCK_K[dtype == "fp32"], UPCAST=False,
                  DOT_PREC="ieee" if dtype == "fp32" else "tf32")
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fn.arg_names}
    aligned = [n for n in ("X", "ACT", "W", "SORTED", "Y", "TOPK_W", "sxt", "swe", "swn", "sat", "syt")
               if n in fn.arg_names]
    return triton.compiler.ASTSource(fn, signature=sig, constexprs=consts, attrs=_attrs(fn, aligned))


def moe_combine_source(dtype, top_k):
    import triton

    from triton_ops.fused_moe import moe_combine_kernel as fn
    from triton_ops.ops import MOE_BLOCK_H

    sig = dict(Y="*fp32", OUT=ELT[dtype], H="i32", syt="i32", sot="i32", TOP_K="constexpr", BLOCK_H="constexpr")
    return triton.compiler.ASTSource(fn, signature=sig, constexprs=dict(TOP_K=top_k, BLOCK_H=MOE_BLOCK_H))


def variants(full=False):
    """(name, source factory, num_warps, num_stages) of the kernel variants the launcher uses.

    The default set: every query tile (BLOCK_M 16 / 32 / 64) at bf16 D128 G4 (SDAR-8B), fp16 D128
    G2 (SDAR-1.7B) and bf16 D64 G2, the fp32 test path once, the RoPE pre-pass, the merge and the
    append kernel; ``full`` adds bf16 D128 G2 / G1 and fp32 D64.
    """
    from triton_ops.ops import APPEND_WARPS, tile_config

    def fwd(dtype, d, g, bm):  # what the launcher runs for a plan's tile bm (triton_ops.ops.tile_config)
        bm, w, st = tile_config(bm, d, dtype == "fp32")
        return (f"fwd {dtype} D{d} G{g} BM{bm}", lambda: fwd_source(dtype, d, g, bm), w, st)

    out = [fwd("bf16", 128, 4, bm) for bm in (16, 32, 64)]
    out += [fwd("fp16", 128, 2, bm) for bm in (16, 32, 64)]
    out += [fwd("bf16", 64, 2, bm) for bm in (16, 32, 64)]
    out += [fwd("fp32", 128, 1, 16)]
    out += [
        ("rope bf16 D128", lambda: rope_source("bf16", 128), 4, 1),
        ("merge bf16 D128", lambda: merge_source("bf16", 128), 4, 1),
        ("append bf16 D128", lambda: append_source("bf16", 128), APPEND_WARPS, 1),
    ]
    from triton_ops.ops import MOE_STAGES, MOE_WARPS

    def moe(kernel, dtype, bm):
        return (f"moe_{kernel} {dtype} BM{bm}", lambda: moe_gemm_source(kernel, dtype, bm), MOE_WARPS, MOE_STAGES)

    out += [moe(k, "bf16", bm) for k in ("gate_up", "down") for bm in (16, 32, 64)]
    out += [moe(k, dt, bm) for k in ("gate_up", "down") for dt, bm in (("fp16", 64), ("fp32", 16))]
    out += [("moe_combine bf16 K8", lambda: moe_combine_source("bf16", 8), 4, 1)]
    if full:
        out += [fwd("bf16", 128, g, bm) for g in (1, 2) for bm in (16, 32, 64)] + [fwd("fp32", 64, 2, 16)]
        out += [("merge fp32 D64", lambda: merge_source("fp32", 64), 2, 1),
                ("rope fp32 D64", lambda: rope_source("fp32", 64), 4, 1),
                ("append fp32 D64", lambda: append_source("fp32", 64), APPEND_WARPS, 1)]
    return list({name: (name, *rest) for name, *rest in out}.values())  # one row per variant launched


def ptxas_figures(ptx: str, ptxas: str) -> dict:
    """``ptxas -v`` of a kernel's PTX for sm_90a: registers, spill store / load bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", src, "-o",
                               os.path.join(tmp, "k.o")], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if proc.returncode or not regs or not spill:
        raise RuntimeError(f"ptxas -v failed: {log[-1500:]}")
    return dict(regs=int(regs.group(1)), spill_stores=int(spill.group(1)), spill_loads=int(spill.group(2)))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    from triton_ops.ops import MAXNREG

    target = GPUTarget("cuda", 90, 64)
    ptxas = get_ptxas(90).path
    failed = 0
    for name, make, warps, stages in variants(full="--full" in argv):
        row = {"name": name, "ok": False}
        t0 = time.perf_counter()
        try:
            options = {"num_warps": warps, "num_stages": stages}
            if name.startswith(("fwd", "moe_gate_up", "moe_down")):
                options["maxnreg"] = MAXNREG
            kernel = triton.compile(make(), target=target, options=options)
            meta = kernel.metadata
            ptx = kernel.asm["ptx"]
            row.update(ok=True, triton=triton.__version__, shared=meta.shared, warps=warps, stages=stages,
                       ptx_lines=ptx.count("\n"), approx_trig="cos.approx" in ptx or "sin.approx" in ptx,
                       **ptxas_figures(ptx, ptxas), seconds=round(time.perf_counter() - t0, 1))
            if "--no-spills" in argv and " fp32 " not in name and (row["spill_stores"] or row["spill_loads"]):
                failed += 1
                row["error"] = f"spills {row['spill_stores']} / {row['spill_loads']} bytes (stores / loads)"
        except Exception as exc:  # report every failure, keep compiling the rest
            failed += 1
            causes, e = [], exc
            while e is not None:  # the root cause carries the useful message
                causes.append(f"{type(e).__name__}: {str(e)[-1500:]}")
                e = e.__cause__
            row["error"] = " <- ".join(reversed(causes))
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
