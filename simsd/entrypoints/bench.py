"""``simsd bench``: a prompt set through several decoding modes in one process.

Per mode: tokens/s (sum of generated tokens / sum of decode seconds, prefill excluded,
warm-up prompts excluded; with ``--batch-size N`` the prompts run in batches of N and a
batch's decode time counts once), speedup over vanilla, acceptance rate, target and draft forwards
per token, accepted tokens per round, whether the output equals vanilla's token for token;
for ``paper`` also the top-1 agreement and mean KL(exact || paper) of its verification
distributions against the exact ones (the approximation of docs/design.md §4.1), measured in a
separate untimed pass.
"""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

from .commands import (check_option_use, check_prompts, collect_prompts, decode_config, load_models,
                       make_batch_decoder)


def paper_agreement(target, draft, prompts, cfg, args) -> dict:
    """Top-1 agreement and mean KL between paper-mode and exact verification distributions."""
    from ..speculative.decoder import SpecConfig, SpeculativeDecoder

    dec = SpeculativeDecoder(target, draft, cfg, SpecConfig(mode="paper", gamma=args.gamma,
                                                            on_reject=args.on_reject or "redraft",
                                                            rope_copy=not args.no_rope_copy,
                                                            draft_strategy=args.draft_strategy))
    dec.diagnostics = {"agree": 0, "total": 0, "kl": 0.0}
    for p in prompts:
        dec.generate(p.ids)
    d = dec.diagnostics
    return {"top1_agreement": d["agree"] / max(d["total"], 1), "mean_kl": d["kl"] / max(d["total"], 1),
            "positions_compared": d["total"]}


def bench_modes(args) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("vanilla", "paper", "exact")]
    if bad:
        raise ValueError(f"unknown mode(s) in --modes: {', '.join(bad)}")
    if not modes:
        raise ValueError("--modes names no mode (choose from vanilla, paper, exact)")
    if len(set(modes)) != len(modes):
        raise ValueError(f"--modes names a mode twice: {args.modes}")
    if args.json is not None:
        if args.json.is_dir():
            raise ValueError(f"--json {args.json} is a directory; give a file path")
        try:  # before the benchmark runs, not after
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.open("a").close()
        except OSError as exc:
            raise ValueError(f"--json {args.json} cannot be written ({exc.strerror})") from exc
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.mode is not None:
        raise ValueError("simsd bench takes --modes (comma-separated), not --mode")
    target, draft = load_models(args, need_draft=any(m != "vanilla" for m in modes))
    cfg = decode_config(args, target.config)
    check_option_use(args, cfg, modes)
    if args.limit is None and args.prompts_file is None and args.prompt is None and args.prompt_ids is None:
        args.limit = 8
        args.prompt_set = args.prompt_set or "bundled"
    prompts = collect_prompts(args, target.tokenizer, target.config.vocab_size)
    check_prompts(prompts, [m for m in (target, draft) if m is not None], cfg)
    rows, outputs = [], {}
    from tqdm import tqdm
    n = min(args.batch_size, len(prompts))  # the batch size that runs (recorded as such)
    if n < args.batch_size:
        print(f"simsd: --batch-size {args.batch_size} > {len(prompts)} prompts: batches of {n}", file=sys.stderr)
    chunks = [(i, prompts[i:i + n]) for i in range(0, len(prompts), n)]
    for mode in modes:
        decode = make_batch_decoder(mode, args, target, draft, cfg)
        warm = prompts[: args.warmup]
        if warm:  # batches of the timed size (with CUDA graphs: the same captured shapes)
            decode([warm[i % len(warm)].ids for i in range(min(n, len(prompts)))], 0)
        results, seconds = [], 0.0
        for first, chunk in tqdm(chunks, desc=mode, file=sys.stderr):
            batch = decode([p.ids for p in chunk], first)
            results += batch.results
            seconds += batch.stats["decode_seconds"]  # a batch's rows share its decode time
        outputs[mode] = [r.token_ids for r in results]
        tot = lambda key: sum(r.stats.get(key, 0) for r in results)  # noqa: E731
        tokens = tot("new_tokens")
        row = {"mode": mode, "prompts": len(prompts), "batch_size": n, "new_tokens": tokens,
               "decode_seconds": seconds,
               "tokens_per_second": tokens / seconds if seconds else float("nan"),
               "target_forwards_per_token": tot("target_forwards") / max(tokens, 1),
               "draft_forwards_per_token": tot("draft_forwards") / max(tokens, 1)}
        if mode != "vanilla":
            row.update({"proposed": tot("proposed"), "accepted": tot("accepted"),
                        "acceptance_rate": tot("accepted") / max(tot("proposed"), 1),
                        "accepted_per_round": tot("accepted") / max(tot("rounds"), 1),
                        "tokens_per_round": tokens / max(tot("rounds"), 1)})
        if "vanilla" in outputs:
            row["identical_to_vanilla"] = sum(a == b for a, b in zip(outputs[mode], outputs["vanilla"]))
        if mode == "paper":
            row.update(paper_agreement(target, draft, prompts, cfg, args))
        rows.append(row)
    base = next((r for r in rows if r["mode"] == "vanilla"), None)
    for r in rows:
        ok = base is not None and base["tokens_per_second"] > 0 and base["target_forwards_per_token"] > 0
        r["speedup"] = r["tokens_per_second"] / base["tokens_per_second"] if ok else float("nan")
        r["forwards_ratio_vs_vanilla"] = (r["target_forwards_per_token"] / base["target_forwards_per_token"]
                                          if ok else float("nan"))
    print_table(rows, cfg, args)
    if args.json:
        meta = {"block_length": cfg.block_length, "strategy": cfg.strategy, "steps": cfg.steps,
                "gamma": (args.gamma or cfg.block_length) if draft else None, "dtype": str(target.model.dtype),
                "device": str(target.model.device), "torch": torch.__version__, "python": platform.python_version(),
                "machine": platform.processor() or platform.machine(), "git_sha": git_sha(),
                "target": str(target.path),
                "draft": str(draft.path) if draft else None}
        meta["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())
                             if k not in ("json", "command") and isinstance(v, (int, float, str, bool, type(None), Path))}
        meta["settings"]["batch_size"] = n
        meta["prompts"] = [p.id for p in prompts]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        clean = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()} for r in rows]
        args.json.write_text(json.dumps({"meta": meta, "rows": clean}, indent=2))
    return 0


def git_sha() -> str:
    """The short git sha of the checkout simsd runs from ('' outside a git checkout)."""
    import subprocess
    from pathlib import Path
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def print_table(rows, cfg, args) -> None:
    cols = [("mode", "{}"), ("tokens_per_second", "{:.1f}"), ("speedup", "{:.2f}x"),
            ("target_forwards_per_token", "{:.3f}"), ("forwards_ratio_vs_vanilla", "{:.2f}"),
            ("acceptance_rate", "{:.3f}"), ("accepted_per_round", "{:.2f}"), ("identical_to_vanilla", "{}"),
            ("top1_agreement", "{:.3f}"), ("mean_kl", "{:.4f}")]
    heads = ["mode", "tok/s", "speedup", "tgt fwd/tok", "fwd vs van", "accept", "acc/round", "same as van",
             "paper top1", "paper KL"]
    shown = lambda r, k: k in r and not (isinstance(r[k], float) and r[k] != r[k])  # noqa: E731  (NaN: "-")
    table = [heads] + [[fmt.format(r[k]) if shown(r, k) else "-" for k, fmt in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(heads))]
    print(f"# B={cfg.block_length} steps={cfg.steps} strategy={cfg.strategy} gamma={args.gamma or cfg.block_length} "
          f"prompts={rows[0]['prompts']} batch_size={rows[0]['batch_size']}")
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
