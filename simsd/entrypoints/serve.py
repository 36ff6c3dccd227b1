"""``simsd serve``: the OpenAI-compatible server (:mod:`simsd.entrypoints.server`) under uvicorn.

Server-wide settings come from the command line (models, mode, block length, engine size);
the request defaults too (``--max-tokens``, ``--temperature``, ``--strategy`` ...: the fields
of a request, under the same names), which each request may override with its own fields.
SIGTERM (or Ctrl-C) drains: no new requests (503), the running and waiting ones finish, then
the process exits.
"""
from __future__ import annotations

import contextlib
import signal
import sys

from ..decoding.choices import ParamError, opt
from .errors import MissingPackageError


def build_llm(args):
    """The :class:`~simsd.entrypoints.api.LLM` of ``simsd serve``'s options (checked by
    :func:`~simsd.entrypoints.cli.check_options`; the rest, the request defaults among them, is
    checked by the LLM before any weight loads)."""
    from .api import LLM
    return LLM.from_config(args.engine, default_params=args.params)


def serving_summary(llm) -> str:
    """What ``simsd serve`` runs, for its start-up line: mode, rows, positions, KV cache, device
    and dtype, CPU threads, and whether the target's numerics are shape-invariant."""
    import torch
    model = llm.target.model
    param = next(model.parameters())
    parts = [llm.mode, f"{llm.batch_size} row{'s' if llm.batch_size != 1 else ''} of {llm.max_model_len} positions",
             f"KV cache {llm.kv_cache_bytes / 2**20:.0f} MiB",
             f"{param.device} {str(param.dtype).replace('torch.', '')}"]
    if param.device.type == "cpu":
        n = torch.get_num_threads()
        parts.append(f"{n} CPU thread{'s' if n > 1 else ''}")
    if getattr(model, "invariant", False):
        parts.append("invariant numerics")
    return ", ".join(parts)


def listen_socket(host: str, port: int):
    """A listening TCP socket on ``host:port`` for uvicorn (:class:`ParamError` naming the address
    when it cannot be had: a taken port, a host that is not this machine's)."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ParamError("host", f"{opt('host')} {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ParamError("port", f"{opt('host')} {host} {opt('port')} {port}: cannot listen there "
                                 f"({exc.strerror})") from None
    sock.set_inheritable(True)
    return sock


def run_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise MissingPackageError(f"simsd serve needs the serve extra ({exc.name} is not installed): "
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
