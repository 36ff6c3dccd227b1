"""A second device on the CPU: catch the tensors a GPU run would find on two devices.

The GPU tests write ``DEVICE = "cuda" if torch.cuda.is_available() else "cpu"``; on the CPU every
tensor is on one device, so a test or a library line that combines a host tensor (``torch.arange(n)``)
with one on ``DEVICE`` passes here and fails on the GPU ("Expected all tensors to be on the same
device": the first H200 run lost 7 tests of ``test_append_kv.py`` to that, bench/results/device_h200).

:class:`EmulatedDevice` is a ``TorchFunctionMode`` that tells the two apart by provenance:

* a tensor is *placed* when it was moved with ``.to`` (a device argument) or ``.cuda()``, or
  computed from a placed tensor; ``.cpu()`` and ``.numpy()`` results are host tensors again;
* a tensor made without a device (``torch.arange(3)``, ``torch.tensor(lens)``, a generator's
  ``randn``), or computed from host tensors only, is a *host* tensor; one made with ``device=``
  (which may name a host tensor's device), or that the mode never saw made, is neither;
* an operation whose inputs hold a placed tensor and a host tensor of one or more dimensions
  raises :class:`DeviceMixError`, as CUDA would; 0-dim host tensors (CUDA takes them as scalars),
  indices of ``[]`` / ``index_put_``, and copies (``copy_``, ``.to``) are allowed, as on CUDA.

Parameters count as placed. A no-op ``.to("cpu")`` returns a new view under the mode, so the host
original stays a host tensor, as on a GPU. The mode errs towards silence: it only blames what it
saw made on both sides.

``pytest --emulate-device`` runs every test under it (tests/conftest.py); CI runs the device-agnostic
GPU tests that way (``.ci/run``).
"""
from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

#: functions that may combine tensors of two devices on CUDA: indexing with host indices, copies
ALLOWED = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put", "copy_", "to", "cpu", "numpy",
                     "tolist", "item", "__repr__", "__format__", "__str__", "__len__", "__iter__", "size", "dim",
                     "__get__", "__set__", "data_ptr", "element_size", "is_floating_point", "numel",
                     "shape", "device", "dtype", "stride", "storage_offset", "is_contiguous", "__reduce_ex__"})
#: functions whose result is a host tensor
TO_HOST = frozenset({"cpu", "numpy"})


class DeviceMixError(RuntimeError):
    """An operation combined a tensor placed on the device under test with a host tensor."""


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)
    return out


def _names_a_device(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (str, torch.device)) and _is_device(a) for a in args)


def _is_device(a) -> bool:
    if isinstance(a, torch.device):
        return True
    try:
        torch.device(a)
        return True
    except (RuntimeError, TypeError):
        return False


class EmulatedDevice(TorchFunctionMode):
    """The mode (see the module doc). ``placed`` / ``host``: ``id -> weak reference`` of the tensors
    it saw made on each side (by identity: a ``WeakSet`` would compare tensors with ``==``). A
    tensor it never saw made (inside ``torch._C.DisableTorchFunction``, by a custom op's own
    implementation, or before the mode started) is on neither side and never blamed."""

    def __init__(self):
        super().__init__()
        self.placed: dict = {}
        self.host: dict = {}

    @staticmethod
    def _holds(table: dict, t: torch.Tensor) -> bool:
        ref = table.get(id(t))
        return ref is not None and ref() is t

    def is_placed(self, t: torch.Tensor) -> bool:
        return self._holds(self.placed, t) or isinstance(t, torch.nn.Parameter)

    def is_host(self, t: torch.Tensor) -> bool:
        return self._holds(self.host, t) and not self.is_placed(t)

    def _mark(self, table: dict, other: dict, out) -> None:
        for t in _tensors(out, []):
            if len(table) > 200_000:  # drop the entries of freed tensors
                alive = {k: r for k, r in table.items() if r() is not None}
                table.clear()
                table.update(alive)
            try:
                table[id(t)] = weakref.ref(t)
            except TypeError:
                continue
            other.pop(id(t), None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors(args, []) + _tensors(kwargs, [])
        placed_in = any(self.is_placed(t) for t in inputs)
        if placed_in and name not in ALLOWED:
            host = [t for t in inputs if self.is_host(t) and t.dim() > 0]
            if host:
                shapes = ", ".join(str(tuple(t.shape)) for t in host[:3])
                raise DeviceMixError(f"{name}: a tensor on the device under test meets host tensor(s) of shape "
                                     f"{shapes}; on a GPU this raises 'Expected all tensors to be on the same "
                                     f"device' (make the host tensor with device=, or .to() it)")
        out = func(*args, **kwargs)
        moved = name in ("to", "cuda") and _names_a_device(args[1:], kwargs)
        if (moved or name == "cpu") and out is args[0]:
            # on the CPU the move is a no-op returning its input; on a GPU the original and the
            # moved copy are two tensors on two devices: keep them two
            out = out.view_as(out)
        if name == "copy_":
            return out  # the destination keeps its side
        if name in TO_HOST:
            self._mark(self.host, self.placed, out)
        elif placed_in or moved:
            self._mark(self.placed, self.host, out)
        elif kwargs.get("device") is not None:
            pass  # made with device=: that may name a host tensor's device as well (neither side)
        elif not inputs or any(self.is_host(t) for t in inputs):
            self._mark(self.host, self.placed, out)
        return out
