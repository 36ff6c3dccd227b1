# Functions of bench/device_run.sh (sourced; tests/bench/test_device_lib.py sources them alone).
#
# They read the script's variables: OUT (what comes back), LOGS (the logs' folder), DEADLINE (epoch
# seconds), RESERVE (seconds kept for the summary), E2E_FLOOR (seconds kept for bench-e2e, the last
# step) and the function `wanted NAME` (is step NAME to run).

# pack: logs.tar.gz, everything under $LOGS, replaced atomically (a run cut mid-way keeps the last
# one). Steps run in the background pack too, so two packs may overlap: each writes its own
# temporary archive, and one at a time moves it into $OUT (a lock directory, given up after 10 s in
# case a killed pack left it). A log that grows while it is read is packed as far as it was
# (GNU tar's exit status 1, "file changed as we read it"). Returns tar's fatal or mv's failure.
pack() {
    local tmp rc i
    tmp=$(mktemp "$LOGS.tar.XXXXXX") || return 1
    tar -czf "$tmp" -C "$LOGS" . 2>/dev/null
    if [ $? -gt 1 ]; then
        rm -f "$tmp"
        return 1
    fi
    for i in $(seq 100); do
        mkdir "$LOGS.lock" 2>/dev/null && break
        sleep 0.1
    done
    mv -f "$tmp" "$OUT/logs.tar.gz"
    rc=$?
    rmdir "$LOGS.lock" 2>/dev/null
    rm -f "$tmp"
    return $rc
}

# step_limit NAME WANT: the seconds step NAME may run now: WANT, cut to what the budget leaves after
# the summary's RESERVE and, for every step but bench-e2e while bench-e2e is still to run, after
# bench-e2e's E2E_FLOOR (bench-e2e comes last and would otherwise absorb every earlier overrun).
step_limit() {
    local name=$1 want=$2 left
    left=$((DEADLINE - RESERVE - $(date +%s)))
    if [ "$name" != bench-e2e ] && wanted bench-e2e; then
        left=$((left - E2E_FLOOR))
    fi
    echo $((want < left ? want : left))
}
