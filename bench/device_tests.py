"""Run groups of pytest tests in parallel shards and report per group (bench/device_run.sh).

    python bench/device_tests.py --log-dir LOGS --json OUT/tests.json --jobs 12 \
        --group cuda-kernels="tests/kernels/test_cuda_attention.py" \
        --group engine="-m gpu tests/simsd" --cost cuda-kernels=0.05 --cost engine=8

Each ``--group NAME=ARGS`` is collected with ``pytest --collect-only -q ARGS`` (markers, ``-k``
and paths apply there); each group's node ids are dealt round-robin to its own shards, which run
in parallel (on a GPU machine: Triton kernels compile on many cores at once; the GPU is shared).
Groups never share a process, so a failure in one cannot touch another's results.

Shards are dealt by cost, not count (:func:`deal`): ``--cost NAME=SECONDS`` is a group's estimated
seconds per test (default 1; on the GPU a Triton test costs its cold compiles, a CUDA test a
launch), and the ``--jobs`` processes go one at a time to the group with the most estimated
seconds per shard (each group at least one, at most one per test), which minimises the longest
shard. ``tests.json`` records each group's shards and their seconds, to correct the estimates.

Isolation within a group: a failed test does not stop its shard unless it left the process's CUDA
context broken (a CUDA error is sticky and would fail every later test of the process): this
module, loaded into every shard as a pytest plugin, synchronises the device after each failure
and ends the process when that raises (exit status :data:`BROKEN_CONTEXT`). A shard also stops
at a crash (the process dies: the test that was running is recorded as ``crashed``, an error);
either way it restarts with the tests it has not run, until they are done or the deadline comes.
The shard killed at the deadline records its running test as not run, not as a crash. Each shard
runs with ``OMP_NUM_THREADS`` = the machine's cores / ``--jobs`` (unless set), so that twelve
shards on sixteen cores do not each start sixteen threads. Every test also has ``--test-timeout`` seconds
(pytest-timeout). Output: ``pytest -v`` of every shard run in ``LOGS/tests.log`` (each cut to its
head and tail past 120 kB), so a shard killed by the deadline still reports the tests it finished.

``--json`` (default ``LOGS/tests.json``): per group the counts ``passed, failed, error, skipped,
not_run`` and the ids of failures and of tests not run, plus ``timed_out``, ``shards`` (``[tests,
seconds]`` per shard) and ``cost_estimate_s``. Deadline:
``--timeout`` seconds, default the device script's ``SIMSD_STEP_LIMIT`` minus 10. Exit status 0
when no test failed, errored or was left unrun.
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
#: ``--inject-crash``: the environment variable naming the test this module, loaded as a pytest
#: plugin, aborts (a process killed mid-test, as by a CUDA fault; tests/bench/test_device_run.py)
CRASH_ENV = "SIMSD_DEVICE_CRASH_TEST"


#: the exit status of a shard whose CUDA context a failed test left broken (restart, no crash)
BROKEN_CONTEXT = 70
#: tests only: the environment variable naming a test whose failure this plugin treats as having
#: broken the CUDA context (tests/bench/test_device_run.py; a CPU has no context to break)
BREAK_ENV = "SIMSD_DEVICE_BREAK_TEST"


def pytest_runtest_call(item):  # pytest hook (every shard loads this module): --inject-crash's abort
    if os.environ.get(CRASH_ENV) == item.nodeid:
        os.abort()


def pytest_runtest_logreport(report):  # pytest hook: after a failure, is the CUDA context still usable?
    if not report.failed:
        return
    if os.environ.get(BREAK_ENV) == report.nodeid:
        import pytest
        pytest.exit(f"{report.nodeid} left the CUDA context broken (injected)", returncode=BROKEN_CONTEXT)
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001  (a sticky CUDA error: every later test would fail)
        import pytest
        pytest.exit(f"{report.nodeid} left the CUDA context broken: {str(exc).splitlines()[0][:200]}",
                    returncode=BROKEN_CONTEXT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log-dir", required=True, help="tests.log and the shard logs")
    p.add_argument("--json", default=None, help="the per-group report (default LOG_DIR/tests.json)")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--timeout", type=float, default=None, help="deadline of the whole run, seconds")
    p.add_argument("--test-timeout", type=float, default=120.0, help="seconds per test")
    p.add_argument("--group", action="append", default=[], help="NAME=pytest arguments (repeatable)")
    p.add_argument("--cost", action="append", default=[], metavar="NAME=SECONDS",
                   help="estimated seconds per test of group NAME (repeatable; default 1)")
    p.add_argument("--inject-crash", default=None, metavar="GROUP", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.timeout is None:
        limit = float(os.environ.get("SIMSD_STEP_LIMIT", "600"))
        args.timeout = max(10.0, limit - 10)
    args.json = args.json or os.path.join(args.log_dir, "tests.json")
    groups = {}
    for g in args.group:
        name, sep, rest = g.partition("=")
        if not sep or not name or not rest.strip():
            p.error(f"--group {g!r}: expected NAME=pytest arguments")
        groups[name] = rest.split()
    if not groups:
        p.error("give at least one --group")
    args.costs = {}
    for c in args.cost:
        name, sep, value = c.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not sep or name not in groups or not seconds > 0:
            p.error(f"--cost {c!r}: expected NAME=SECONDS with a group's NAME and SECONDS > 0")
        args.costs[name] = seconds
    if args.inject_crash is not None and args.inject_crash not in groups:
        p.error(f"--inject-crash {args.inject_crash!r}: no such group (groups: {', '.join(groups)})")
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


def crashed_test(text: str, pending: list) -> str | None:
    """The test a dead shard was running: the last pending id that ``pytest -v`` announced (it
    writes the id when a test starts and the status when it ends; a crash leaves the id alone or
    followed by the fault's message), else the first pending id."""
    for line in reversed(text.splitlines()):
        for nid in pending:
            if line.startswith(nid + " ") or line == nid:
                return nid
    return pending[0] if pending else None


def deal(ids: dict, jobs: int, cost: dict | None = None) -> list:
    """``[(group, ids)]`` shards: each group's ids round-robin over its share of ``jobs``.

    ``cost``: group -> estimated seconds per test (default 1). Every group with tests gets one
    shard, then each further shard goes to the group with the largest estimated seconds per shard
    (``tests * cost / shards``; a group never gets more shards than tests), so the longest shard is
    as short as the estimates allow. ``max(jobs, groups)`` shards at most."""
    cost = cost or {}
    work = {name: len(nids) * cost.get(name, 1.0) for name, nids in ids.items() if nids}
    shares = dict.fromkeys(work, 1)
    for _ in range(jobs - len(work)):
        open_groups = [name for name in work if shares[name] < len(ids[name])]
        if not open_groups:
            break
        busiest = max(open_groups, key=lambda name: work[name] / shares[name])
        shares[busiest] += 1
    return [(name, ids[name][i::share]) for name, share in shares.items() for i in range(share)]


class Shard:
    """One group's slice of tests, run by successive pytest processes until done or out of time."""

    def __init__(self, index, group, ids, log_dir, test_timeout, crash_id=None):
        self.index, self.group, self.pending = index, group, list(ids)
        self.log_dir, self.test_timeout, self.crash_id = log_dir, test_timeout, crash_id
        self.seen, self.crashed, self.text, self.runs, self.proc = {}, [], "", 0, None
        self.size, self.seconds, self.t0 = len(self.pending), 0.0, None

    def start(self, threads: int = 1):
        self.runs += 1
        self.t0 = time.time()
        self.log = os.path.join(self.log_dir, f"tests-shard{self.index}-run{self.runs}.log")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        env["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__)) + os.pathsep + env.get("PYTHONPATH", "")
        if self.crash_id:
            env[CRASH_ENV] = self.crash_id
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(BASE + ["-p", "device_tests", "-v", "--tb=short", "-rfE", "-o",
                                                 f"timeout={self.test_timeout:g}", *self.pending],
                                         stdout=f, stderr=subprocess.STDOUT, env=env)

    def finish(self, killed: bool = False):
        """Read the finished process's log; returns True when tests remain to be run. ``killed``:
        stopped at the deadline (its running test is left not run, not blamed as a crash)."""
        with open(self.log) as f:
            body = f.read()
        os.remove(self.log)
        self.seconds += time.time() - self.t0
        self.text += f"\n===== shard {self.index} ({self.group}) run {self.runs} (exit {self.proc.returncode}) " \
                     f"=====\n" + (body if len(body) <= MAX_SHARD_LOG else
                                  body[:MAX_SHARD_LOG // 4] + "\n[... cut ...]\n" + body[-3 * MAX_SHARD_LOG // 4:])
        seen = outcomes(body)
        self.seen.update(seen)
        pending = [nid for nid in self.pending if nid not in seen]
        # died (a signal, an abort, an internal error), or stopped without running anything new; a
        # broken CUDA context (BROKEN_CONTEXT) has its failed test recorded already
        if pending and not killed and self.proc.returncode != BROKEN_CONTEXT and \
                (self.proc.returncode not in (0, 1, 5) or not seen):
            nid = crashed_test(body, pending)
            self.crashed.append(nid)
            self.seen[nid] = "ERROR"
            self.text += f"\n===== {nid}: CRASHED (the process exited with {self.proc.returncode}) =====\n"
            pending.remove(nid)
        self.pending = pending
        self.proc = None
        return bool(pending)


def summarize(groups: dict, ids: dict, seen: dict, errors: dict, crashed=()) -> dict:
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
                failures.append(nid + (" (crashed)" if nid in crashed else ""))
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
    os.makedirs(args.log_dir, exist_ok=True)
    ids, errors = collect(args.groups, deadline)
    for name in args.groups:
        print(f"# {name}: {len(ids[name])} tests collected{' (collection error)' if name in errors else ''}",
              flush=True)
    crash_id = ids[args.inject_crash][0] if args.inject_crash and ids[args.inject_crash] else None
    shards = [Shard(i, g, s, args.log_dir, args.test_timeout, crash_id if crash_id in s else None)
              for i, (g, s) in enumerate(deal(ids, args.jobs, args.costs))]
    threads = max(1, (os.cpu_count() or 1) // max(1, len(shards)))
    for s in shards:
        s.start(threads)
    timed_out = False
    while any(s.proc is not None for s in shards):
        for s in shards:
            if s.proc is not None and s.proc.poll() is not None:
                if s.finish() and time.time() < deadline - 5:
                    s.start(threads)
        if time.time() >= deadline:
            timed_out = True
            for s in shards:
                if s.proc is not None:
                    s.proc.kill()
                    s.proc.wait()
                    s.finish(killed=True)
            break
        time.sleep(0.2)
    timed_out = timed_out or any(s.pending for s in shards)
    seen = {k: v for s in shards for k, v in s.seen.items()}
    crashed = [nid for s in shards for nid in s.crashed]
    with open(os.path.join(args.log_dir, "tests.log"), "a") as out:
        for s in shards:
            out.write(s.text)
        for name, err in errors.items():
            out.write(f"\n===== collection of {name} failed =====\n{err}\n")
    summary = summarize(args.groups, ids, seen, errors, crashed)
    for name, g in summary.items():
        mine = [s for s in shards if s.group == name]
        g["timed_out"] = any(s.pending for s in mine)
        # per shard: [tests dealt, seconds its processes ran] (the measured cost of the group's tests)
        g["shards"] = [[s.size, round(s.seconds, 1)] for s in mine]
        g["cost_estimate_s"] = args.costs.get(name, 1.0)
    with open(args.json, "w") as f:
        json.dump(dict(groups=summary, wall_s=round(time.time() - t0, 1), timed_out=timed_out, jobs=len(shards),
                       restarts=sum(s.runs - 1 for s in shards),
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
