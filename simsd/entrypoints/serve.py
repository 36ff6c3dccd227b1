"""``simsd serve``: the OpenAI-compatible server (:mod:`simsd.entrypoints.server`) under uvicorn.

Server-wide settings come from the command line (models, mode, block length, engine size);
the request defaults too (``--max-new-tokens``, ``--temperature``, ``--strategy`` ...), which
each request may override with its own fields. SIGTERM (or Ctrl-C) drains: no new requests
(503), the running and waiting ones finish, then the process exits.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
from pathlib import Path

from .errors import ParamError, UsageError
from .options import check_block_options, check_engine_options

#: request parameters whose command-line option is not ``--`` + the name with dashes
FLAGS = {"max_tokens": "--max-new-tokens", "batch_size": "--max-batch-size"}
SPEC_FLAGS = {"draft": "--draft", "draft_device": "--draft-device", "gamma": "--gamma",
              "on_reject": "--on-reject", "draft_strategy": "--draft-strategy",
              "draft_threshold": "--draft-threshold", "optimistic": "--optimistic"}


def add_serve_parser(sub) -> argparse.ArgumentParser:
    from .help_format import DefaultsHelpFormatter
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, streaming)",
                       allow_abbrev=False, formatter_class=DefaultsHelpFormatter)
    g = p.add_argument_group("models and engine")
    g.add_argument("--target", type=Path, default=None, help="target SDAR checkpoint (default: the bundled tiny target)")
    g.add_argument("--draft", type=Path, default=None, help="draft checkpoint, paper/exact (default: the bundled draft)")
    g.add_argument("--mode", default="exact", choices=["vanilla", "paper", "exact"], help="decoding mode")
    g.add_argument("--device", "--target-device", dest="device", default=None,
                   help="device of the target (default: cuda if available)")
    g.add_argument("--draft-device", default=None, help="device of the draft (default: the target's)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "cuda", "triton", "torch"],
                   help="attention kernels (auto: cuda > triton > torch on a GPU, torch on the CPU)")
    g.add_argument("--cuda-graphs", action="store_true", help="replay the forwards as CUDA graphs (CUDA only)")
    g.add_argument("--invariant", action="store_true",
                   help="shape-invariant numerics for the target (exact mode then equals vanilla bit for bit in "
                        "every dtype on the torch backend; slower verify forwards)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch's intra-op work (default: OMP_NUM_THREADS if set, else chosen from "
                        "the model size)")
    g.add_argument("--block-length", type=int, default=None,
                   help="the block length (default: the checkpoint's block_size; required for a qwen3 checkpoint "
                        "without one)")
    g.add_argument("--mask-token-id", type=int, default=None,
                   help="the mask token's id, for checkpoints that name none (default: the checkpoint's)")
    g.add_argument("--fold-commit", action="store_true", help="fold each block's commit into the next forward")
    g.add_argument("--on-reject", default=None, choices=["redraft", "fallback"],
                   help="after a rejection: draft again, or let the target finish the block (default: redraft)")
    g.add_argument("--no-rope-copy", action="store_true", help="ablation (paper mode)")
    g.add_argument("--paper-variant", default=None, choices=["described", "release"],
                   help="paper mode as described (default) or as the SimSD release runs it (see simsd generate)")
    g.add_argument("--optimistic", default=None, choices=["auto", "on", "off"],
                   help="draft the next round while the target verifies (auto: when the devices differ)")
    g.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together (engine rows)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="positions per request, prompt + max_tokens (default: the models' maximum)")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="GiB the KV caches may take; fewer rows than --max-batch-size if they do not fit")
    g.add_argument("--max-waiting", type=int, default=64,
                   help="requests that may wait for a row; beyond it: 503 with Retry-After")
    d = p.add_argument_group("request defaults (a request's own fields override them)")
    d.add_argument("--max-new-tokens", type=int, default=128, help="a request's max_tokens when it gives none")
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    d.add_argument("--top-k", type=int, default=0, help="0 = off")
    d.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    d.add_argument("--steps", type=int, default=None, help="denoising steps per block (default: the block length)")
    d.add_argument("--strategy", default="static", help="sequential | static | dynamic | entropy")
    d.add_argument("--threshold", type=float, default=None,
                   help="confidence threshold (dynamic) or entropy bound (entropy)")
    d.add_argument("--gamma", type=int, default=None, help="draft steps verified per round (default: the block length)")
    d.add_argument("--draft-strategy", default=None, help="the draft's strategy (default: the target's)")
    d.add_argument("--draft-threshold", type=float, default=None,
                   help="the draft's threshold, in its strategy's range (default: --threshold when the draft runs "
                        "the target's strategy, else the draft strategy's default)")
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on")
    h.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    h.add_argument("--served-model-name", default=None, help="the model name clients use (default: the target "
                                                               "directory's name)")
    h.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    return p


def _flag(param: str) -> str:
    return FLAGS.get(param, "--" + param.replace("_", "-"))


def default_params(args):
    """The request defaults of the command line as :class:`SamplingParams`."""
    from .params import SamplingParams
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              max_tokens=args.max_new_tokens, steps=args.steps, strategy=args.strategy,
                              threshold=args.threshold, gamma=args.gamma, draft_strategy=args.draft_strategy,
                              draft_threshold=args.draft_threshold)
    except ParamError as exc:
        raise UsageError(f"{_flag(exc.param)}: {exc}") from None


def check_serve_options(args) -> None:
    """The checks of ``simsd serve``'s own options that need neither torch nor a checkpoint (run
    first, so that a mistyped option answers at once). Raises :class:`UsageError`."""
    if args.mode == "vanilla":
        given = [flag for key, flag in SPEC_FLAGS.items() if getattr(args, key, None) is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: used by the paper and exact modes only (this server is vanilla)")
    if args.no_rope_copy and args.mode != "paper":
        raise UsageError("--no-rope-copy is an ablation of paper mode")
    from .options import check_paper_variant
    check_paper_variant(args, [args.mode])
    for name in ("max_batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"{_flag(name)} must be >= 1, got {getattr(args, name)}")
    if args.max_waiting < 0:
        raise UsageError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.kv_cache_memory is not None and not (math.isfinite(args.kv_cache_memory) and args.kv_cache_memory > 0):
        raise UsageError(f"--kv-cache-memory must be a finite number > 0 (GiB), got {args.kv_cache_memory}")
    check_port(args.port)
    check_engine_options([args.device, args.draft_device or args.device], args.cuda_graphs, args.invariant)
    if args.max_model_len is not None and args.max_new_tokens >= args.max_model_len:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} leaves no position for a prompt in "
                         f"--max-model-len {args.max_model_len} (a request without max_tokens would be refused)")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name must not be empty")


def build_llm(args):
    """The :class:`LLM` of ``simsd serve``'s options (:func:`check_serve_options` first; the rest
    is checked here before any model is loaded)."""
    from .api import LLM
    from .params import resolve
    params = default_params(args)
    from ..assets import DEFAULT_TARGET
    from ..models.config import ModelConfig
    target_config = ModelConfig.from_dir(args.target or DEFAULT_TARGET)
    block_length = args.block_length or target_config.block_size
    if block_length is None:  # config.json does not say block-diffusion: refused, naming everything that is missing
        from ..models.loading import read_checkpoint
        read_checkpoint(args.target or DEFAULT_TARGET, mask_token_id=args.mask_token_id)
    check_block_options(args, block_length, target_config.max_position_embeddings)  # before the models load
    optimistic = {None: None, "auto": None, "on": True, "off": False}[args.optimistic]
    try:
        llm = LLM(args.target, args.draft, args.mode, device=args.device, draft_device=args.draft_device,
                  dtype=args.dtype, batch_size=args.max_batch_size, max_model_len=args.max_model_len,
                  kv_cache_memory=None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2**30),
                  max_waiting=args.max_waiting, block_length=args.block_length, mask_token_id=args.mask_token_id,
                  fold_commit=args.fold_commit,
                  on_reject=args.on_reject or "redraft", rope_copy=not args.no_rope_copy, optimistic=optimistic,
                  paper_variant=args.paper_variant or "described",
                  attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs,
                  invariant=args.invariant, threads=args.threads, default_params=params)
    except ParamError as exc:
        raise UsageError(f"{_flag(exc.param)}: {exc}") from None
    try:
        resolve(params, llm.settings)  # the defaults against the model (e.g. --gamma above the block length)
    except ParamError as exc:
        llm.shutdown()
        raise UsageError(f"{_flag(exc.param)}: {exc}") from None
    if args.max_new_tokens >= llm.max_model_len:
        llm.shutdown()
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} leaves no position for a prompt in the "
                         f"{llm.max_model_len} positions of a request (--max-model-len; a request without "
                         f"max_tokens would be refused)")
    return llm


def serving_summary(llm) -> str:
    """What ``simsd serve`` runs, for its start-up line: mode, rows, positions, KV cache, device
    and dtype, CPU threads, and whether the target's numerics are shape-invariant."""
    import torch
    model = llm.target.model
    param = next(model.parameters())
    parts = [llm.mode, f"{llm.batch_size} row{'s' if llm.batch_size != 1 else ''} of {llm.max_model_len} positions",
             f"KV cache {llm.kv_cache_bytes / 2**20:.0f} MiB", f"{param.device} {str(param.dtype).replace('torch.', '')}"]
    if param.device.type == "cpu":
        n = torch.get_num_threads()
        parts.append(f"{n} CPU thread{'s' if n > 1 else ''}")
    if getattr(model, "invariant", False):
        parts.append("invariant numerics")
    return ", ".join(parts)


def check_port(port: int) -> None:
    """``UsageError`` unless ``port`` is a TCP port number (0: any free port)."""
    if not 0 <= port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {port}")


def listen_socket(host: str, port: int):
    """A listening TCP socket on ``host:port`` for uvicorn (``UsageError`` naming the address when
    it cannot be had: a taken port, a host that is not this machine's)."""
    import socket
    check_port(port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None
    sock.set_inheritable(True)
    return sock


def run_serve(args) -> int:
    check_serve_options(args)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise UsageError(f"simsd serve needs the serve extra ({exc.name} is not installed): "
                         f"pip install 'simsd[serve]'") from None
    from .server import build_app
    sock = listen_socket(args.host, args.port)  # before the models load: a taken port fails at once
    try:
        llm = build_llm(args)
    except BaseException:
        sock.close()
        raise
    app = build_app(llm, args.served_model_name)
    state = app.state.simsd

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / SIGINT: refuse new requests, let the open ones finish
            state.draining = True
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises the signal after the graceful shutdown (the process then
            # dies of it); a drained server exits with status 0 instead
            saved = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    print(f"simsd: serving {state.model_name!r} ({serving_summary(llm)}) on http://{args.host}:"
          f"{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    llm.shutdown()
    return 0


def leave(code: int):
    """End the process now with ``code``, after ``simsd serve`` has finished (socket closed, LLM
    shut down): the interpreter's teardown of torch, transformers and the server's modules
    costs about 0.5 s of CPU, seen as 10-30 s of wall time on a busy machine after uvicorn's
    "Finished server process". Log handlers and the standard streams are flushed first."""
    import logging
    import os
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
