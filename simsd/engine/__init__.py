"""Engine: running the forwards of many requests efficiently.

Holds the batch engine (``batching``: forward requests of row programs, batched forwards over
one static cache with per-row lengths, padding labels, cache-overflow checks; it calls the
model itself), continuous batching (``scheduler``: the one driver of row
programs; requests admitted into free rows between rounds, retired at once, a bounded queue,
cancellation, per-request fault isolation), CUDA-graph capture and replay
(``graphs``), tensor parallelism of the target (``tp``: head/MLP sharding, rank set-up) and
host-sync accounting (``host_sync``: pinned asynchronous copies, the host-read counter).
The engine knows forwards, caches and rows, not decoding rules: a request's denoising step
is an object the engine calls back (:class:`simsd.decoding.step.Step`).

May import: :mod:`simsd.models`, :mod:`simsd_kernels`, torch. Never :mod:`simsd.decoding`,
:mod:`simsd.speculative` or :mod:`simsd.entrypoints`, which build on it.
"""
from .batching import BatchEngine, Fwd, Row, round_capacity
from .host_sync import HostReads, to_device
from .scheduler import QueueFull, Request, Scheduler, SchedulerClosed, decode_span, run_requests

__all__ = ["BatchEngine", "Fwd", "Row", "round_capacity", "HostReads", "to_device", "QueueFull", "Request",
           "Scheduler", "SchedulerClosed", "decode_span", "run_requests"]
