#!/usr/bin/env bash
# One prepared run on the lent GPU machine (issue 12, docs/design.md §8): in at most 8 minutes of wall
# time on an H200 with 16 cores, settle every GPU path: correct or not, and how fast.
#
#   bash bench/device_run.sh                          # on the GPU machine; results under $OUT
#   SIMSD_DEVICE_DRY_RUN=1 bash bench/device_run.sh   # on a CPU: same logic and file names on tiny
#                                                     # cases (torch + Triton interpreter); CI runs it
#
# Steps in order, each under its own `timeout` and all within SIMSD_DEVICE_BUDGET seconds (default
# 470; a step that no longer fits is recorded as "skip"); every result reaches $OUT as produced:
#   env              GPU, driver, versions, git sha                              -> env.txt
#   install          pip install -e . (nothing downloaded) with SIMSD_REQUIRE_CUDA_EXT=1, sm_90,
#                    16 nvcc jobs; a failed build fails loudly                   -> install.log
#   check-triton     (in the background during install) `simsd check` of the Triton backend with 8
#                    workers: compiles every Triton specialisation of the check grid in parallel
#                                                                                -> check.jsonl, check.log
#   warm-bench       (in the background during install) compiles and self-checks the Triton shapes
#                    of the attention benchmark                                  -> attention.log
#   import-check     import simsd_kernels._C, print the build record (BUILD_INFO line) -> install.log
#   check            `simsd check --json` of every other backend (cuda, torch) and auto
#                                                                                -> check.jsonl, check.log
#   tests            pytest in parallel shards (bench/device_tests.py): the CUDA kernel tests (Triton
#                    cross-check on one case per mode and dtype); the Triton kernel, custom-op and
#                    adapter tests compiled for the GPU (TRITON_INTERPRET unset, whole files: no -m
#                    filter); the engine GPU tests (graphs == eager, host reads) -> tests.log, tests.json
#   bench-attention  only backends that passed the check (and their per-case self-check); rows
#                    flushed one by one with max_diff and INVALID marks; FlexAttention last, behind
#                    a 25 s budget                                               -> attention.jsonl, .log
#   bench-e2e        per-forward latencies, modelled and measured tokens/s       -> e2e.jsonl, e2e.log
#   summary          per path correct / wrong / not run, key ratios (printed last) -> summary.txt
# steps.txt holds "name exit seconds limit" per step. Exit status 0 when every step passed and no
# path is wrong. Copy the jsonl rows (and summary.txt) into bench/results/ to commit them.
set -u
cd "$(dirname "$0")/.."
DRY=${SIMSD_DEVICE_DRY_RUN:-0}
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
PY=${PY:-python3}
T0=$(date +%s)
BUDGET=${SIMSD_DEVICE_BUDGET:-470}
DEADLINE=$((T0 + BUDGET))
RESERVE=8      # seconds kept for the summary
MIN_STEP=10    # a step with less time than this is not started
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset SIMSD_ATTENTION_BACKEND SIMSD_TRUST_BACKENDS TRITON_INTERPRET
: > "$OUT/steps.txt"
for f in install.log check.jsonl check.log tests.log tests.json attention.jsonl attention.log e2e.jsonl e2e.log \
         summary.txt; do
    rm -f "$OUT/$f"
done

if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    DEV=(--device cpu)
    CHECK_TRITON=(--backends triton --dtypes float32 --head-dims 64,96 --mask-modes paper --groups 4 --caches short,split
                  --jobs 2)
    CHECK_REST=(--backends all --exclude triton --dtypes float32 --head-dims 64,96 --mask-modes paper --groups 1,4
                --caches short)
    TEST_JOBS=2
    GROUP_CUDA="tests/kernels/test_cuda_attention.py -k splits2"
    GROUP_TRITON="tests/kernels/test_triton_attention.py -k softmax tests/kernels/test_mask_mirror.py"
    GROUP_ENGINE="tests/simsd/engine/test_graph_check.py -k stale tests/simsd/engine/test_graphs.py"
    BENCH_ATT=(--cpu-smoke --layouts paper --flex-budget 2)
    BENCH_E2E=(--cpu-smoke)
else
    DEV=()
    CHECK_TRITON=(--backends triton --full --jobs 8)
    CHECK_REST=(--backends all --exclude triton --full --jobs 6)
    TEST_JOBS=12
    GROUP_CUDA="tests/kernels/test_cuda_attention.py tests/kernels/test_cuda_mask_rule.py"
    GROUP_TRITON="tests/kernels/test_triton_attention.py tests/kernels/test_triton_backend.py
        tests/kernels/test_append_kv.py tests/kernels/test_mask_mirror.py tests/kernels/test_custom_ops.py
        tests/kernels/test_hf_adapter.py tests/kernels/test_flex_mask.py tests/kernels/test_backend_selfcheck.py"
    GROUP_ENGINE="-m gpu tests/simsd"
    BENCH_ATT=(--quick --flex-budget 25)
    BENCH_E2E=(--quick)
fi

# step NAME LIMIT STDOUT STDERR CMD...: run CMD under `timeout` (the limit cut to what the budget
# leaves), stdout and stderr appended to files under $OUT; records "name exit seconds limit".
step() {
    local name=$1 want=$2 out=$3 err=$4 left limit t0 rc
    shift 4
    left=$((DEADLINE - RESERVE - $(date +%s)))
    limit=$((want < left ? want : left))
    if [ "$limit" -lt "$MIN_STEP" ]; then
        echo "$name skip 0 $want" >> "$OUT/steps.txt"
        echo "== $name: not run (time budget spent)" >&2
        return 0
    fi
    t0=$(date +%s)
    SIMSD_STEP_LIMIT=$limit timeout -k 5 "$limit" "$@" >> "$OUT/$out" 2>> "$OUT/$err"
    rc=$?
    echo "$name $rc $(( $(date +%s) - t0 )) $limit" >> "$OUT/steps.txt"
    echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s (limit $limit s)" >&2
    return 0
}

# ---- env
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" 2>&1
  echo "git $(git rev-parse --short HEAD 2>/dev/null || echo none)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
  echo "nproc $(nproc) dry_run $DRY budget ${BUDGET}s"; } > "$OUT/env.txt"
echo "env 0 $(( $(date +%s) - T0 )) 10" >> "$OUT/steps.txt"

# ---- install || check-triton || warm-bench
step check-triton 150 check.jsonl check.log \
    $PY -m simsd_kernels.check "${DEV[@]}" "${CHECK_TRITON[@]}" --json --quiet &
BG_CHECK=$!
step warm-bench 150 attention.log attention.log \
    $PY bench/bench_attention.py "${BENCH_ATT[@]}" --warm-only &
BG_WARM=$!
if [ "$DRY" = 1 ]; then  # leave this machine's environment alone
    step install 30 install.log install.log echo "dry run: pip install skipped"
    step import-check 60 install.log install.log $PY -c "
import json, simsd_kernels
try:
    import simsd_kernels.cuda_backend as cb
    info = cb.build_info()
except ImportError as exc:
    info = {}
    print('dry run: no CUDA extension here:', str(exc).splitlines()[0][:200])
print('BUILD_INFO ' + json.dumps(info))"
else
    SIMSD_REQUIRE_CUDA_EXT=1 SIMSD_CUDA_ARCHS=${SIMSD_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-16} \
        step install 150 install.log install.log \
        $PY -m pip install --no-build-isolation --no-deps --no-cache-dir -e .
    step import-check 60 install.log install.log $PY -c "
import json, torch
import simsd_kernels._C  # noqa: F401  (fails loudly when the extension is missing or broken)
import simsd_kernels.cuda_backend as cb
info = cb.build_info()
assert info.get('cuda_extension') and info.get('archs'), info
for op in ('attention', 'append_kv', 'mask_table'):
    assert hasattr(torch.ops.simsd_cuda, op), op
print('BUILD_INFO ' + json.dumps(info))
print('cuda backend available:', cb.is_available(torch.device('cuda')))"
fi
wait "$BG_CHECK" "$BG_WARM"

# ---- check of the other backends and auto
step check 60 check.jsonl check.log \
    $PY -m simsd.entrypoints.cli check "${DEV[@]}" "${CHECK_REST[@]}" --json --quiet

# ---- tests (CUDA extension required: a missing one fails the CUDA tests instead of skipping them)
SIMSD_REQUIRE_CUDA_EXT=$([ "$DRY" = 1 ] && echo 0 || echo 1) \
    step tests 150 tests.log tests.log $PY bench/device_tests.py --out-dir "$OUT" --jobs "$TEST_JOBS" \
    --group "cuda-kernels=$GROUP_CUDA" --group "triton-kernels=$GROUP_TRITON" --group "engine=$GROUP_ENGINE"

# ---- benchmarks: only backends that passed
step bench-attention 70 attention.log attention.log \
    $PY bench/bench_attention.py "${BENCH_ATT[@]}" --check "$OUT/check.jsonl" --out "$OUT/attention.jsonl"
step bench-e2e 90 e2e.log e2e.log $PY bench/bench_e2e.py "${BENCH_E2E[@]}" --out "$OUT/e2e.jsonl"

# ---- the table, last
echo
$PY bench/device_summary.py "$OUT"
rc=$?
echo "(wall $(( $(date +%s) - T0 )) s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' '))"
exit $rc
