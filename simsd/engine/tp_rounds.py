"""One scheduler's rounds on every tensor-parallel rank (``simsd serve --tp N``, docs/design.md §6).

Tensor-parallel ranks run SPMD: every rank runs the same rounds over the same rows, and each
forward's all-reduces pair up (:mod:`simsd.engine.tp`). A batch known up front gives the same
rounds everywhere by itself; a server's requests arrive, and are cancelled, at moments only rank 0
(the one with the HTTP server) sees. So rank 0 leads: its scheduler takes each round's inputs
(:meth:`~simsd.engine.scheduler.Scheduler.take_inputs`: the running requests cancelled, the
waiting ones admitted) and :meth:`Leader.publish` broadcasts them before the round runs; every
other rank runs :func:`follow`: it receives them, rebuilds the admitted requests from what built
them on rank 0 (``Request.source``: the prompt, the parameters, the seed drawn for them, the
request id) and runs the same round (:meth:`~simsd.engine.scheduler.Scheduler.run_round`).
:meth:`Leader.stop` ends the followers. Nothing else crosses: each rank's rows, programs and
keyed noise then agree (same inputs, same logits).

The inputs travel as pickled objects (``broadcast_object_list``) over a gloo group of every rank
(:func:`control_group`; NCCL moves tensors, not objects), one broadcast per round: none when
``tp`` is 1. The group's timeout is long (:data:`CONTROL_TIMEOUT`): a follower waits in a
broadcast for as long as the server is idle. A rank that dies closes its connections: the
others' next broadcast or all-reduce raises (gloo), the leader halts (its scheduler fails what
runs and waits, takes nothing new: ``Scheduler.error``) and a follower's loop raises.
"""
from __future__ import annotations

import itertools
import weakref
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from .scheduler import Scheduler

#: the control group's timeout: longer than any server waits idle between requests
CONTROL_TIMEOUT = timedelta(days=365)


def control_group():
    """A gloo group of every rank for the rounds' inputs (a collective: every rank calls it,
    at the same point)."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


class Leader:
    """Rank 0's side: :meth:`publish` is its scheduler's ``publish`` hook. Each admitted request
    gets a key (a counter) by which a later cancellation names it."""

    def __init__(self, group):
        self.group = group
        self._keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next = itertools.count()

    def publish(self, cancels: list, admits: list) -> None:
        """Broadcast one round's inputs: the keys of ``cancels``, ``(key, source)`` of each of
        ``admits`` (:class:`~simsd.engine.scheduler.Request`)."""
        for req in admits:
            self._keys[req] = next(self._next)
        message = ([self._keys[r] for r in cancels], [(self._keys[r], r.source) for r in admits])
        dist.broadcast_object_list([message], src=0, group=self.group)

    def stop(self) -> None:
        """End the followers' loops (after the last round)."""
        dist.broadcast_object_list([None], src=0, group=self.group)


def follow(scheduler: Scheduler, rebuild: Callable, group) -> int:
    """Run the leader's rounds on this rank until :meth:`Leader.stop`; returns the rounds run.

    Args:
        scheduler: this rank's scheduler (no thread of its own; nothing else submits to it).
        rebuild: ``rebuild(source) -> Request``: the request of a leader's ``Request.source``.
        group: :func:`control_group`.

    Raises:
        RuntimeError: a cancellation of a request this rank does not run (the ranks have parted).
        what the broadcast raises when the leader is gone (gloo: a closed connection).
    """
    running: dict = {}  # key -> Request, until it ends or is preempted (the leader admits it again)
    scheduler.requeue = False
    rounds = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        if box[0] is None:
            return rounds
        cancel_keys, sources = box[0]
        missing = [k for k in cancel_keys if k not in running]
        if missing:
            raise RuntimeError(f"tensor-parallel ranks parted: the leader cancels requests {missing} this rank "
                               f"does not run")
        cancels = [running.pop(k) for k in cancel_keys]
        admits = []
        for key, source in sources:
            running[key] = req = rebuild(source)
            admits.append(req)
        scheduler.run_round(cancels, admits)
        rounds += 1
        for key in [k for k, r in running.items() if r.done or r.row is None]:
            del running[key]
