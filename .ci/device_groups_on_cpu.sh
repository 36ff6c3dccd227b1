#!/usr/bin/env bash
# The GPU run's test groups on the CPU-only CI machine, with what a GPU would refuse made visible:
#
#   1. every group of bench/device_run.sh (its plan, SIMSD_DEVICE_PLAN=1, is the one list) under
#      `pytest --emulate-device` (tests/device_emulation.py): a host tensor meeting one placed on
#      the device under test fails here as it does on the GPU ("Expected all tensors to be on the
#      same device": 7 tests of the first H200 run, bench/results/device_h200);
#   2. the drop-in adapter's tests with the H200 image's transformers (5.17.0, whose forward takes
#      the cache as `past_key_values`, not `cache`: 10 tests of that run), installed once without
#      its dependencies (and the huggingface-hub it needs) into a cached folder put first on
#      PYTHONPATH of the project's Python.
#
# Environment: PY (default .venv/bin/python), SIMSD_IMAGE_TRANSFORMERS (default 5.17.0),
# SIMSD_IMAGE_HUB (default 1.33.0), SIMSD_IMAGE_CACHE (default ~/.cache/simsd-image-ci).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PY:-$REPO/.venv/bin/python}"
TF="${SIMSD_IMAGE_TRANSFORMERS:-5.17.0}"
HUB="${SIMSD_IMAGE_HUB:-1.33.0}"
CACHE="${SIMSD_IMAGE_CACHE:-${HOME:-/root}/.cache/simsd-image-ci}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
log() { echo "[device_groups_on_cpu] $*"; }
fail() { echo "[device_groups_on_cpu] FAILED: $*" >&2; exit 1; }

# 1. the groups, emulated
groups=$(SIMSD_DEVICE_PLAN=1 bash bench/device_run.sh | sed -n 's/^group \([a-z-]*\)=\(.*\)$/\1=\2/p')
[ -n "$groups" ] || fail "bench/device_run.sh printed no groups"
while IFS= read -r line; do
  name=${line%%=*}
  args=${line#*=}
  t0=$(date +%s)
  rc=0
  # shellcheck disable=SC2086  # the group's pytest arguments, split as device_tests.py splits them
  "$PY" -m pytest -q -p no:cacheprovider --emulate-device $args || rc=$?
  case $rc in
    0) log "group $name: passed under --emulate-device ($(( $(date +%s) - t0 )) s)" ;;
    5) log "group $name: no test of it runs on the CPU" ;;  # pytest: nothing collected (all GPU-marked)
    *) fail "group $name under --emulate-device" ;;
  esac
done <<< "$groups"

# 2. the adapter with the image's transformers
dir="$CACHE/transformers-$TF"
if ! PYTHONPATH="$dir" "$PY" -c "import sys, transformers; sys.exit(transformers.__version__ != '$TF')" >/dev/null 2>&1
then
  rm -rf "$dir"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$dir" "transformers==$TF" \
    "huggingface-hub==$HUB" || fail "installing transformers==$TF"
fi
PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_hf_adapter.py \
  || fail "tests/kernels/test_hf_adapter.py with transformers $TF"
log "tests/kernels/test_hf_adapter.py passed with transformers $TF"
