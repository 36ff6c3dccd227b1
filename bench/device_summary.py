"""The table printed last by bench/device_run.sh: steps, per path correct / wrong / not run, key ratios.

    python bench/device_summary.py OUT [LOGS]  # reads env.txt, steps.txt, install.log, check.jsonl,
                                               #   tests.json, attention.jsonl, e2e.jsonl and the logs
                                               #   from OUT or LOGS; writes OUT/summary.txt

Steps: ``passed`` (exit 0), ``failed``, ``timed out`` (exit 124/137 of ``timeout``), ``not run``.
Verdicts come from the correctness checks only: the self-checks (``simsd check`` rows, the
benchmarks' per-case checks and the warnings of a run), the kernel tests and the graph-vs-eager
tests. ``correct`` (ran, every check passed), ``wrong`` (a check failed: a FAIL row, a failed or
erroring test, an INVALID benchmark row, a self-check warning), ``failed`` (a benchmark case raised
or ran out of time: its traceback is in the log), ``not run`` (no result: skipped, unavailable, out
of time), ``info`` (a measurement that is not a promise: exact == vanilla tokens on a GPU, where
the verify and denoise forwards run other tiles and GEMM kernels and near-ties may flip, docs/exactness.md).
Ratios are medians over the benchmark cases with valid rows of both providers (time of the first
/ time of the second: < 1 means faster). Exit status 1 when a path is wrong or failed or a step
did not pass.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

TEST_GROUPS = {"cuda-kernels": "tests: CUDA kernels",
               "triton-kernels": "tests: Triton kernels (GPU-compiled), ops",
               "door": "tests: door (attention + append, opcheck)",
               "fused-moe": "tests: fused MoE (16/32/64-row tiles)",
               "engine": "tests: engine (graphs == eager, host reads)"}
#: warnings printed when a backend or a CUDA graph fails its self-check during a run
CHECK_WARNINGS = ("BackendCheckWarning", "GraphCheckWarning", "BackendCheckError")


def _jsonl(path) -> list:
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut by a kill
    return rows


def find(dirs, name) -> str:
    """The path of ``name`` in the first of ``dirs`` that holds it (else in the first)."""
    for d in dirs:
        if os.path.isfile(os.path.join(d, name)):
            return os.path.join(d, name)
    return os.path.join(dirs[0], name)


def steps(dirs) -> list:
    """``[(name, rc, seconds, limit)]`` from steps.txt (rc ``skip`` for a step out of time)."""
    path = find(dirs, "steps.txt")
    rows = []
    if os.path.isfile(path):
        for line in open(path):
            parts = line.split()
            if len(parts) == 4:
                rows.append(tuple(parts))
    return rows


def step_status(rc: str) -> str:
    """``passed``, ``failed``, ``timed out`` (``timeout``'s 124, or 137 after its kill) or ``not run``."""
    return {"0": "passed", "124": "timed out", "137": "timed out", "skip": "not run"}.get(rc, "failed")


def build_verdict(dirs, step_rc) -> tuple:
    rc = step_rc.get("install")
    info = {}
    path = find(dirs, "install.log")
    if os.path.isfile(path):
        for line in open(path, errors="replace"):
            if line.startswith("BUILD_INFO "):  # printed by the import check
                try:
                    info = json.loads(line[len("BUILD_INFO "):])
                except ValueError:
                    pass
    if rc is None or rc == "skip":
        return "not run", "install step did not run"
    if rc != "0" or step_rc.get("import-check") not in ("0", None):
        return "wrong", f"install exit {rc}, import check exit {step_rc.get('import-check')} (see install.log)"
    if not info.get("cuda_extension"):
        return "not run", "no CUDA extension built (dry run or pure-Python install)"
    return "correct", f"archs {info.get('archs')}, nvcc {info.get('nvcc', '?')[-40:]}, {info.get('build_seconds')} s"


def moe_check_verdicts(rows) -> list:
    """``check: fused MoE BACKEND`` per backend of the fused-MoE rows (``op: fused_moe``)."""
    out = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        fails = [r for r in mine if r["status"] == "FAIL"]
        verdict = "wrong" if fails else ("correct" if mine else "not run")
        detail = f"{len(mine) - len(fails)} pass, {len(fails)} FAIL; resolved to " + ", ".join(
            sorted({str(r.get("resolved")) for r in mine}))
        for r in fails[:3]:
            detail += f" | FAIL {r['dtype']}: {str(r.get('detail', ''))[:100]}"
        out.append((f"check: fused MoE {backend}", verdict, detail))
    return out


def check_verdicts(rows) -> list:
    """``check: BACKEND`` per attention backend, then the fused-MoE paths (:func:`moe_check_verdicts`)."""
    moe_rows = [r for r in rows if r.get("op") == "fused_moe"]
    rows = [r for r in rows if r.get("op", "attention") == "attention"]
    out = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        n = {s: sum(r["status"] == s for r in mine) for s in ("pass", "FAIL", "refused")}
        verdict = "wrong" if n["FAIL"] else ("correct" if n["pass"] else "not run")
        worst = max((r["max_err"] / r["tol"] for r in mine if r.get("max_err") is not None and r.get("tol")),
                    default=None)
        detail = f"{n['pass']} pass, {n['FAIL']} FAIL, {n['refused']} refused"
        if worst is not None:
            detail += f"; worst err/tol {worst:.2f}"
        if backend == "auto":
            detail += "; resolved to " + ", ".join(sorted({str(r.get('resolved')) for r in mine}))
        fails = [r for r in mine if r["status"] == "FAIL"][:3]
        for r in fails:
            detail += f" | FAIL {r['dtype']} D={r['head_dim']} {r['mask_mode']} {r['cache']} G={r['group']}"
        out.append((f"check: {backend}", verdict, detail))
    return out + moe_check_verdicts(moe_rows)


def test_verdicts(dirs) -> list:
    path = find(dirs, "tests.json")
    if not os.path.isfile(path):
        return [(label, "not run", "no tests.json") for label in TEST_GROUPS.values()]
    data = json.load(open(path))
    res = []
    for name, g in data["groups"].items():
        label = TEST_GROUPS.get(name, f"tests: {name}")
        detail = (f"{g['passed']} passed, {g['failed']} failed, {g['error']} error, {g['skipped']} skipped, "
                  f"{g['not_run']} not run")
        if g["failed"] or g["error"] or g.get("collection_error"):
            verdict = "wrong"
            detail += "".join(f" | {nid}" for nid in g["failures"][:3])
            if g.get("collection_error"):
                detail += " | collection error"
        elif g["passed"] and not g["not_run"]:
            verdict = "correct"
        elif g["passed"]:
            verdict = "wrong"  # partly run: the unrun tests are not known to pass
            detail += " (out of time)" if g.get("timed_out", True) else ""
        else:
            verdict = "not run"
        res.append((label, verdict, detail))
    return res


def bench_verdicts(rows) -> list:
    res = []
    for prov in dict.fromkeys(r["provider"] for r in rows):
        mine = [r for r in rows if r["provider"] == prov]
        ran = [r for r in mine if "ms" in r]
        invalid = [r for r in ran if r.get("valid") is False]
        refused = [r for r in mine if "self-check" in r.get("error", "") or "failed simsd check" in r.get("error", "")]
        if invalid or refused:
            verdict = "wrong"
        elif ran:
            verdict = "correct" if any(r.get("valid") for r in ran) else "n/a"
        else:
            verdict = "not run"
        detail = f"{len(ran)} rows, {len(invalid)} INVALID, {len(mine) - len(ran)} skipped"
        skipped = [r for r in mine if "error" in r]
        if skipped:
            detail += f" ({skipped[0]['error'][:90]})"
        res.append((f"bench: {prov}", verdict, detail))
    return res


def warning_verdict(dirs) -> tuple:
    """Self-check failures reported while the benchmarks ran (their logs)."""
    found, seen_logs = [], False
    for name in ("attention.log", "e2e.log"):
        path = find(dirs, name)
        if os.path.isfile(path):
            seen_logs = True
            found += [line.strip() for line in open(path, errors="replace") if any(w in line for w in CHECK_WARNINGS)]
    if not seen_logs:
        return "self-checks during the benchmarks", "not run", "no benchmark logs"
    if found:
        return "self-checks during the benchmarks", "wrong", f"{len(found)} warnings: {found[0][:150]}"
    return "self-checks during the benchmarks", "correct", "no backend or graph self-check failed"


def _case(r):
    return (r.get("model"), r.get("layout"), r.get("block"), r.get("batch"), r.get("cache_len"))


def ratios(rows) -> list:
    """Medians of time ratios between providers over cases where both have valid timed rows."""
    ok = {}
    for r in rows:
        if "ms" in r and r.get("valid") is not False:
            ok.setdefault(_case(r), {})[r["provider"]] = r
    lines = []
    pairs = [("simsd-cuda", "sdpa-nomask"), ("simsd-cuda", "flex"), ("simsd-cuda", "sdpa-dense"),
             ("simsd-cuda", "simsd-triton"), ("simsd-triton", "sdpa-nomask"), ("simsd-triton", "flex"),
             ("simsd-triton", "sdpa-dense"), ("simsd-cuda", "flash-kvcache"), ("simsd-triton", "flash-kvcache")]
    for a, b in pairs:
        vals = [c[a]["ms"] / c[b]["ms"] for c in ok.values() if a in c and b in c and c[b]["ms"]]
        if vals:
            lines.append(f"time {a} / {b}: median {statistics.median(vals):.2f} "
                         f"(min {min(vals):.2f}, max {max(vals):.2f}, {len(vals)} cases)")
    for prov in ("simsd-cuda", "simsd-triton"):
        fr = [c[prov]["frac_4tbs"] for c in ok.values() if prov in c and c[prov].get("frac_4tbs")]
        if fr:
            lines.append(f"{prov} bandwidth: best {100 * max(fr):.0f}% / median {100 * statistics.median(fr):.0f}% "
                         "of 4 TB/s")
    return lines


def e2e_lines(rows) -> tuple:
    """``(verdict rows, ratio lines)`` from bench_e2e rows."""
    lat = {(r["pair"], r["forward"], r["mode"]): r["ms"] for r in rows if r.get("kind") == "latency"}
    lines = []
    for pair in dict.fromkeys(p for p, _, _ in lat):
        van = lat.get((pair, "vanilla_step", "graphs"))
        for v in ("paper", "exact"):
            x = lat.get((pair, f"verify_{v}", "graphs"))
            if van and x:
                lines.append(f"e2e {pair}: verify_{v} / vanilla_step (graphs) {x / van:.2f}")
        eg, gr = lat.get((pair, "vanilla_step", "eager")), lat.get((pair, "vanilla_step", "graphs"))
        if eg and gr:
            lines.append(f"e2e {pair}: vanilla_step eager / graphs {eg / gr:.2f}")
    tps = [r for r in rows if r.get("kind") == "tokens_per_second"]
    for pair in dict.fromkeys(r["pair"] for r in tps):
        by = {r["mode"]: r for r in tps if r["pair"] == pair}
        base = by.get("vanilla+graphs") or by.get("vanilla")
        for mode in ("paper+graphs", "exact+graphs", "exact"):
            if mode in by and base:
                lines.append(f"e2e {pair}: tokens/s {mode} / {base['mode']} "
                             f"{by[mode]['tokens_per_second'] / base['tokens_per_second']:.2f}")
    verdicts = []
    failed = [r for r in rows if r.get("kind") == "error"]
    cases = {(r.get("pair"), r.get("case")) for r in rows if r.get("case")}
    if failed:
        verdicts.append(("e2e: benchmark cases", "failed",
                         f"{len(failed)} of {len(cases)} failed: " + ", ".join(
                             f"{r.get('pair')} {r['case']} ({r.get('error', '')[:60]})" for r in failed[:4])
                         + " (tracebacks in e2e.log)"))
    elif cases:
        verdicts.append(("e2e: benchmark cases", "correct", f"{len(cases)} cases ran"))
    if tps:
        exact = [r for r in tps if r["mode"].startswith("exact")]
        same = sum(r.get("identical_to_vanilla") or 0 for r in exact)
        total = sum(r.get("prompts") or 0 for r in exact)
        verdicts.append(("e2e: exact == vanilla tokens (info)", "info",
                         f"{same}/{total} prompts identical (" + ", ".join(
                             f"{r['pair']} {r['mode']} {r.get('identical_to_vanilla')}/{r.get('prompts')}"
                             for r in exact) + "); not promised on a GPU (README)"))
        graphs = [r for r in tps if r.get("graphs_equal_eager") is not None]
        verdicts.append(("e2e: graphs == eager tokens (info)", "n/a" if not graphs else
                         ("correct" if all(r["graphs_equal_eager"] for r in graphs) else "differs"),
                         "eager runs unpadded shapes here; tests: engine is the strict check"))
    elif rows:
        verdicts.append(("e2e", "not run", "no tokens/s rows"))
    else:
        verdicts.append(("e2e", "not run", "no e2e.jsonl rows"))
    return verdicts, lines


def summary(out, logs=None) -> tuple:
    """``(text, ok)`` of the results in ``out`` (rows) and ``logs`` (logs, steps; default ``out``)."""
    dirs = [out] + ([logs] if logs else [])
    st = steps(dirs)
    step_rc = {name: rc for name, rc, _, _ in st}
    env_path = find(dirs, "env.txt")
    env = open(env_path).read().strip() if os.path.isfile(env_path) else ""
    verdicts = [("build: CUDA extension",) + build_verdict(dirs, step_rc)]
    check = _jsonl(find(dirs, "check.jsonl"))
    verdicts += check_verdicts(check) if check else [("check", "not run", "no check.jsonl rows")]
    verdicts += test_verdicts(dirs)
    att = _jsonl(find(dirs, "attention.jsonl"))
    verdicts += bench_verdicts(att) if att else [("bench: attention", "not run", "no attention.jsonl rows")]
    e2e = _jsonl(find(dirs, "e2e.jsonl"))
    e2e_v, e2e_r = e2e_lines(e2e)
    verdicts += e2e_v
    verdicts.append(warning_verdict(dirs))
    lines = ["== simsd device run", env, "", f"{'step':18} {'status':10} {'exit':>5} {'seconds':>8} {'limit':>6}"]
    lines += [f"{n:18} {step_status(rc):10} {rc:>5} {s:>8} {lim:>6}" for n, rc, s, lim in st]
    total = sum(int(s) for _, _, s, _ in st if s.isdigit())
    lines += [f"(sum of step times {total} s; background steps overlap)", "",
              f"{'path':44} {'verdict':8} details"]
    lines += [f"{p:44} {v:8} {d}" for p, v, d in verdicts]
    lines += ["", "key ratios:"] + (ratios(att) + e2e_r or ["(none: no valid benchmark rows)"])
    bad_steps = [f"{n} {step_status(rc)}" for n, rc, _, _ in st if rc not in ("0", "skip")]
    bad_paths = [f"{p} {v}" for p, v, _ in verdicts if v in ("wrong", "failed")]
    ok = not bad_steps and not bad_paths
    lines += ["", "verdict: " + ("every path that ran is correct" if ok else
                                 f"NOT OK (steps: {', '.join(bad_steps) or 'all passed'}; paths: "
                                 f"{', '.join(bad_paths) or 'none wrong'})")]
    return "\n".join(lines), ok


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2) or not all(os.path.isdir(a) for a in argv):
        print("usage: python bench/device_summary.py OUT_DIR [LOG_DIR]", file=sys.stderr)
        return 2
    text, ok = summary(*argv)
    print(text)
    with open(os.path.join(argv[0], "summary.txt"), "w") as f:
        f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
