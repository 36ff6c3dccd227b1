"""Ahead-of-time compile of every simsd Triton kernel variant for an sm_90 (H100/H200) target.

Run as a script in a process *without* ``TRITON_INTERPRET`` (the interpreter replaces
``@triton.jit`` functions, which then cannot be compiled)::

    python tests/kernels/sm90_compile.py [--full]

Prints one JSON line per variant (name, ok, shared memory bytes, approx sin/cos used, error) and exits
non-zero when a variant fails. Needs no GPU: Triton ships ``ptxas`` in its wheel.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ELT = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


def _attrs(fn, names):
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def fwd_source(dtype, head_dim, mask_mode, num_splits, group, block_m=64, block_n=64):
    import triton
    from triton_ops.attention import temporal_attn_fwd_kernel as fn

    ptr = ELT[dtype]
    sig = {n: ptr for n in ("Q", "K", "V", "KC", "VC", "OUT")}
    sig.update(SEQLENS="*i32", LABELS="*i32", POS="*i64", O_PART="*fp32", LSE_PART="*fp32")
    ints = ("sqb sqt sqh skb skt skh svb svt svh skcb skct skch svcb svct svch "
            "slb slt spb spt sob sot soh Lq Hq total_rows").split()
    sig.update({n: "i32" for n in ints})
    sig.update(log2_theta_hi="fp32", log2_theta_lo="fp32", qk_scale="fp32")
    consts = dict(GROUP=group, HEAD_DIM=head_dim, MASK_MODE=mask_mode, NUM_SPLITS=num_splits,
                  BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=False,
                  DOT_PREC="ieee" if dtype == "fp32" else "tf32")
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fn.arg_names}
    aligned = ["Q", "K", "V", "KC", "VC", "OUT", "O_PART", "LSE_PART"] + ints[:15] + ["sob", "sot", "soh"]
    return triton.compiler.ASTSource(fn, signature=sig, constexprs=consts, attrs=_attrs(fn, aligned))


def merge_source(dtype, head_dim, num_splits):
    import triton
    from triton_ops.attention import merge_splits_kernel as fn

    sig = dict(O_PART="*fp32", LSE_PART="*fp32", OUT=ELT[dtype], Lq="i32", Hq="i32",
               total_rows="i32", sob="i32", sot="i32", soh="i32")
    consts = dict(NUM_SPLITS=num_splits, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
                  HEAD_DIM=head_dim)
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fn.arg_names}
    return triton.compiler.ASTSource(fn, signature=sig, constexprs=consts)


def append_source(dtype, head_dim):
    import triton
    from triton_ops.append_kv import append_kv_kernel as fn

    ptr = ELT[dtype]
    sig = dict(K=ptr, V=ptr, POS="*i64", KC=ptr, VC=ptr, SEQLENS="*i32", log2_theta_hi="fp32", log2_theta_lo="fp32")
    for n in fn.arg_names:
        sig.setdefault(n, "i32")
    consts = dict(HEAD_DIM=head_dim, BLOCK_T=16)
    sig.update({n: "constexpr" for n in consts})
    sig = {n: sig[n] for n in fn.arg_names}
    return triton.compiler.ASTSource(fn, signature=sig, constexprs=consts)


def variants(full=False):
    """(name, source factory, num_warps, num_stages) of the kernel variants the launcher uses.

    The default set has every mask mode, dtype, head_dim, the split and no-split epilogues,
    the merge and the append kernel once; ``full`` adds every mode at the SDAR-8B shape.
    """
    out = [
        ("fwd bf16 D128 paper split8 G4", lambda: fwd_source("bf16", 128, 3, 8, 4), 4, 2),
        ("fwd bf16 D64 block_causal split3 G2 BM32",
         lambda: fwd_source("bf16", 64, 1, 3, 2, block_m=32), 4, 2),
        ("fwd fp16 D64 exact G2 BM16", lambda: fwd_source("fp16", 64, 2, 1, 2, block_m=16), 4, 2),
        ("fwd fp32 D128 bidirectional G1", lambda: fwd_source("fp32", 128, 0, 1, 1), 4, 2),
        ("merge bf16 D128 split8", lambda: merge_source("bf16", 128, 8), 4, 1),
        ("append bf16 D128", lambda: append_source("bf16", 128), 2, 1),
    ]
    if full:
        for mode in range(4):
            out.append((f"fwd bf16 D128 mode{mode} G4", lambda m=mode: fwd_source("bf16", 128, m, 1, 4), 4, 2))
        out += [
            ("merge fp32 D64 split3", lambda: merge_source("fp32", 64, 3), 2, 1),
            ("append fp32 D64", lambda: append_source("fp32", 64), 2, 1),
        ]
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 64)
    failed = 0
    for name, make, warps, stages in variants(full="--full" in argv):
        row = {"name": name, "ok": False}
        try:
            kernel = triton.compile(make(), target=target, options={"num_warps": warps, "num_stages": stages})
            meta = kernel.metadata
            row.update(ok=True, shared=meta.shared,
                       approx_trig="cos.approx" in kernel.asm["ptx"] or "sin.approx" in kernel.asm["ptx"])
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
