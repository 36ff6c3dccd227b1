#!/usr/bin/env bash
# The Triton kernels compiled for sm_90 (H100/H200) with the Triton versions a GPU machine may
# have, on the CPU-only CI machine: tests/kernels/sm90_compile.py --no-spills, i.e. every variant
# the launcher uses compiles and no fp16/bf16 variant spills registers.
#
# `make test` already runs the check with the project's Triton (.venv, tests/kernels/test_sm90_compile.py,
# which also holds the figures of split_plan.TRITON_FIGURES); this adds the other versions: by default
# 3.6.0, the H200 image's. Each version is installed once (the wheel alone, --no-deps, from the package
# index: it ships its own ptxas) into a cached folder put first on PYTHONPATH of the project's Python.
#
# Environment: SIMSD_TRITON_CI_VERSIONS (default "3.6.0"), SIMSD_TRITON_CI_CACHE (default
# ~/.cache/simsd-triton-ci), PY (default .venv/bin/python). Measured on the 2-core CI machine (loaded):
# about 20 s to install a version once, about 70-140 s per version to compile the variants.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
VERSIONS="${SIMSD_TRITON_CI_VERSIONS:-3.6.0}"
CACHE="${SIMSD_TRITON_CI_CACHE:-${HOME:-/root}/.cache/simsd-triton-ci}"
log() { echo "[triton_compile_check] $*"; }
fail() { echo "[triton_compile_check] FAILED: $*" >&2; exit 1; }

for v in $VERSIONS; do
  t0=$(date +%s)
  dir="$CACHE/triton-$v"
  if ! PYTHONPATH="$dir" "$PY" -c "import sys, triton; sys.exit(triton.__version__ != '$v')" >/dev/null 2>&1; then
    rm -rf "$dir"
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$dir" "triton==$v" \
      || fail "installing triton==$v"
    log "installed triton $v into $dir ($(( $(date +%s) - t0 )) s)"
    t0=$(date +%s)
  fi
  out="$(mktemp)"
  if ! (cd "$REPO" && env -u TRITON_INTERPRET PYTHONPATH="$dir:$REPO" TRITON_DEFAULT_FP_FUSION=1 \
        "$PY" tests/kernels/sm90_compile.py --no-spills >"$out" 2>&1); then
    grep -E '"error"' "$out" >&2 || tail -30 "$out" >&2
    rm -f "$out"
    fail "Triton $v: a kernel variant does not compile for sm_90 or spills (rows above)"
  fi
  grep -q "\"triton\": \"$v\"" "$out" || { cat "$out" >&2; rm -f "$out"; fail "Triton $v was not the one imported"; }
  log "Triton $v: $(grep -c '"ok": true' "$out") variants compile for sm_90 without spills ($(( $(date +%s) - t0 )) s)"
  rm -f "$out"
done
