#!/usr/bin/env bash
# The bitwise tests (`pytest -m bitwise`: float results equal bit for bit across shapes, rows and
# batches) again with the CPU's vector paths narrowed, as an AVX2-only CPU and an x86-64 baseline
# CPU would run them: torch's own kernels (ATEN_CPU_CAPABILITY), MKL (MKL_CBWR) and oneDNN
# (ONEDNN_MAX_CPU_ISA), and numpy (NPY_DISABLE_CPU_FEATURES) with its OpenBLAS (OPENBLAS_CORETYPE),
# whose arithmetic the Triton interpreter uses. Run by .ci/run after `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if [ "$(uname -m)" != x86_64 ]; then
    echo "bitwise tests under narrowed CPU paths: x86-64 only, skipped"
    exit 0
fi

# numpy's run-time dispatch targets to disable: those above AVX2 ("avx2"), or all ("baseline")
npy_targets() {
    "$PY" - "$1" <<'EOF'
import sys
from numpy._core._multiarray_umath import __cpu_dispatch__ as targets
above_avx2 = [t for t in targets if "AVX512" in t or t == "X86_V4"]
print(",".join(above_avx2 if sys.argv[1] == "avx2" else targets))
EOF
}

# run NAME TORCH_CAPABILITY SETTINGS...: the paths in use are printed and checked before the tests
run() {
    local name=$1 want=$2
    shift 2
    echo "== bitwise tests, $name CPU paths: $*"
    env "$@" "$PY" - "$want" <<'EOF'
import os, sys
import torch
from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
active = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
off = os.environ["NPY_DISABLE_CPU_FEATURES"].split(",")
cap = torch.backends.cpu.get_cpu_capability()
print(f"torch {cap}, numpy dispatch targets in use: {active or 'none (baseline)'}, "
      f"OpenBLAS core {os.environ['OPENBLAS_CORETYPE']}")
assert cap == sys.argv[1], f"ATEN_CPU_CAPABILITY did not take: torch uses {cap}"
assert not set(active) & set(off), f"NPY_DISABLE_CPU_FEATURES did not take: {active}"
EOF
    env "$@" "$PY" -m pytest -q -p no:cacheprovider -m bitwise tests
}

if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
    run AVX2 AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell \
        NPY_DISABLE_CPU_FEATURES="$(npy_targets avx2)"
else
    echo "== no AVX2 and FMA on this CPU: the AVX2 paths are not run"
fi
run baseline DEFAULT ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 \
    OPENBLAS_CORETYPE=Prescott NPY_DISABLE_CPU_FEATURES="$(npy_targets baseline)"
