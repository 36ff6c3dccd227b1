"""``simsd serve``: the OpenAI-compatible server (:mod:`simsd.entrypoints.openai`) under uvicorn.

Server-wide settings come from the command line (models, mode, block length, engine size);
the request defaults too (``--max-tokens``, ``--temperature``, ``--strategy`` ...: the fields
of a request, under the same names), which each request may override with its own fields.
``--api-key`` (or ``SIMSD_API_KEY``), ``--allowed-origins`` (``--allowed-headers``,
``--allowed-methods``) and ``--disable-docs`` say what a network client may reach
(:func:`simsd.entrypoints.openai.api_server.build_app`); ``--max-request-bytes``,
``--max-header-bytes`` and ``--request-read-timeout`` bound what a request may cost
(:mod:`simsd.entrypoints.openai.connection`: uvicorn's h11 protocol, whatever parser is
installed); ``--round-timeout`` turns ``/health`` 503 when the engine is stuck.

Shutdown, on SIGTERM or SIGINT (Ctrl-C): the listener stays open and answers new requests with
a 503 while the requests in flight finish, for ``--shutdown-timeout`` seconds at most; then,
or at once on a second signal, the rest are cancelled (a 503, a stream's error chunk) and
uvicorn's own shutdown closes the listener and the connections; the process exits 0. A third
signal is uvicorn's forced exit. Whatever still runs in the engine then is cancelled, not
decoded for nobody.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from ..config.serving import check_api_key
from ..config.vocabulary import ParamError, opt
from .errors import MissingPackageError


def build_llm(args):
    """The :class:`~simsd.entrypoints.api.LLM` of ``simsd serve``'s options (checked by
    :func:`~simsd.entrypoints.cli.check_options`; the rest, the request defaults among them, is
    checked by the LLM before any weight loads). The request defaults not typed are the target's
    generation config's (:func:`~simsd.entrypoints.builder.default_params_of`)."""
    from .api import LLM
    return LLM.from_config(args.engine, default_params=args.params, given=set(args.typed))


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


def api_key_of(args) -> str | None:
    """The API key of ``simsd serve``: ``--api-key``, else the ``SIMSD_API_KEY`` environment
    variable, else None (no key). Raises :class:`ParamError` for a key a client could never send
    (:func:`~simsd.config.serving.check_api_key`)."""
    import os
    if args.api_key:
        return check_api_key(args.api_key)
    key = os.environ.get("SIMSD_API_KEY") or None
    return None if key is None else check_api_key(key, "the SIMSD_API_KEY environment variable")


def comma_list(value) -> list:
    """The items of a comma-separated option (none for None)."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def app_of(args, llm):
    """The server app of ``simsd serve``'s HTTP options for ``llm``: the API key
    (:func:`api_key_of`), ``--allowed-origins``, ``--allowed-headers``, ``--allowed-methods``
    (comma-separated), ``--disable-docs``, ``--max-request-bytes``, ``--round-timeout``
    (:func:`simsd.entrypoints.openai.api_server.build_app`)."""
    from .openai.api_server import build_app
    return build_app(llm, args.served_model_name, api_key=api_key_of(args), allowed_origins=comma_list(
        args.allowed_origins), allowed_headers=comma_list(args.allowed_headers), allowed_methods=comma_list(
        args.allowed_methods), docs=not args.disable_docs, max_request_bytes=args.max_request_bytes,
        round_timeout=args.round_timeout)


def run_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise MissingPackageError(f"simsd serve needs the serve extra ({exc.name} is not installed): "
                                  f"pip install 'simsd[serve]'") from None
    from .serve_tp import lead, rank_of, run_follower
    if rank_of() > 0:  # tensor-parallel: rank 0 serves, the others run its rounds
        return run_follower(build_llm(args))
    sock = None
    try:
        api_key_of(args)  # before the models load: a key that could never match fails at once
        sock = listen_socket(args.host, args.port)  # before the models load: a taken port fails at once
        llm = build_llm(args)
        leader = lead(llm)  # None with one rank
    except BaseException:
        if sock is not None:
            sock.close()
        if args.engine.tp > 1:  # the other ranks wait for rank 0's rounds, not in a goodbye barrier
            from ..engine.tp import abandon
            abandon()
        raise
    app = app_of(args, llm)
    state = app.state.simsd

    class Server(uvicorn.Server):
        """uvicorn's server; its exit hook (``handle_exit``, called by the signal handler) runs
        the drain (:meth:`simsd.entrypoints.openai.state.ServerState.drain`) before ``should_exit``
        lets uvicorn shut down."""
        loop = None
        signals = 0

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame):
            if self.loop is None:  # before start-up: uvicorn's own (it stops before serving)
                return super().handle_exit(sig, frame)
            self.loop.call_soon_threadsafe(self.on_signal, signal.Signals(sig).name)

        def on_signal(self, name: str) -> None:  # the event loop
            self.signals += 1
            if self.signals == 1:
                print(f"simsd: {name}: refusing new requests, the {len(state.calls)} in flight have "
                      f"{args.shutdown_timeout:g} s to finish (a second signal cancels them)",
                      file=sys.stderr, flush=True)
                self.drain_task = asyncio.ensure_future(self.drain())  # held: an unreferenced task may vanish
            elif self.signals == 2:
                print(f"simsd: {name}: cancelling the {len(state.calls)} requests in flight", file=sys.stderr,
                      flush=True)
                state.cancel_calls(f"the server is shutting down ({name}): the request was cancelled")
            else:
                self.should_exit = self.force_exit = True

        async def on_tick(self, counter) -> bool:
            if llm.scheduler.error is not None and not self.should_exit:  # a halted leader (serve --tp)
                print(f"simsd: error: a tensor-parallel rank failed ({llm.scheduler.error!r}); stopping",
                      file=sys.stderr, flush=True)
                self.should_exit = True
            return await super().on_tick(counter)

        async def drain(self):
            await state.drain(args.shutdown_timeout)
            self.should_exit = True

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

    # timeout_graceful_shutdown: after the drain nothing runs; a connection still open after
    # that (a client still sending its body) is closed by uvicorn. http: h11 with a bounded head
    # and a read deadline, whatever parser is installed (httptools reads headers without bound)
    from .openai.connection import connection_class
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=5, http=connection_class(args.request_read_timeout),
                                   h11_max_incomplete_event_size=args.max_header_bytes))
    print(f"simsd: serving {state.model_name!r} ({serving_summary(llm)}) on http://{args.host}:"
          f"{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    llm.shutdown(drain=False)  # after a forced exit: nobody is left to receive what still runs
    done = llm.scheduler.finished
    print(f"simsd: stopped ({done['ok']} requests finished, {done['cancelled']} cancelled, {done['error']} failed)",
          file=sys.stderr, flush=True)
    if llm.scheduler.error is not None:  # the ranks parted: no goodbye, the launcher ends the others
        leave(1)
    if leader is not None:
        try:
            leader.stop()
        except RuntimeError as exc:  # a rank died while the server was idle (the launcher ends the others)
            print(f"simsd: error: a tensor-parallel rank is gone ({str(exc).splitlines()[0]})", file=sys.stderr,
                  flush=True)
            leave(1)
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
