"""The ``simsd`` command line: ``simsd generate``, ``simsd bench``, ``simsd eval``, ``simsd check`` and ``simsd serve``.

The options (:mod:`simsd.entrypoints.arguments`: generated from the settings, one per field, for
every command that takes it) are checked before torch loads: each value by its setting, the
combinations by :func:`check_options`. Bad input exits with status 2 and a one-line ``simsd:
error: ...`` that names the option as typed. :func:`main` parses, checks and runs a command
(:func:`run_command`); ``--tp`` on the CPU or one machine launches the ranks (:func:`launch_tp`).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings

from ..config.engine import EngineArgs
from ..config.request import SamplingParams, check_request
from ..config.speculative import SELF_DRAFT, is_self_draft
from ..config.vocabulary import ParamError, Rule, check_modes, check_rules, opt, settings_of
from .arguments import (
    DESCRIPTIONS,
    HTTP_OPTIONS,
    RAY_OPTIONS,
    SETTINGS,
    UNITS,
    OneLineParser,
    build_parser,
    namer,
    options_of,
    typed_options,
    warn_without_effect,
)
from .errors import SimsdWarning
from .run_modes import RUN_MODES, base_modes, needs_draft_model


def modes_of(args) -> list:
    """The decoding modes of a command (``--mode``, or bench's and eval's ``--modes``: the labels
    of :data:`~simsd.entrypoints.run_modes.RUN_MODES`, e.g. ``paper-release`` (paper mode with
    ``paper_variant="release"``) and ``exact-self`` (exact mode with ``draft="self"``))."""
    if args.command not in ("bench", "eval"):
        return [args.mode]
    known = tuple(RUN_MODES)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in known]
    if bad:
        raise ParamError("modes", f"unknown mode(s) in {opt('modes')}: {', '.join(bad)} (choose from "
                                  f"{', '.join(known)})")
    if not modes:
        raise ParamError("modes", f"{opt('modes')} names no mode (choose from {', '.join(known)})")
    if len(set(modes)) != len(modes):
        raise ParamError("modes", f"{opt('modes')} names a mode twice: {args.modes}")
    return modes


def check_options(args, modes: list) -> None:
    """Check a command's options before anything is read: every value in its setting's range,
    every option used by the run's ``modes``, the combinations that would leave an option
    without effect. Sets ``args.engine`` (:class:`EngineArgs`; bench: of its most speculative
    mode) and ``args.params`` (the requests' :class:`SamplingParams`). Raises :class:`ParamError`."""
    specs = options_of(args.command)
    for name in specs:
        if getattr(args, name) is not None:
            setattr(args, name, SETTINGS[name].check(name, getattr(args, name), UNITS.get(name, (None,))[0]))
    release = "paper-release" in modes  # the label of paper mode with paper_variant="release"
    labels, modes = modes, base_modes(modes)
    check_modes({n: SETTINGS[n] for n in args.typed}, modes)
    args.params = params = SamplingParams(**{n: getattr(args, n) for n in settings_of(SamplingParams) if n in specs})
    mode = next((m for m in ("paper", "exact") if m in modes), "vanilla")
    engine = {n: getattr(args, n) for n in settings_of(EngineArgs) if n in specs and n != "mode"}
    for name, (_, factor) in UNITS.items():
        if engine.get(name) is not None:
            engine[name] *= factor
    args.self_width = "auto"  # the width of an exact-self column beside columns with a draft model
    if args.command in ("bench", "eval") and "exact-self" in labels and not is_self_draft(engine.get("draft")):
        if not needs_draft_model(labels, engine.get("draft")) and engine.get("draft") is None:
            engine["draft"] = SELF_DRAFT  # no column runs a draft model: none is read or loaded
        elif engine.get("speculation_width") is not None:
            args.self_width = SETTINGS["speculation_width"].check("speculation_width", engine.pop("speculation_width"))
    args.engine = EngineArgs(mode=mode, **engine)
    # the request's rules, as the API and the server run them (eval's paper-release column is
    # paper mode's release variant); what has no effect is said, as a warning (simsd generate's
    # once the checkpoint's generation config has given the options not typed: commands.prepare)
    engine = dataclasses.replace(args.engine, paper_variant="release") if release else args.engine
    if args.command == "generate":
        check_request(params, engine)
    else:
        warn_without_effect(args, params, engine)
    ray = getattr(args, "ray", False)  # (simsd bench has no Ray options)
    check_rules(COMMAND_LINE_RULES, args, {
        "single": getattr(args, "prompt", None) is not None or getattr(args, "prompt_ids", None) is not None,
        "ray": ray, "tp": args.engine.tp,
        "ray_given": [n for n in RAY_OPTIONS.get(args.command, ()) if n != "ray" and n in args.typed],
        "http_given": [n for n in HTTP_OPTIONS.get(args.command, ()) if n in args.typed]})
    if ray:
        check_ray_devices(args.engine)
    if args.engine.tp > 1:  # last: it loads torch (unless the device is the CPU)
        check_tp_devices(args.engine.device, args.engine.tp)


#: The refused combinations of the command line's own options (:class:`~simsd.config.vocabulary.Rule`,
#: each example a command line): ``--limit`` and ``--batch-size`` with a single prompt, the Ray
#: options (:data:`~simsd.entrypoints.arguments.RAY_OPTIONS`) only with ``--ray``, the HTTP
#: server's (:data:`~simsd.entrypoints.arguments.HTTP_OPTIONS`) only without, ``--ray`` without
#: ``--tp`` (a worker or replica is one process), ``--max-replicas`` at least ``--replicas``.
COMMAND_LINE_RULES = (
    Rule("limit", lambda a: a.single and a.limit is not None,
         lambda a: f"{opt('limit')} applies to {opt('prompts_file')} and {opt('prompt_set')}, not to a single prompt",
         ("generate", "--prompt-ids", "5,6", "--limit", "1")),
    Rule("batch_size", lambda a: a.single and a.batch_size > 1,
         lambda a: f"{opt('batch_size')} {a.batch_size} with a single prompt: batches need {opt('prompts_file')} or "
                   f"{opt('prompt_set')}",
         ("generate", "--prompt-ids", "5,6", "--batch-size", "2")),
    Rule(lambda a: a.ray_given[0], lambda a: bool(a.ray_given) and not a.ray,
         lambda a: f"{opt(a.ray_given[0])} applies to Ray runs: add {opt('ray')}",
         ("serve", "--replicas", "2")),
    Rule(lambda a: a.http_given[0], lambda a: bool(a.http_given) and a.ray,
         lambda a: f"{opt(a.http_given[0])} applies to simsd serve without {opt('ray')} (Ray Serve's own HTTP proxy "
                   f"reads the requests)",
         ("serve", "--ray", "--request-read-timeout", "5")),
    Rule("tp", lambda a: a.ray and a.tp > 1,
         lambda a: f"{opt('tp')} {a.tp} with {opt('ray')}: a Ray worker or replica is one process (tensor "
                   f"parallelism over torchrun: docs/scaling.md)",
         ("generate", "--ray", "--tp", "2")),
    Rule("max_replicas", lambda a: a.max_replicas is not None and a.max_replicas < a.replicas,
         lambda a: f"{opt('max_replicas')} {a.max_replicas} is below {opt('replicas')} {a.replicas}",
         ("serve", "--ray", "--replicas", "3", "--max-replicas", "2")),
)


def check_ray_devices(engine) -> None:
    """With ``--ray`` a worker or replica sees only the GPUs Ray gives it, one per distinct CUDA
    device it names (:func:`~simsd.entrypoints.ray_cluster.llm_resources`), as ``cuda:0`` ..
    ``cuda:{n-1}`` (Ray sets its ``CUDA_VISIBLE_DEVICES``): :class:`ParamError` naming the option
    whose index is outside them (``--device cuda:1`` alone would name a GPU the actor cannot see)."""
    named = [("device", engine.device)] + ([("draft_device", engine.draft_device)] if engine.mode != "vanilla" else [])
    cuda = {}
    for name, device in named:
        kind, _, index = str(device or "").partition(":")
        if kind == "cuda":
            cuda[name] = int(index) if index.isdigit() else 0
    n = len(set(cuda.values()))
    for name, index in cuda.items():
        if index >= n:
            seen = "cuda:0" + (f" .. cuda:{n - 1}" if n > 1 else "")
            raise ParamError(name, f"{opt(name)} cuda:{index} with {opt('ray')}: a Ray worker or replica sees the "
                                   f"GPUs Ray gives it as {seen} (one per distinct CUDA device named); Ray, not the "
                                   f"index, picks the GPU")


def check_tp_devices(device, tp: int) -> None:
    """Tensor parallelism on CUDA runs one rank per GPU (``cuda:<local rank>``, simsd.engine.tp):
    :class:`ParamError` when the ranks of this machine (``tp``, or torchrun's ``LOCAL_WORLD_SIZE``)
    outnumber the visible GPUs, before any rank starts or weights load. On the CPU the ranks are
    processes (gloo): any number. ``device``: the ``--device`` option (None: cuda if available)."""
    if device is not None and str(device).split(":")[0] != "cuda":
        return  # the CPU (the device check refuses other device types)
    import os

    import torch
    if device is None and not torch.cuda.is_available():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", tp))
    visible = torch.cuda.device_count()
    if local > visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ParamError("tp", f"{opt('tp')} {tp}: {local} ranks on this machine need {local} GPUs (one rank per "
                               f"GPU), {visible} visible"
                               + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""))



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
        spawn(_tp_rank_main, args.tp, list(sys.argv[1:] if argv is None else argv),
              forward_signals=args.command == "serve")
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


def parse(argv: list):
    """``argv`` parsed and checked as :func:`main` does (``args.engine``, ``args.params``; for
    callers that build the engine themselves). Raises :class:`ParamError`."""
    args = build_parser().parse_args(argv)
    args.typed = typed_options(args.command, argv)
    check_options(args, modes_of(args))
    return args


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "check":  # its options load torch: parsed only now (exit 0 all pass, 1 a failure)
        from simsd_kernels.check import add_arguments
        check = OneLineParser(prog="simsd check", description=DESCRIPTIONS["check"], allow_abbrev=False)
        add_arguments(check)
        args = check.parse_args(extra, argparse.Namespace(command="check"))
    elif args.command in ("bench", "eval") and "--mode" in extra:
        print(f"simsd: error: simsd {args.command} takes --modes (comma-separated), not --mode", file=sys.stderr)
        return 2
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    else:
        args.typed = typed_options(args.command, sys.argv[1:] if argv is None else argv)
    with warnings.catch_warnings():  # simsd's warnings in one line each
        warnings.showwarning = one_line_warnings(warnings.showwarning)
        return run_command(args, argv)


def run_command(args, argv=None) -> int:
    """Run a parsed command; a refusal is one ``simsd: error: ...`` line and exit status 2."""
    try:
        if args.command == "check":
            from simsd_kernels.check import run
            return run(args)
        modes = modes_of(args)
        check_options(args, modes)  # before any rank is spawned or file read
        if getattr(args, "ray", False):  # a missing Ray before anything is read
            from .ray_cluster import require_ray
            require_ray("ray.serve" if args.command == "serve" else "ray.data")
        if getattr(args, "tp", 1) > 1:
            code = launch_tp(args, argv)
            if code is not None:
                return code
        try:
            if args.command == "generate" and args.ray:
                from .ray_data import run_generate
                return run_generate(args)
            if args.command == "generate":
                from .commands import run_generate
                return run_generate(args)
            if args.command == "serve" and args.ray:
                from .ray_serve import run_serve
                return run_serve(args)
            if args.command == "serve":
                from .serve import leave, run_serve
                code = run_serve(args)
                if argv is None:  # the process's own command line: leave without the lingering teardown
                    leave(code)
                return code
            if args.command == "eval":
                from .eval import run_eval
                return run_eval(args, modes)
            from .bench import bench_modes
            return bench_modes(args, modes)
        finally:
            if getattr(args, "tp", 1) > 1:
                from ..engine.tp import shutdown
                shutdown()
    except ParamError as exc:
        print(f"simsd: error: {exc.render(namer(args))}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:  # CheckpointError is a ValueError
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
    except RuntimeError as exc:  # a request that failed on non-finite logits: one line, status 1
        cause = nonfinite_cause(exc)
        if cause is None:
            raise
        path = getattr(args, cause.model, None)
        print(f"simsd: error: {cause}{'' if path is None else f' (model {path})'}", file=sys.stderr)
        return 1


def nonfinite_cause(exc: BaseException):
    """The :class:`simsd.engine.batching.NonFiniteLogits` that ``exc`` is or was caused by, else None."""
    while exc is not None:
        if type(exc).__name__ == "NonFiniteLogits":  # by name: this module does not import torch
            return exc
        exc = exc.__cause__
    return None


if __name__ == "__main__":
    sys.exit(main())
