"""``simsd eval``: a prompt set with answers through several decoding modes on one pair of
checkpoints, quality and speed in one table.

Sets: CHAMP's held-out problems (``--prompt-set champ``, the default: final-answer match,
:mod:`simsd.entrypoints.scoring`), HumanEval's held-out tasks (``--prompt-set humaneval``:
pass@1 by running the tests with ``--execute``, else unscored), or a JSONL file
(``--prompts-file``: lines with ``prompt`` and ``answer``, final-answer match). ``--limit N``
takes the first N prompts.

Modes (``--modes``, :data:`~simsd.entrypoints.run_modes.RUN_MODES`): ``vanilla``, ``paper`` (as
described in the paper), ``paper-release`` (paper mode as the SimSD release runs it,
``paper_variant="release"``), ``exact``, ``exact-self`` (exact mode, the target proposing its own
steps: no draft model). Each mode
runs through its own :class:`~simsd.entrypoints.api.LLM` (the checkpoints shared), as ``simsd
bench`` does. The prompts are taken in chunks of ``--batch-size``; each chunk is one pass of
``simsd bench`` (:func:`~simsd.entrypoints.bench.one_pass`: every mode in turn, the order
rotated from chunk to chunk), so the speedup over vanilla is a ratio of figures measured side
by side. Per mode: accuracy (correct / scored), tokens/s (generated tokens over the chunks'
decode seconds, prefill excluded), the speedup over vanilla, target forwards per token,
acceptance, accepted tokens per round, prompts whose tokens equal vanilla's.

``--json FILE`` records the settings and every prompt's result (text, token ids, statistics,
verdict) and each chunk's decode seconds, rewritten after every chunk. When FILE exists, the
run resumes it: prompts it holds in every mode are not decoded again (their results and timings
count in the table), provided it was written with the same settings (else a refusal that names
the first difference; ``--limit`` may grow). Prompt ``i`` samples with the seed ``--seed + i``
whether resumed or not.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from ..config.vocabulary import ParamError, opt
from .run_modes import RUN_MODES

#: options that may differ between a run and the run it resumes (they change no result)
RESUMABLE = ("json_file", "limit", "warmup", "threads", "command", "ray", "num_workers")


def check_eval_options(args) -> None:
    """The combinations of ``simsd eval``'s options the shared checks do not cover. Raises
    :class:`ParamError`."""
    if args.execute and args.prompt_set != "humaneval":
        raise ParamError("execute", f"{opt('execute')} runs HumanEval's tests: it needs {opt('prompt_set')} "
                                    f"humaneval")


def settings_of(args) -> dict:
    """The run's settings as recorded in ``--json`` (every option but those in ``RESUMABLE``)."""
    out = {}
    for k, v in sorted(vars(args).items()):
        if k not in RESUMABLE and isinstance(v, (int, float, str, bool, type(None), Path)):
            out[k] = str(v) if isinstance(v, Path) else v
    return out


def load_partial(path: Path | None, settings: dict) -> dict:
    """The records of an earlier run in ``path`` (``{"prompts": {id: record}, "chunks": [...]}``),
    empty when there is none. Raises :class:`ParamError` for a file that is not an eval record
    or was written with other settings (naming the first difference)."""
    if path is None or not path.exists():
        return {"prompts": {}, "chunks": []}
    try:
        old = json.loads(path.read_text())
        recorded, prompts, chunks = old["meta"]["settings"], old["prompts"], old["chunks"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ParamError("json_file", f"{opt('json_file')} {path} exists but is not a simsd eval record ({exc}); "
                                      f"give another path") from None
    for key in sorted(set(recorded) | set(settings)):
        if recorded.get(key) != settings.get(key):
            raise ParamError("json_file", f"{opt('json_file')} {path} holds a run with other settings ({opt(key)} "
                                          f"{recorded.get(key)!r} there, {settings.get(key)!r} here): resume it with "
                                          f"the same options or give another path")
    return {"prompts": {p["id"]: p for p in prompts}, "chunks": list(chunks)}


def write_json(path: Path, meta: dict, records: dict, order: list, chunks: list, rows: list | None = None) -> None:
    """Write the record: ``meta``, the prompts' records in ``order``, the chunks and, at the end
    of a run, the table's ``rows`` (atomically: a half-written file is never left behind)."""
    doc = {"meta": meta, "prompts": [records[i] for i in order if i in records], "chunks": chunks, "rows": rows}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def score(prompt, text: str | None, kind: str, problems: dict, args) -> bool | None:
    """The verdict on one output: None when it is not scored (no answer, HumanEval without
    ``--execute``, no text)."""
    from .scoring import answer_matches, humaneval_passed
    if text is None:
        return None
    if kind == "humaneval":
        return humaneval_passed(problems[prompt.id], text, args.timeout) if args.execute else None
    return None if prompt.answer is None else answer_matches(text, prompt.answer)


def table_rows(modes: list, records: dict, chunks: list, ids: list) -> list:
    """One row per mode from the chunks whose prompts are all among ``ids`` (their records and
    decode seconds)."""
    from .bench import counters
    chunks = [c for c in chunks if set(c["prompts"]) <= set(ids)]
    counted = {i for c in chunks for i in c["prompts"]}
    done = [records[i] for i in ids if i in counted]
    rows, tps = [], {}
    for mode in modes:
        res = [SimpleNamespace(stats=r["results"][mode]["stats"], token_ids=r["results"][mode]["token_ids"])
               for r in done]
        seconds = sum(c["decode_seconds"][mode] for c in chunks)
        tokens = sum(x.stats["new_tokens"] for x in res)
        tps[mode] = tokens / seconds if seconds > 0 else float("nan")
        verdicts = [r["results"][mode]["correct"] for r in done if r["results"][mode]["correct"] is not None]
        row = {"mode": mode, "prompts": len(done), "scored": len(verdicts), "correct": sum(verdicts),
               "accuracy": sum(verdicts) / len(verdicts) if verdicts else None, "decode_seconds": seconds,
               "tokens_per_second": tps[mode], **counters(RUN_MODES[mode].mode, res)}
        if "vanilla" in modes:
            row["identical_to_vanilla"] = sum(r["results"][mode]["token_ids"] == r["results"]["vanilla"]["token_ids"]
                                              for r in done)
        rows.append(row)
    for row in rows:
        row["speedup"] = row["tokens_per_second"] / tps["vanilla"] if "vanilla" in tps and tps["vanilla"] else None
    return rows


def print_table(rows: list, header: str) -> None:
    def num(v, fmt):
        return "-" if v is None or v != v else format(v, fmt)

    cols = [("mode", lambda r: r["mode"]),
            ("accuracy", lambda r: f"{num(r['accuracy'], '.3f')} ({r['correct']}/{r['scored']})" if r["scored"]
             else "-"),
            ("tok/s", lambda r: num(r["tokens_per_second"], ".1f")),
            ("speedup", lambda r: num(r["speedup"], ".2f") + ("x" if r["speedup"] is not None else "")),
            ("tgt fwd/tok", lambda r: num(r["target_forwards_per_token"], ".3f")),
            ("accept", lambda r: num(r.get("acceptance_rate"), ".3f")),
            ("acc/round", lambda r: num(r.get("accepted_per_round"), ".2f")),
            ("same as van", lambda r: f"{r['identical_to_vanilla']}/{r['prompts']}" if "identical_to_vanilla" in r
             else "-")]
    table = [[h for h, _ in cols]] + [[f(r) for _, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    print(header)
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def run_eval(args, modes: list) -> int:
    """``simsd eval`` (module doc) on options checked by :func:`simsd.entrypoints.cli.check_options`."""
    check_eval_options(args)  # before torch loads
    import torch
    from tqdm import tqdm

    from .bench import check_json_path, git_sha, one_pass, warm_up
    from .commands import build_llms, prepare
    args.prompt = args.prompt_ids = None  # eval's prompts come from a set or a file
    if args.prompts_file is None and args.prompt_set is None:
        args.prompt_set = "champ"
    check_json_path(args.json_file)
    settings = settings_of(args)
    partial = load_partial(args.json_file, settings)
    run = prepare(args, modes)
    prompts = run.prompts
    if len({p.id for p in prompts}) != len(prompts):
        raise ParamError("prompts_file", "the prompt set repeats an id: the results are recorded per id")
    kind = "humaneval" if args.prompt_set == "humaneval" else "answer"
    problems = {}
    if kind == "humaneval":
        from .prompts import humaneval_problems
        problems = humaneval_problems()
    if kind == "answer" and not any(p.answer is not None for p in prompts):
        print("simsd: note: these prompts carry no answer: accuracy is not measured", file=sys.stderr)
    if kind == "humaneval" and not args.execute:
        print("simsd: note: HumanEval is scored only with --execute (it runs the generated code)", file=sys.stderr)
    records, chunks = partial["prompts"], partial["chunks"]
    ids = [p.id for p in prompts]
    todo = [i for i, p in enumerate(prompts) if not all(m in records.get(p.id, {}).get("results", {}) for m in modes)]
    if len(todo) < len(prompts):
        print(f"simsd: resuming {args.json_file}: {len(prompts) - len(todo)} of {len(prompts)} prompts done",
              file=sys.stderr)
    n = min(run.config.batch_size, len(prompts))
    warmup = todo[: args.warmup]
    if args.ray:  # the chunks on Ray Data workers, each with every mode's LLM (simsd.entrypoints.ray_data)
        from .ray_data import map_chunks
        passes = map_chunks(run, modes, todo, args.num_workers, warmup)
        loaded = {"target": run.target, "draft": run.draft}
        dtype, device = f"torch.{run.config.dtype}", str(run.config.device)
    else:
        passes, loaded = None, {}
        llms = build_llms(run, modes, loaded)
        dtype, device = str(loaded["target"].model.dtype), str(loaded["target"].model.device)
    params = {m: run.params_of(RUN_MODES[m].mode) for m in modes}
    target, draft = loaded["target"], loaded.get("draft")
    meta = {"settings": settings, "modes": modes, "set": args.prompt_set or str(args.prompts_file),
            "prompts": ids, "target": str(target.path), "draft": str(draft.path) if draft else None,
            "dtype": dtype, "device": device, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "git_sha": git_sha()}
    if passes is None:
        if warmup:
            warm_up(llms, [prompts[i].request for i in warmup], {m: [params[m][i] for i in warmup] for m in modes}, n)
        first = len(chunks)  # the passes' indices continue the resumed run's (the modes' order rotates)
        passes = ((part, one_pass(llms, [prompts[i].request for i in part],
                                  {m: [params[m][i] for i in part] for m in modes}, first + k))
                  for k, part in enumerate(todo[s:s + n] for s in range(0, len(todo), n)))
    bar = tqdm(total=len(prompts) * len(modes), initial=(len(prompts) - len(todo)) * len(modes), file=sys.stderr,
               desc="eval")
    from ..engine.scheduler import decode_span
    for part, outs in passes:
        bar.update(len(part) * len(modes))
        chunks.append({"index": len(chunks), "prompts": [ids[i] for i in part],
                       "decode_seconds": {m: decode_span(outs[m]) for m in modes}})
        for j, i in enumerate(part):
            p = prompts[i]
            records[p.id] = {"id": p.id, "answer": p.answer, "results": {
                m: {"text": outs[m][j].text, "token_ids": outs[m][j].token_ids, "stats": outs[m][j].stats,
                    "correct": score(p, outs[m][j].text, kind, problems, args)} for m in modes}}
        if args.json_file:
            write_json(args.json_file, meta, records, ids, chunks)
    bar.close()
    rows = table_rows(modes, records, chunks, ids)
    cfg = run.cfg
    header = (f"# {meta['set']}: {len(prompts)} prompts, max_new_tokens={cfg.max_new_tokens} "
              f"block_length={cfg.block_length} steps={cfg.steps} strategy={cfg.strategy} "
              f"batch_size={n} threads={torch.get_num_threads()} (speedup: tokens/s over vanilla's, the modes "
              f"alternating per chunk)")
    print_table(rows, header)
    if args.json_file:
        clean = lambda v: None if isinstance(v, float) and v != v else v  # noqa: E731  (strict JSON: no NaN)
        write_json(args.json_file, meta, records, ids, chunks, [{k: clean(v) for k, v in r.items()} for r in rows])
    return 0
