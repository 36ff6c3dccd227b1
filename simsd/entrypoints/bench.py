"""``simsd bench``: a prompt set through several decoding modes in one process.

Timing: after ``--warmup`` untimed prompts per mode, ``--repeats`` timed passes over the whole
prompt set; within a pass every mode runs once, in an order rotated from pass to pass (so no
mode always runs first or last on a machine whose speed drifts). Per mode: tokens/s of each pass
(generated tokens / decode seconds, prefill excluded; with ``--batch-size N`` a batch's decode
time counts once), their median and spread ((max - min) / median), and the speedup over
vanilla **within each pass** (median and range). A figure whose spread exceeds
``UNSTABLE_SPREAD`` is flagged as unstable (a noisy machine: use more repeats, fewer threads,
or an idle machine). The decoded tokens must be the same in every pass (they are checked).

Counters (device independent, from the first pass): acceptance rate (accepted / proposed draft
tokens), draft share (output tokens that came from the draft / output tokens), target and draft
forwards per token, accepted tokens per round, whether the output equals vanilla's token for
token (whatever the order of ``--modes``); for ``paper`` also the top-1 agreement and mean
KL(exact || paper) of its verification distributions against the exact ones (docs/design.md §4.1),
measured in a separate untimed pass.

Each mode runs through one :class:`~simsd.entrypoints.api.LLM` (the checkpoints shared, the
engines side by side), as ``simsd generate`` does: a pass of a mode is one ``generate`` call
over the prompt set, continuously batched in ``--batch-size`` rows, and its decode seconds are
the run's (:func:`~simsd.engine.scheduler.decode_span`).
"""
from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from ..config.speculative import is_self_draft
from ..config.vocabulary import ParamError, opt
from ..decoding.layouts import exact_layout
from ..decoding.step import without_mask_token_
from ..engine.batching import Fwd
from ..engine.scheduler import decode_span
from ..speculative.verifiers import PaperVerifier
from .commands import build_llms, prepare
from .outputs import json_safe
from .run_modes import RUN_MODES

#: a spread ((max - min) / median over the passes) above this flags a figure as unstable
UNSTABLE_SPREAD = 0.10


class PaperVsExact(PaperVerifier):
    """Paper verification that also runs exact mode's verify forward of the same round
    (untimed, not counted as a target forward) and adds to ``tally`` (``agree``, ``kl``,
    ``total``) the top-1 agreement and KL(exact || paper) of each proposal's distributions
    (docs/design.md §4.1): the paper mask's approximation, measured."""

    def __init__(self, cfg, spec, mask_id: int, seed: int, tally: dict):
        super().__init__(cfg, spec, mask_id, seed)
        self.tally = tally

    def verify(self, layouts, rnd):
        paper = yield from super().verify(layouts, rnd)
        d = rnd.draft
        exact = yield Fwd("target", *exact_layout(d.states, layouts.row.cached["target"]), "exact", count=False)
        exact = exact.view(d.n, d.final.shape[0], -1)
        for p in torch.nonzero(d.tau <= d.n).flatten().tolist():
            e = torch.log_softmax(without_mask_token_(exact[int(d.tau[p]) - 1, p].clone(), self.mask_id).double(), -1)
            a = torch.log_softmax(without_mask_token_(paper[int(rnd.layout[p])].clone(), self.mask_id).double(), -1)
            self.tally["agree"] += int(e.argmax() == a.argmax())
            self.tally["kl"] += float((e.exp() * (e - a)).nan_to_num().sum())
            self.tally["total"] += 1
        return paper


def paper_agreement(llm, requests: list, params: list) -> dict:
    """Top-1 agreement and mean KL between the verification distributions of the paper-mode
    ``llm`` and exact mode's (an untimed run with :class:`PaperVsExact` installed)."""
    d = {"agree": 0, "total": 0, "kl": 0.0}
    llm.verifier_class = functools.partial(PaperVsExact, tally=d)
    try:
        llm.generate(requests, params)
    finally:
        llm.verifier_class = None
    return {"top1_agreement": d["agree"] / max(d["total"], 1), "mean_kl": d["kl"] / max(d["total"], 1),
            "positions_compared": d["total"]}


def check_json_path(path: Path | None) -> None:
    """:class:`ParamError` unless ``path`` can be written: an existing folder (never created
    silently), not a directory itself, writable. Nothing is created."""
    if path is None:
        return
    name = f"{opt('json_file')} {path}"
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        why = " is a directory; give a file path"
    elif not parent.exists():
        why = f" cannot be written: the folder {parent} does not exist (create it first)"
    elif not parent.is_dir():
        why = f" cannot be written: {parent} is not a folder"
    elif not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        why = " cannot be written (permission denied)"
    else:
        return
    raise ParamError("json_file", name + why)


def spread(values: list) -> float:
    """``(max - min) / median`` of positive values (0 for one value)."""
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else float("nan")


def is_unstable(row: dict, repeats: int) -> bool:
    """A row's timing is unstable when, over two or more passes, its tokens/s or its speedup
    spread by more than ``UNSTABLE_SPREAD`` (a NaN spread, e.g. no vanilla row, does not count)."""
    return repeats > 1 and any(row.get(k, 0.0) > UNSTABLE_SPREAD
                               for k in ("tokens_per_second_spread", "speedup_spread"))


def counters(mode: str, results: list) -> dict:
    tot = lambda key: sum(r.stats.get(key, 0) for r in results)  # noqa: E731
    tokens = tot("new_tokens")
    width = sum(r.stats.get("target_query_tokens_per_forward", 0) * r.stats.get("target_forwards", 0) for r in results)
    row = {"new_tokens": tokens, "target_forwards_per_token": tot("target_forwards") / max(tokens, 1),
           "draft_forwards_per_token": tot("draft_forwards") / max(tokens, 1),
           "target_query_tokens_per_forward": width / max(tot("target_forwards"), 1)}
    if mode != "vanilla":
        row.update({"proposed": tot("proposed"), "accepted": tot("accepted"), "from_draft": tot("from_draft"),
                    "acceptance_rate": tot("accepted") / max(tot("proposed"), 1),
                    "draft_share": tot("from_draft") / max(tokens, 1),
                    "accepted_per_round": tot("accepted") / max(tot("rounds"), 1),
                    "tokens_per_round": tokens / max(tot("rounds"), 1)})
    return row


def warm_up(llms: dict, requests: list, params: dict, batch_size: int) -> None:
    """Untimed runs of ``requests`` in every mode (``llms``: mode -> LLM; ``params``: mode -> one
    parameter set per request), in full batches of the timed size (a short last batch repeats
    its requests; with CUDA graphs: the same captured shapes)."""
    for mode, llm in llms.items():
        for i in range(0, len(requests), batch_size):
            part, own = requests[i:i + batch_size], params[mode][i:i + batch_size]
            llm.generate([part[j % len(part)] for j in range(batch_size)],
                         [own[j % len(own)] for j in range(batch_size)])


def one_pass(llms: dict, requests: list, params: dict, index: int, bar=None) -> dict:
    """One timed pass: ``requests`` through every mode's LLM (``llms``: mode -> LLM, in order;
    ``params``: mode -> one :class:`SamplingParams` per request), the modes in an order rotated
    by the pass ``index`` (interleaved passes: no mode always runs first or last). Returns mode
    -> the outputs in request order (their decode time: :func:`decode_span`); ``bar`` (a
    progress bar) advances by one per output."""
    modes = list(llms)
    out = {}
    for mode in modes[index % len(modes):] + modes[: index % len(modes)]:
        out[mode] = []
        for o in llms[mode].generate_iter(requests, params[mode]):
            out[mode].append(o)
            if bar is not None:
                bar.update()
    return {m: out[m] for m in modes}


def mode_label(mode: str, args) -> str:
    """How tables name a ``--modes`` label: ``paper-release`` for paper mode with ``--paper-variant
    release``, ``exact-self`` for exact mode with ``--draft self``."""
    if mode == "paper" and args.engine.paper_variant == "release":
        return "paper-release"
    return "exact-self" if mode == "exact" and is_self_draft(args.engine.draft) else mode


def bench_modes(args, modes: list) -> int:
    check_json_path(args.json_file)
    run = prepare(args, modes)
    cfg, prompts = run.cfg, run.prompts
    if args.warmup > len(prompts):
        raise ParamError("warmup", f"{opt('warmup')} {args.warmup} exceeds the {len(prompts)} prompt(s) of the run "
                                   f"(valid: 0 to {len(prompts)})")
    loaded = {}
    llms = build_llms(run, modes, loaded)  # one LLM per mode, the checkpoints loaded once
    target, draft = loaded["target"], loaded.get("draft")
    n = llms[modes[0]].batch_size  # the batch size that runs (recorded as such)
    requests = [p.request for p in prompts]
    params = {m: run.params_of(RUN_MODES[m].mode) for m in modes}
    warm_up(llms, requests[: args.warmup], params, n)
    seconds = {m: [] for m in modes}
    tokens = {m: [] for m in modes}
    results = {}
    from tqdm import tqdm
    bar = tqdm(total=args.repeats * len(modes) * len(prompts), file=sys.stderr, desc="bench")
    for r in range(args.repeats):
        for mode, out in one_pass(llms, requests, params, r, bar).items():
            ids = [x.token_ids for x in out]
            if mode in results and ids != [x.token_ids for x in results[mode]]:
                raise RuntimeError(f"{mode}: pass {r + 1} decoded other tokens than pass 1")
            results.setdefault(mode, out)
            seconds[mode].append(decode_span(out))  # the rows share the run's decode time
            tokens[mode].append(sum(x.stats["new_tokens"] for x in out))
    bar.close()
    tps = {m: [t / s if s else float("nan") for t, s in zip(tokens[m], seconds[m])] for m in modes}
    rows = []
    for mode in modes:
        row = {"mode": mode_label(mode, args), "prompts": len(prompts), "batch_size": n, "repeats": args.repeats,
               "decode_seconds": statistics.median(seconds[mode]),
               "tokens_per_second": statistics.median(tps[mode]), "tokens_per_second_runs": tps[mode],
               "tokens_per_second_spread": spread(tps[mode]), **counters(RUN_MODES[mode].mode, results[mode])}
        if "vanilla" in results:
            row["identical_to_vanilla"] = sum(a.token_ids == b.token_ids
                                              for a, b in zip(results[mode], results["vanilla"]))
            ratios = [a / b for a, b in zip(tps[mode], tps["vanilla"])]
            van = counters("vanilla", results["vanilla"])["target_forwards_per_token"]
            row.update({"speedup": statistics.median(ratios), "speedup_runs": ratios,
                        "speedup_spread": spread(ratios),
                        "forwards_ratio_vs_vanilla": row["target_forwards_per_token"] / van if van else float("nan")})
        else:
            row.update({"speedup": float("nan"), "speedup_runs": [], "speedup_spread": float("nan"),
                        "forwards_ratio_vs_vanilla": float("nan")})
        if RUN_MODES[mode].mode == "paper" and llms[mode].config.paper_variant == "described":
            row.update(paper_agreement(llms[mode], requests, params[mode]))
        row["unstable"] = is_unstable(row, args.repeats)
        rows.append(row)
    print_table(rows, cfg, args)
    if args.json_file:
        meta = {"block_length": cfg.block_length, "strategy": cfg.strategy, "steps": cfg.steps,
                "gamma": (args.gamma or cfg.block_length) if draft else None, "dtype": str(target.model.dtype),
                "device": str(target.model.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
                "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
                "git_sha": git_sha(), "target": str(target.path), "draft": str(draft.path) if draft else None,
                "repeats": args.repeats, "unstable_spread": UNSTABLE_SPREAD}
        simple = (int, float, str, bool, type(None), Path)
        meta["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())
                             if k not in ("json_file", "command") and isinstance(v, simple)}
        meta["settings"]["batch_size"] = n
        meta["prompts"] = [p.id for p in prompts]
        args.json_file.write_text(json.dumps({"meta": meta, "rows": json_safe(rows)}, indent=2))
    return 0


#: the git sha of a copy of the checkout without ``.git`` (a device run's copy): passed in by whoever copied it
GIT_SHA_ENV = "SIMSD_GIT_SHA"


def git_sha() -> str:
    """The short git sha of the checkout simsd runs from: ``$SIMSD_GIT_SHA`` when set (a copy without
    ``.git``, bench/device_run.sh), else git's answer ('' outside a git checkout)."""
    import subprocess
    if os.environ.get(GIT_SHA_ENV, "").strip():
        return os.environ[GIT_SHA_ENV].strip()
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def print_table(rows, cfg, args) -> None:
    def pct(v):
        return f"{100 * v:.0f}%"

    def speedup(r):
        if "speedup" not in r or r["speedup"] != r["speedup"]:
            return "-"
        runs = r["speedup_runs"]
        return f"{r['speedup']:.2f}x" + (f" [{min(runs):.2f}-{max(runs):.2f}]" if len(runs) > 1 else "")

    cols = [("mode", lambda r: r["mode"] + (" !" if r["unstable"] else "")),
            ("tok/s", lambda r: f"{r['tokens_per_second']:.1f}"),
            ("spread", lambda r: pct(r["tokens_per_second_spread"]) if r["repeats"] > 1 else "-"),
            ("speedup [range]", speedup),
            ("tgt fwd/tok", lambda r: f"{r['target_forwards_per_token']:.3f}"),
            ("fwd vs van", lambda r: f"{r['forwards_ratio_vs_vanilla']:.2f}" if r["speedup_runs"] else "-"),
            ("drf fwd/tok", lambda r: f"{r['draft_forwards_per_token']:.3f}"),
            ("q tok/fwd", lambda r: f"{r['target_query_tokens_per_forward']:.1f}"),
            ("accept", lambda r: f"{r['acceptance_rate']:.3f}" if "acceptance_rate" in r else "-"),
            ("draft share", lambda r: f"{r['draft_share']:.3f}" if "draft_share" in r else "-"),
            ("acc/round", lambda r: f"{r['accepted_per_round']:.2f}" if "accepted_per_round" in r else "-"),
            ("same as van", lambda r: str(r["identical_to_vanilla"]) if "identical_to_vanilla" in r else "-"),
            ("paper top1", lambda r: f"{r['top1_agreement']:.3f}" if "top1_agreement" in r else "-"),
            ("paper KL", lambda r: f"{r['mean_kl']:.4f}" if "mean_kl" in r else "-")]
    table = [[h for h, _ in cols]] + [[f(r) for _, f in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    print(f"# block_length={cfg.block_length} steps={cfg.steps} strategy={cfg.strategy} "
          f"gamma={args.gamma or cfg.block_length} "
          f"prompts={rows[0]['prompts']} batch_size={rows[0]['batch_size']} repeats={args.repeats} "
          f"threads={torch.get_num_threads()} (tok/s and speedup: median over repeats)")
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    if args.repeats == 1:
        print("# one pass: the spread of the timings is unknown (--repeats 3 or more to judge it)")
    unstable = [r["mode"] for r in rows if r["unstable"]]
    if unstable:
        print(f"# ! unstable: {', '.join(unstable)}: timings spread over more than {pct(UNSTABLE_SPREAD)} between "
              f"passes (a busy machine?); the speedups are not reliable")
