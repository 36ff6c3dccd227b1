"""Ray Data: ``simsd generate --ray`` and ``simsd eval --ray`` (docs/scaling.md).

A prepared run (:class:`~simsd.entrypoints.commands.Run`: options, checkpoints and prompts
checked, no weights loaded) is fanned over ``--num-workers`` Ray actors with
``Dataset.map_batches`` (an actor pool): each actor builds the run's LLMs once (one per mode,
the checkpoints shared, as one process does) and decodes chunks of ``--batch-size`` prompts.
A chunk is decoded as one process decodes it (:func:`simsd.entrypoints.bench.one_pass`), and
prompt ``i`` samples with the seed of its index in the whole set (``Run.params_of``), never of
its place in a worker's chunk; a prompt's tokens do not depend on its neighbours (batch
invariance), so every prompt's output equals one process's. The chunks come back in the order
they finish; the callers put them back in the input order.
"""
from __future__ import annotations

import pickle


class Workers:
    """The ``map_batches`` callable class: one actor's LLMs (``modes``: ``--modes`` labels,
    :data:`~simsd.entrypoints.run_modes.RUN_MODES`), decoding one chunk of prompt indices per
    call. ``warmup``: prompt indices decoded once, untimed, before the first chunk."""

    def __init__(self, run, modes: list, warmup: list):
        from .bench import warm_up
        from .commands import build_llms
        from .run_modes import RUN_MODES
        self.run, self.llms = run, build_llms(run, modes)
        self.params = {label: run.params_of(RUN_MODES[label].mode) for label in modes}
        self.batch_size = next(iter(self.llms.values())).batch_size
        if warmup:
            warm_up(self.llms, self.requests(warmup), self.params_at(warmup), self.batch_size)

    def requests(self, indices: list) -> list:
        return [self.run.prompts[i].request for i in indices]

    def params_at(self, indices: list) -> dict:
        return {label: [p[i] for i in indices] for label, p in self.params.items()}

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        from .bench import one_pass
        indices = [int(i) for i in batch["index"]]
        outs = one_pass(self.llms, self.requests(indices), self.params_at(indices), indices[0] // self.batch_size)
        return {"chunk": np.array([pickle.dumps((indices, outs))], dtype=object)}


def map_chunks(run, modes: list, indices: list, num_workers: int, warmup: list = ()):
    """Decode the prompts ``indices`` of ``run`` on ``num_workers`` Ray actors (see the module
    doc); yields ``(chunk indices, {label: [RequestOutput] in the chunk's order})`` per chunk of
    at most the run's batch size, in the order the chunks finish.

    Raises:
        MissingPackageError: Ray Data is not installed.
        ray.exceptions.RayTaskError: a worker failed (the error names the worker's exception).
    """
    from .ray_cluster import init_ray, llm_resources, require_ray
    require_ray("ray.data")
    import logging

    import ray.data
    init_ray()
    ray.data.DataContext.get_current().enable_progress_bars = False  # the command's own output only
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    chunk = min(run.config.batch_size, len(run.prompts))
    ds = ray.data.from_items([{"index": i} for i in indices], override_num_blocks=max(1, -(-len(indices) // chunk)))
    ds = ds.map_batches(Workers, fn_constructor_args=(run, modes, list(warmup)), batch_size=chunk,
                        batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=num_workers),
                        **llm_resources(run.config))
    for row in ds.iter_rows():
        yield pickle.loads(row["chunk"])


def run_generate(args) -> int:
    """``simsd generate --ray``: the prepared run (:func:`~simsd.entrypoints.commands.prepare`)
    decoded by ``--num-workers`` workers, each prompt printed as one process prints it
    (:func:`~simsd.entrypoints.commands.print_output`), in the input order as soon as the prompts
    before it are done; without ``--json`` a last line gives the run's tokens over its wall time
    (the workers' start and loading included)."""
    import time

    from .commands import prepare, print_output
    run = prepare(args, [args.mode])
    outs, shown, start = [None] * len(run.prompts), 0, time.perf_counter()
    for indices, chunk in map_chunks(run, [args.mode], list(range(len(run.prompts))), args.num_workers):
        for i, out in zip(indices, chunk[args.mode]):
            outs[i] = out
        while shown < len(outs) and outs[shown] is not None:
            print_output(run.prompts[shown], outs[shown], args, len(outs) > 1)
            shown += 1
    if not args.json:
        tokens, seconds = sum(len(o.token_ids) for o in outs), time.perf_counter() - start
        print(f"[{len(outs)} prompts, {args.num_workers} Ray workers of batch size "
              f"{min(run.config.batch_size, len(outs))}] {tokens} tokens in {seconds:.3f} s of wall time, loading "
              f"included ({tokens / seconds:.1f} tokens/s)", flush=True)
    return 0
