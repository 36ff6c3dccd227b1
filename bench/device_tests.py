"""Run groups of pytest tests in parallel shards and report per group (bench/device_run.sh).

    python bench/device_tests.py --out-dir OUT --jobs 12 \
        --group cuda-kernels="tests/kernels/test_cuda_attention.py" \
        --group engine="-m gpu tests/simsd"

Each ``--group NAME=ARGS`` is collected with ``pytest --collect-only -q ARGS`` (markers, ``-k``
and paths apply there); the node ids of all groups are dealt round-robin to ``--jobs`` pytest
processes that run in parallel (on a GPU machine: Triton kernels compile on many cores at once;
the GPU is shared). Every shard runs ``pytest -v`` with its output in ``OUT/tests.log`` (shard
logs concatenated, each cut to its head and tail past 120 kB), so a shard killed by the
deadline still reports the tests it finished.
``OUT/tests.json``: per group the counts ``passed, failed, error, skipped, not_run`` and the ids
of failures and of tests not run. Deadline: ``--timeout`` seconds, default the device script's
``SIMSD_STEP_LIMIT`` minus 10. Exit status 0 when no test failed, errored or was left unrun.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

STATUS = re.compile(r"^(\S.*?::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
MAX_SHARD_LOG = 120_000
BASE = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts="]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--group", action="append", default=[], help="NAME=pytest arguments (repeatable)")
    args = p.parse_args(argv)
    if args.timeout is None:
        limit = float(os.environ.get("SIMSD_STEP_LIMIT", "600"))
        args.timeout = max(10.0, limit - 10)
    groups = {}
    for g in args.group:
        name, sep, rest = g.partition("=")
        if not sep or not name or not rest.strip():
            p.error(f"--group {g!r}: expected NAME=pytest arguments")
        groups[name] = rest.split()
    if not groups:
        p.error("give at least one --group")
    args.groups = groups
    return args


def collect(groups: dict, deadline: float) -> tuple:
    """``(ids, errors)``: node ids of ``pytest --collect-only -q ARGS`` per group (in parallel)."""
    procs = {name: subprocess.Popen(BASE + ["--collect-only", "-q", *gargs], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, gargs in groups.items()}
    ids, errors = {}, {}
    for name, p in procs.items():
        try:
            out, err = p.communicate(timeout=max(5.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            ids[name], errors[name] = [], "collection timed out"
            continue
        ids[name] = [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]
        if p.returncode not in (0, 5):  # 5: nothing collected
            errors[name] = (out + err)[-3000:]
    return ids, errors


def outcomes(text: str) -> dict:
    """node id -> last status seen in ``pytest -v`` output (a teardown ERROR overrides PASSED)."""
    seen = {}
    for line in text.splitlines():
        m = STATUS.match(line)
        if m:
            nid, status = m.group(1), m.group(2)
            if seen.get(nid) in ("FAILED", "ERROR") and status == "PASSED":
                continue
            seen[nid] = status
    return seen


def summarize(groups: dict, ids: dict, seen: dict, errors: dict) -> dict:
    out = {}
    for name in groups:
        counts = dict(passed=0, failed=0, error=0, skipped=0, not_run=0)
        failures, unrun = [], []
        for nid in ids.get(name, []):
            status = seen.get(nid)
            if status in ("PASSED", "XPASS", "XFAIL"):
                counts["passed"] += 1
            elif status == "SKIPPED":
                counts["skipped"] += 1
            elif status == "FAILED":
                counts["failed"] += 1
                failures.append(nid)
            elif status == "ERROR":
                counts["error"] += 1
                failures.append(nid)
            else:
                counts["not_run"] += 1
                unrun.append(nid)
        out[name] = dict(counts, collected=len(ids.get(name, [])), failures=failures[:50], not_run_ids=unrun[:50],
                         collection_error=errors.get(name, ""))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    deadline = t0 + args.timeout
    os.makedirs(args.out_dir, exist_ok=True)
    ids, errors = collect(args.groups, deadline)
    for name in args.groups:
        print(f"# {name}: {len(ids[name])} tests collected{' (collection error)' if name in errors else ''}",
              flush=True)
    flat = [nid for name in args.groups for nid in ids[name]]
    shards = [flat[i::args.jobs] for i in range(args.jobs)]
    shards = [s for s in shards if s]
    logs = [os.path.join(args.out_dir, f"tests-shard{i}.log") for i in range(len(shards))]
    procs = []
    for ids_i, log in zip(shards, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(BASE + ["-v", "--tb=short", "-rfE", *ids_i], stdout=f,
                                          stderr=subprocess.STDOUT))
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = ""
    with open(os.path.join(args.out_dir, "tests.log"), "a") as out:
        for i, log in enumerate(logs):
            with open(log) as f:
                body = f.read()
            text += body
            if len(body) > MAX_SHARD_LOG:  # keep the returned file small: head and tail of the shard
                body = body[:MAX_SHARD_LOG // 4] + "\n[... cut ...]\n" + body[-3 * MAX_SHARD_LOG // 4:]
            out.write(f"\n===== shard {i} (exit {procs[i].returncode}) =====\n{body}")
            os.remove(log)
        for name, err in errors.items():
            out.write(f"\n===== collection of {name} failed =====\n{err}\n")
    summary = summarize(args.groups, ids, outcomes(text), errors)
    with open(os.path.join(args.out_dir, "tests.json"), "w") as f:
        json.dump(dict(groups=summary, wall_s=round(time.time() - t0, 1), timed_out=timed_out, jobs=len(shards),
                       args={k: " ".join(v) for k, v in args.groups.items()}), f, indent=1)
    bad = False
    for name, s in summary.items():
        print(f"# {name}: {s['passed']} passed, {s['failed']} failed, {s['error']} error, {s['skipped']} skipped, "
              f"{s['not_run']} not run (of {s['collected']})", flush=True)
        for nid in s["failures"][:10]:
            print(f"#   FAILED {nid}")
        bad |= bool(s["failed"] or s["error"] or s["not_run"] or s["collection_error"])
    print(f"# {time.time() - t0:.1f} s, {len(shards)} shards{', deadline reached' if timed_out else ''}")
    return 1 if bad or timed_out else 0


if __name__ == "__main__":
    sys.exit(main())
