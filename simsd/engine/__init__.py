"""Engine: running the forwards of many requests efficiently.

Holds the batch engine (``batching``: row programs, batched forwards over one static cache
with per-row lengths, padding labels, cache-overflow checks), continuous batching
(``scheduler``: requests admitted into free rows between rounds, retired at once, a bounded
queue, cancellation, per-request fault isolation), CUDA-graph capture and replay
(``graphs``), tensor parallelism of the target (``tp``: head/MLP sharding, rank set-up) and
host-sync accounting (``host_sync``: pinned asynchronous copies, the host-read counter).
The engine knows forwards, caches and rows, not decoding rules: a request's denoising step
is an object the engine calls back (:class:`simsd.decoding.step.Step`).

May import: :mod:`simsd.models`, :mod:`simsd_kernels`, torch. Never :mod:`simsd.decoding`,
:mod:`simsd.speculative` or :mod:`simsd.entrypoints`, which build on it.
"""
from .batching import BatchEngine, BatchResult, Fwd, Row, engine_for
from .host_sync import HostReads, to_device
from .scheduler import QueueFull, Request, Scheduler, SchedulerClosed

__all__ = ["BatchEngine", "BatchResult", "Fwd", "Row", "engine_for", "HostReads", "to_device", "QueueFull",
           "Request", "Scheduler", "SchedulerClosed"]
