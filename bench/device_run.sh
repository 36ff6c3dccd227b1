#!/usr/bin/env bash
# One prepared run on the lent GPU machine (docs/design.md §8): build, GPU tests, both benchmarks.
#
#   bash bench/device_run.sh            # from the repository root; writes everything under $OUT
#
# Steps (each with its own time limit, about 8 minutes in all; a failing step does not stop the
# others): install the package (builds the CUDA extension when csrc/ and setup.py provide one;
# nothing is downloaded: --no-deps, the machine's torch/triton are used), the GPU tests
# (pytest -m gpu), bench/bench_attention.py --quick, bench/bench_e2e.py --quick. Files under
# $OUT (at most 8 come back from the device tool): steps.txt, install.log, gpu-tests.log,
# bench-attention.log, bench-e2e.log, attention.jsonl, e2e.jsonl, env.txt. A short table is
# printed last. Copy the jsonl rows into bench/results/ to commit them.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset SIMSD_ATTENTION_BACKEND TRITON_INTERPRET
: > "$OUT/steps.txt"

step() {  # step NAME LIMIT_SECONDS CMD...
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "$name $rc $(( $(date +%s) - t0 )) $limit" >> "$OUT/steps.txt"
    echo "== $name: exit $rc" >&2
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" 2>&1
  git rev-parse --short HEAD 2>/dev/null || echo "no git"; } > "$OUT/env.txt"

if [ "${SIMSD_SKIP_INSTALL:-0}" = 1 ]; then  # a dry run elsewhere: leave that environment alone
    echo "install skipped (SIMSD_SKIP_INSTALL=1)" > "$OUT/install.log"; echo "install skipped 0 150" >> "$OUT/steps.txt"
else
    # H200 = sm_90: build that arch only, with the machine's 16 cores
    export SIMSD_CUDA_ARCHS=${SIMSD_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16}
    step install 150 $PY -m pip install --no-build-isolation --no-deps --no-cache-dir -e .
fi
step gpu-tests 150 $PY -m pytest -m gpu tests -q -p no:cacheprovider -o addopts=""
step bench-attention 100 $PY bench/bench_attention.py --quick --out "$OUT/attention.jsonl"
step bench-e2e 180 $PY bench/bench_e2e.py --quick --out "$OUT/e2e.jsonl"

echo
cat "$OUT/env.txt"
echo "--- bench_e2e summary"
sed -n '/^# e2e summary/,$p' "$OUT/bench-e2e.log" | head -40
echo "--- gpu tests: $(grep -E '(passed|failed|error|skipped)' "$OUT/gpu-tests.log" | tail -1)"
printf '%-16s %5s %8s %6s\n' step exit seconds limit
while read -r name rc secs limit; do printf '%-16s %5s %8s %6s\n' "$name" "$rc" "$secs" "$limit"; done < "$OUT/steps.txt"
