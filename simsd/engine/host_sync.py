"""Host <-> device traffic of the decoding loop (docs/design.md §6: no host sync inside a round
except reading the accept decision).

* :func:`to_device` moves small host values (ids, per-row counts) to a device without a
  stream sync (pinned memory, ``non_blocking``), where ``torch.tensor(values, device=cuda)``
  would wait for every queued kernel.
* :class:`HostReads` counts the operations that read device data on the host (``item``,
  ``tolist``, ``bool()``, ``nonzero`` ...): on a GPU each of them waits for the stream. Tests
  use it on the CPU to check that a round makes exactly one read; on a GPU
  ``torch.cuda.set_sync_debug_mode`` checks the same.
"""
from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

#: torch functions that copy tensor data to the host (a stream sync on a GPU)
READ_OPS = frozenset({"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy",
                      "nonzero", "argwhere", "equal", "masked_select", "unique", "unique_consecutive"})


def to_device(values, device, dtype=torch.int64) -> torch.Tensor:
    """``torch.tensor(values, dtype)`` on ``device`` (``values`` host numbers, or a host tensor
    taken as it is, ``dtype`` ignored); for a CUDA device staged in pinned host memory and copied
    asynchronously (no wait for the device's queued work: a copy from pageable memory, even
    ``non_blocking``, is one that ``torch.cuda.set_sync_debug_mode`` may report)."""
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostReads(TorchFunctionMode):
    """Context manager counting host reads of tensor data (:data:`READ_OPS`, and ``.to`` a CPU
    device from another device). ``count``: reads so far; ``where``: a short stack per read
    (with ``trace=True``), to find an unwanted sync. Operations inside a custom op's own
    implementation and the torch attention backend's plan (its one read of the cache lengths
    and labels per forward, :mod:`simsd_kernels.torch_backend`; the fused backends read nothing)
    are not seen."""

    def __init__(self, trace: bool = False):
        super().__init__()
        self.count = 0
        self.trace = trace
        self.where: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        read = name in READ_OPS
        if name == "to" and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            target = next((a for a in list(args[1:]) + [kwargs.get("device")]
                           if isinstance(a, (str, torch.device))), None)
            read = target is not None and torch.device(target).type == "cpu"
        if read:
            self.count += 1
            if self.trace:
                self.where.append((name, "".join(traceback.format_stack(limit=6)[:-1])))
        return func(*args, **kwargs)
