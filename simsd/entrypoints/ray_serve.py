"""Ray Serve: ``simsd serve --ray --replicas N`` (docs/scaling.md).

One replica is one :class:`~simsd.entrypoints.api.LLM` (its own rows, devices and resources:
:func:`~simsd.entrypoints.ray_cluster.llm_resources`) serving the app of
:func:`simsd.entrypoints.openai.api_server.build_app` through Ray Serve's ingress: the routes, request
checks, errors, streaming and the cancellation of a disconnected client's requests are the
server's own, run inside the replica. Ray Serve's proxy spreads the requests over the replicas;
``--max-replicas`` turns on its autoscaling (between ``--replicas`` and ``--max-replicas``,
aiming at ``--batch-size`` ongoing requests per replica). A request's output does not depend on
the replica or on what else it decodes (batch invariance), so every replica answers as one
``simsd serve`` does for the same seed.
"""
from __future__ import annotations

import sys

#: the Ray Serve application and deployment name
NAME = "simsd"


class Replica:
    """One replica: the LLM of ``simsd serve``'s options ``args`` and the server app over it
    (Ray Serve's late-bound ingress calls :meth:`__serve_build_asgi_app__` once it is built)."""

    def __init__(self, args):
        from .serve import app_of, build_llm
        self.llm = build_llm(args)
        self.server = app_of(args, self.llm)  # (not `app`: a property of Ray Serve's ingress wrapper)

    def __serve_build_asgi_app__(self):
        return self.server

    def metrics(self) -> dict:
        """This replica's :meth:`simsd.LLM.metrics` and its Ray Serve replica id (``replica``)."""
        from ray import serve
        return {**self.llm.metrics(), "replica": serve.get_replica_context().replica_id.unique_id}


def deployment(args):
    """The Ray Serve deployment of ``simsd serve --ray``'s options (checked by
    :func:`~simsd.entrypoints.cli.check_options`), bound to them: an application for ``serve.run``."""
    from ray import serve

    from .ray_cluster import llm_resources
    scale = ({"num_replicas": args.replicas} if args.max_replicas is None else
             {"autoscaling_config": {"min_replicas": args.replicas, "max_replicas": args.max_replicas,
                                     "target_ongoing_requests": args.engine.batch_size}})
    ingress = serve.ingress()(Replica)
    return serve.deployment(ingress, name=NAME, ray_actor_options=llm_resources(args.engine),
                            max_ongoing_requests=args.engine.batch_size + args.engine.max_waiting,
                            **scale).bind(args)


def start(args) -> str:
    """Deploy ``simsd serve --ray``'s application (Ray Serve's HTTP proxy on ``--host`` /
    ``--port``) and return its URL once every replica has loaded its LLM. Ray Serve's own
    progress lines (INFO) stay out of the driver's output; its warnings and errors do not."""
    import logging

    from ray import serve

    from .ray_cluster import init_ray
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    init_ray()
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(deployment(args), name=NAME, route_prefix="/", blocking=False)
    return f"http://{args.host}:{args.port}"


def run_serve(args) -> int:
    """``simsd serve --ray``: deploy, say where, serve until SIGINT / SIGTERM, then shut Ray
    Serve down (its replicas finish the requests they hold)."""
    import signal
    import threading

    from ray import serve

    from .ray_cluster import require_ray
    from .serve import api_key_of
    require_ray("ray.serve")
    api_key_of(args)  # before any replica starts: a key that could never match fails at once
    if args.port == 0:
        from ..engine.tp import free_port
        args.port = free_port()
    url = start(args)
    replicas = (f"{args.replicas} replica{'s' if args.replicas > 1 else ''}" if args.max_replicas is None
                else f"{args.replicas} to {args.max_replicas} replicas")
    from pathlib import Path

    from ..assets import DEFAULT_TARGET
    name = args.served_model_name or Path(args.engine.target or DEFAULT_TARGET).name
    print(f"simsd: serving {name!r} on {url} (Ray Serve, {replicas})", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):  # (a bounded wait: the handler runs on this thread between waits)
        pass
    serve.shutdown()
    return 0
