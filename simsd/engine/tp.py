"""Tensor-parallel target over ``torch.distributed`` (docs/design.md §6).

Megatron-style sharding of the SDAR decoder across ``world`` ranks: each rank keeps
``Hq / world`` query heads and ``Hkv / world`` kv heads (their rows of the merged q/k/v
projection and ``o_proj`` columns) and ``intermediate / world`` MLP channels (their rows of the
merged gate/up projection, ``down`` columns); ``o_proj`` and ``down_proj`` outputs are summed
with one all-reduce each per layer.
A mixture-of-experts layer (:class:`simsd.models.moe.SparseMoeBlock`) keeps its router whole and
``moe_intermediate_size / world`` channels of every expert (as vLLM's fused MoE shards them):
every rank routes every token to the same experts, and the block's output is summed with one
all-reduce.
Embedding, norms and ``lm_head`` are replicated, so every rank ends a forward with the same
logits and runs the same decoding program (SPMD): identical seeds give identical decisions
without any further communication. Each rank's KV cache holds its own kv heads.

Launch: ``torchrun --nproc-per-node N -m simsd.entrypoints.cli generate --tp N ...`` or plain
``simsd generate --tp N ...``, which spawns the N ranks itself (NCCL on CUDA, one GPU per
rank: ``cuda:<local rank>``; gloo on CPU). Across M machines, one torchrun per machine
(``--nnodes M --nproc-per-node N/M --node-rank r --master-addr HOST --master-port P``): every
rank joins the group from torchrun's environment (:func:`init_from_env`), the same way on one
machine or many. Only rank 0 prints.
"""
from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn

from simsd.models.moe import SparseMoeBlock


class AllReduce(nn.Module):
    """A row-parallel module (a linear with a slice of its input columns, or the experts with a
    slice of their channels): the local computation, then the sum over the tensor-parallel group."""

    def __init__(self, inner: nn.Module, group=None):
        super().__init__()
        self.inner, self.group = inner, group

    @property
    def weight(self):
        return self.inner.weight

    def forward(self, x):
        y = self.inner(x)
        dist.all_reduce(y, group=self.group)
        return y


def _rows(linear: nn.Linear, spans: list) -> nn.Linear:
    """A linear of the rows ``[start, stop)`` of each span of ``linear``, in order."""
    w = torch.cat([linear.weight.data[start:stop] for start, stop in spans], 0)
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight.data = w
    return out


def _cols(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    w = linear.weight.data[:, start:stop].contiguous()
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    out.weight.data = w
    return out


def check_tp(config, world: int) -> None:
    """Raise ``ValueError`` unless heads, MLP channels and expert channels divide by ``world``."""
    c = config
    sizes = [("num_attention_heads", c.num_attention_heads), ("num_key_value_heads", c.num_key_value_heads),
             ("intermediate_size", c.intermediate_size)]
    if any(c.is_moe_layer(i) for i in range(c.num_hidden_layers)):
        sizes.append(("moe_intermediate_size", c.moe_intermediate_size))
    for name, n in sizes:
        if n % world:
            raise ValueError(f"--tp {world}: {name} = {n} is not a multiple of {world}")


def _shard_experts(experts, rank: int, world: int) -> None:
    """Keep channels ``[rank * i, (rank + 1) * i)`` of every expert (``i = I / world``): those rows
    of the gate and of the up half of ``gate_up_proj (E, 2I, H)``, those columns of ``down_proj``."""
    I = experts.down_proj.shape[2]
    i = I // world
    keep = torch.cat([torch.arange(rank * i, (rank + 1) * i), I + torch.arange(rank * i, (rank + 1) * i)])
    experts.gate_up_proj = nn.Parameter(experts.gate_up_proj.data[:, keep.to(experts.gate_up_proj.device)].clone())
    experts.down_proj = nn.Parameter(experts.down_proj.data[:, :, rank * i:(rank + 1) * i].contiguous())


def shard_model(model, rank: int, world: int, group=None):
    """Turn a full :class:`SDARForCausalLM` into rank ``rank``'s shard, in place; returns it.

    Raises:
        ValueError: see :func:`check_tp`.
    """
    check_tp(model.config, world)
    if world == 1:
        return model
    D = model.config.head_dim
    for layer in model.model.layers:
        att = layer.self_attn
        Hq, Hkv = att.num_heads, att.num_kv_heads
        hq, hkv = Hq // world, Hkv // world
        # the merged q/k/v rows: this rank's q heads, then its k heads, then its v heads
        att.qkv_proj = _rows(att.qkv_proj, [(rank * hq * D, (rank + 1) * hq * D),
                                            ((Hq + rank * hkv) * D, (Hq + (rank + 1) * hkv) * D),
                                            ((Hq + Hkv + rank * hkv) * D, (Hq + Hkv + (rank + 1) * hkv) * D)])
        att.o_proj = AllReduce(_cols(att.o_proj, rank * hq * D, (rank + 1) * hq * D), group)
        att.num_heads, att.num_kv_heads = hq, hkv
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            _shard_experts(mlp.experts, rank, world)
            layer.mlp = AllReduce(mlp, group)
            continue
        inter = mlp.gate_up_proj.weight.shape[0] // 2
        i = inter // world
        mlp.gate_up_proj = _rows(mlp.gate_up_proj,
                                 [(rank * i, (rank + 1) * i), (inter + rank * i, inter + (rank + 1) * i)])
        mlp.down_proj = AllReduce(_cols(mlp.down_proj, rank * i, (rank + 1) * i), group)
    model.num_local_heads = model.config.num_attention_heads // world
    model.num_local_kv_heads = model.config.num_key_value_heads // world
    model.tp = (rank, world)
    return model


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_device(device: str | None) -> str:
    """The device of this rank: ``cuda:<local rank>`` for a CUDA run, else ``device``."""
    if device is not None and torch.device(device).type != "cuda":
        return device
    if not torch.cuda.is_available():
        return device or "cpu"
    local = int(os.environ.get("LOCAL_RANK", world()[0]))
    return f"cuda:{local}"


def init_from_env(device_type: str) -> None:
    """Join the group described by torchrun's environment (``RANK``, ``WORLD_SIZE``, ...).

    On CUDA the rank's device is made current and passed as ``device_id``, so NCCL binds the
    communicator to it and initialises eagerly (not lazily inside the first collective, which
    may be running under CUDA-graph capture)."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return
    dist.init_process_group("gloo")


def shutdown() -> None:
    """Leave the process group, if any: a barrier (no rank tears down its communicator while
    another still uses it), then ``destroy_process_group``. Without it, ranks that exit on their
    own were seen to abort at interpreter exit (gloo, "terminate called without an active
    exception") in about one run of ten."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def abandon() -> None:
    """Leave the process group without :func:`shutdown`'s barrier: for a rank that fails where
    the others do not (``simsd serve --tp``'s rank 0 refusing its address), which would wait in
    the barrier for ranks that never reach it. The launcher (or torchrun) ends the others."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, detach: bool = False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if detach:  # signals come from the launcher only (see spawn); its death ends the rank
        os.setpgrp()
        _end_with_parent()
    try:
        fn(*args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    # A finished rank leaves without the interpreter's teardown: gloo's communicator threads,
    # destroyed by C++ static destructors at exit, were seen to abort ("terminate called without
    # an active exception") after correct output. Errors still propagate (raised above).
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _end_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent dies (Linux ``prctl``; elsewhere
    nothing)."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(fn, world_size: int, *args, forward_signals: bool = False) -> None:
    """Run ``fn(*args)`` in ``world_size`` fresh processes with torchrun-like environments.

    ``forward_signals`` (``simsd serve --tp``): the ranks run in their own process group, so a
    terminal's Ctrl-C reaches only this launcher, which passes SIGINT and SIGTERM on to rank 0
    (the server: it drains, then stops the others); a rank whose launcher dies gets SIGTERM.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank failed (the others are then
            terminated: SIGTERM, SIGKILL 30 s later).
    """
    import signal

    import torch.multiprocessing as mp
    ctx = mp.start_processes(_worker, args=(world_size, free_port(), fn, args, forward_signals), nprocs=world_size,
                             join=False, start_method="spawn")
    saved = {}
    if forward_signals:
        def forward(sig, frame):
            try:
                os.kill(ctx.processes[0].pid, sig)
            except ProcessLookupError:
                pass
        saved = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not ctx.join():
            pass
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
