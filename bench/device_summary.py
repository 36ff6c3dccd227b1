"""The table printed last by bench/device_run.sh: per path correct / wrong / not run, key ratios.

    python bench/device_summary.py OUT        # reads OUT/{env.txt,steps.txt,install.log,check.jsonl,
                                              #   tests.json,attention.jsonl,e2e.jsonl}; writes OUT/summary.txt

Verdicts: ``correct`` (ran, every check passed), ``wrong`` (a check failed: a FAIL row, a failed
or erroring test, an INVALID benchmark row, a graph replay that differs from eager), ``not run``
(no result: skipped, unavailable, out of time). Ratios are medians over the benchmark cases with
valid rows of both providers (time of the first / time of the second: < 1 means faster).
Exit status 1 when a path is wrong or a step failed.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

TEST_GROUPS = {"cuda-kernels": "tests: CUDA kernels",
               "triton-kernels": "tests: Triton kernels (GPU-compiled), ops",
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


def steps(out) -> list:
    """``[(name, rc, seconds, limit)]`` from steps.txt (rc ``skip`` for a step out of time)."""
    path = os.path.join(out, "steps.txt")
    rows = []
    if os.path.isfile(path):
        for line in open(path):
            parts = line.split()
            if len(parts) == 4:
                rows.append(tuple(parts))
    return rows


def build_verdict(out, step_rc) -> tuple:
    rc = step_rc.get("install")
    info = {}
    path = os.path.join(out, "install.log")
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


def check_verdicts(rows) -> list:
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
    return out


def test_verdicts(out) -> list:
    path = os.path.join(out, "tests.json")
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
            detail += " (out of time)"
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


def warning_verdict(out) -> tuple:
    """Self-check failures reported while the benchmarks ran (their logs)."""
    found, seen_logs = [], False
    for name in ("attention.log", "e2e.log"):
        path = os.path.join(out, name)
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
    if tps:
        exact = [r for r in tps if r["mode"].startswith("exact")]
        lossless = all(r.get("identical_to_vanilla") == r.get("prompts") for r in exact)
        verdicts.append(("e2e: exact == vanilla tokens", "correct" if lossless else "wrong",
                         ", ".join(f"{r['pair']} {r['mode']} {r.get('identical_to_vanilla')}/{r.get('prompts')}"
                                   for r in exact)))
        graphs = [r for r in tps if r.get("graphs_equal_eager") is not None]
        verdicts.append(("e2e: graphs == eager tokens (info)", "n/a" if not graphs else
                         ("correct" if all(r["graphs_equal_eager"] for r in graphs) else "differs"),
                         "eager runs unpadded shapes here; tests: engine is the strict check"))
    elif rows:
        verdicts.append(("e2e", "not run", "no tokens/s rows"))
    else:
        verdicts.append(("e2e", "not run", "no e2e.jsonl rows"))
    return verdicts, lines


def summary(out) -> tuple:
    """``(text, ok)``."""
    st = steps(out)
    step_rc = {name: rc for name, rc, _, _ in st}
    env = open(os.path.join(out, "env.txt")).read().strip() if os.path.isfile(os.path.join(out, "env.txt")) else ""
    verdicts = [("build: CUDA extension",) + build_verdict(out, step_rc)]
    check = _jsonl(os.path.join(out, "check.jsonl"))
    verdicts += check_verdicts(check) if check else [("check", "not run", "no check.jsonl rows")]
    verdicts += test_verdicts(out)
    att = _jsonl(os.path.join(out, "attention.jsonl"))
    verdicts += bench_verdicts(att) if att else [("bench: attention", "not run", "no attention.jsonl rows")]
    e2e = _jsonl(os.path.join(out, "e2e.jsonl"))
    e2e_v, e2e_r = e2e_lines(e2e)
    verdicts += e2e_v
    verdicts.append(warning_verdict(out))
    lines = ["== simsd device run", env, "", f"{'step':18} {'exit':>5} {'seconds':>8} {'limit':>6}"]
    lines += [f"{n:18} {rc:>5} {s:>8} {lim:>6}" for n, rc, s, lim in st]
    total = sum(int(s) for _, _, s, _ in st if s.isdigit())
    lines += [f"(sum of step times {total} s; background steps overlap)", "",
              f"{'path':44} {'verdict':8} details"]
    lines += [f"{p:44} {v:8} {d}" for p, v, d in verdicts]
    lines += ["", "key ratios:"] + (ratios(att) + e2e_r or ["(none: no valid benchmark rows)"])
    failed_steps = [n for n, rc, _, _ in st if rc not in ("0", "skip")]
    ok = not failed_steps and not any(v == "wrong" for _, v, _ in verdicts)
    lines += ["", "verdict: " + ("every path that ran is correct" if ok else
                                 f"NOT OK (failed steps: {', '.join(failed_steps) or 'none'}; wrong paths: "
                                 f"{', '.join(p for p, v, _ in verdicts if v == 'wrong') or 'none'})")]
    return "\n".join(lines), ok


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python bench/device_summary.py OUT_DIR", file=sys.stderr)
        return 2
    text, ok = summary(argv[0])
    print(text)
    with open(os.path.join(argv[0], "summary.txt"), "w") as f:
        f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
