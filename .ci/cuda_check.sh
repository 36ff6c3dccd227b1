#!/usr/bin/env bash
# CUDA checks for the CPU-only CI machine (no GPU: nothing here launches a kernel).
#
#   1. compile every kernel translation unit csrc/*.cu with nvcc for sm_$ARCH (ptxas -v), without
#      torch, and syntax-check the torch-free headers as plain C / C++; then
#      .ci/kernel_static_check.py: 0 spill bytes in every kernel, the attention kernels' registers /
#      shared memory as split_plan.CUDA_FIGURES says, LDGSTS + LDSM in their SASS main loops;
#   2. build the extension against the CUDA build of torch (from the local package disk) in a
#      cached throwaway venv: `pip install --no-build-isolation --no-deps -e .`;
#   3. import simsd_kernels._C from that venv and run the CUDA-backend tests (the C++ mask-rule
#      mirror runs on the CPU, against the Python rule and the hand-written masks; the GPU tests skip).
#
# Environment: SIMSD_CUDA_CI_ARCH (default 90), MAX_JOBS (default 2), SIMSD_CUDA_CI_VENV (the
# venv, default ~/.cache/simsd-cuda-ci/venv; created when missing or broken, reused otherwise),
# SIMSD_CUDA_CI_TORCH (default torch==2.14.1). Idempotent; exits non-zero on any failure.
# Measured on the 2-core CI machine: step 1 41 s, step 2 92 s, step 3 12 s, plus 146 s once to
# create the venv (about 5 min in all from nothing). With the pipelined kernels (six attention
# instances per dtype TU) step 1 takes about 50 s and step 2 about 170 s (measured, with other jobs running).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARCH="${SIMSD_CUDA_CI_ARCH:-90}"
export MAX_JOBS="${MAX_JOBS:-2}"
VENV="${SIMSD_CUDA_CI_VENV:-${HOME:-/root}/.cache/simsd-cuda-ci/venv}"
TORCH_SPEC="${SIMSD_CUDA_CI_TORCH:-torch==2.14.1}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

log() { echo "[cuda_check] $*"; }
fail() { echo "[cuda_check] FAILED: $*" >&2; exit 1; }
now() { date +%s; }

NVCC="$(command -v nvcc || true)"
[ -n "$NVCC" ] || { [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc; } || true
[ -n "$NVCC" ] || fail "nvcc not found (the CI image ships the CUDA toolkit; set PATH)"

# ---- 1. kernels without torch ---------------------------------------------------------------
t0=$(now)
echo '#include "simsd_attention.h"' | cc -fsyntax-only -Wall -x c -std=c99 -I"$REPO/csrc" - \
  || fail "simsd_attention.h is not plain C"
echo '#include "mask_rule.cuh"' | c++ -fsyntax-only -Wall -x c++ -std=c++17 -I"$REPO/csrc" - \
  || fail "mask_rule.cuh is not plain C++"
echo '#include "tile_layout.cuh"' | c++ -fsyntax-only -Wall -x c++ -std=c++17 -I"$REPO/csrc" - \
  || fail "tile_layout.cuh is not plain C++"
compile_tu() {  # $1 = .cu file
  local out="$WORK/$(basename "$1" .cu).o"
  if ! "$NVCC" -std=c++17 -O3 -arch="sm_$ARCH" -Xptxas -v -I"$REPO/csrc" -c "$1" -o "$out" >"$out.log" 2>&1; then
    cat "$out.log" >&2
    echo "nvcc failed: $1" >&2
    return 1
  fi
  grep -i "warning" "$out.log" >&2 || true
}
export -f compile_tu
export NVCC ARCH REPO WORK
ls "$REPO"/csrc/*.cu | xargs -P "$MAX_JOBS" -I{} bash -c 'compile_tu "$@"' _ {} \
  || fail "a kernel translation unit does not compile for sm_$ARCH"
log "step 1: $(ls "$REPO"/csrc/*.cu | wc -l) kernel TUs compile for sm_$ARCH without torch ($(( $(now) - t0 )) s)"
CUOBJDUMP="${CUOBJDUMP:-$(command -v cuobjdump || ls "$VENV"/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump \
  "$REPO"/.venv/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump 2>/dev/null | head -1 || true)}"
[ -n "$CUOBJDUMP" ] || fail "cuobjdump not found (CUDA toolkit, or the triton wheel); set CUOBJDUMP"
python3 "$REPO/.ci/kernel_static_check.py" "$WORK" --cuobjdump "$CUOBJDUMP" >"$WORK/static.log" 2>&1 \
  || { cat "$WORK/static.log" >&2; fail "static kernel checks (spills, figures, SASS)"; }
grep "^\[kernel_static_check\] ok" "$WORK/static.log"

# ---- 2. the extension against the CUDA torch --------------------------------------------------
t0=$(now)
if ! "$VENV/bin/python" -c "import torch, sys, pytest, ninja; sys.exit(0 if torch.version.cuda else 1)" \
    >/dev/null 2>&1; then
  log "creating $VENV with $TORCH_SPEC (CUDA build, from the local package disk)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "$TORCH_SPEC" numpy ninja setuptools wheel pytest \
    >"$WORK/venv.log" 2>&1 || { tail -30 "$WORK/venv.log" >&2; fail "could not create the CUDA-torch venv"; }
  log "venv ready ($(( $(now) - t0 )) s)"
  t0=$(now)
fi
cd "$REPO"
if ! SIMSD_CUDA_ARCHS="$ARCH" "$VENV/bin/pip" install -v --no-build-isolation --no-deps -e . \
    >"$WORK/build.log" 2>&1; then
  grep -E "error|Error" "$WORK/build.log" | head -40 >&2 || true
  tail -30 "$WORK/build.log" >&2
  fail "building the CUDA extension"
fi
log "step 2: extension built for sm_$ARCH with MAX_JOBS=$MAX_JOBS ($(( $(now) - t0 )) s)"

# ---- 3. import + tests ------------------------------------------------------------------------
t0=$(now)
(cd "$WORK" && "$VENV/bin/python" - <<'PY'
import warnings
warnings.filterwarnings("ignore")
import torch
import simsd_kernels._C  # noqa: F401
import simsd_kernels.cuda_backend as cb
for op in ("attention", "append_kv", "mask_table"):
    assert hasattr(torch.ops.simsd_cuda, op), op
info = cb.build_info()
assert info.get("cuda_extension") and info.get("archs"), info
print(f"[cuda_check] step 3: simsd_kernels._C imports (torch {torch.__version__}, archs {info['archs']})")
PY
) 2>&1 | grep -v "No CUDA runtime is found" || fail "importing simsd_kernels._C"
if ! SIMSD_REQUIRE_CUDA_EXT=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_cuda_mask_rule.py tests/kernels/test_expected_masks.py tests/kernels/test_cuda_attention.py \
    -k "not engine_padding" >"$WORK/pytest.log" 2>&1; then
  tail -40 "$WORK/pytest.log" >&2
  fail "CUDA backend tests"
fi
tail -1 "$WORK/pytest.log"
log "step 3: tests done ($(( $(now) - t0 )) s)"
