"""Memory a decoding run will allocate, estimated before anything is allocated, and the check
that it fits the device.

Parts (bytes, per device):

* **weights**: every parameter of the model (``lm_head`` counted once when tied; every expert
  of a mixture-of-experts layer and its router) x dtype size;
* **KV caches**: ``layers x 2 x batch x (capacity + margin) x kv_heads x head_dim x dtype size``
  per model, exactly what :class:`simsd.models.cache.KVCache` allocates; ``capacity`` is the
  longest prompt plus ``max_new_tokens`` rounded up to whole blocks plus one block, ``margin``
  the longest query a forward may carry (``(gamma + 2) x block_length`` for SimSD, ``2 x block_length`` vanilla);
* **workspace** of the largest forward (``margin`` query tokens per row): hidden states and
  MLP activations (a MoE layer: the top-k experts' activations and outputs of every token, the
  float32 router probabilities and weighted sum), float32 logits and the sampling step's copies
  of them, and for the torch reference attention (the CPU path) the dense mask, the scores and
  the key/value copies expanded to every query head over ``capacity + margin`` keys.

The check adds ``MARGIN`` (10 %) and ``RESERVE_BYTES`` for the runtime itself and compares
with the free memory of the device: ``MemAvailable`` of ``/proc/meminfo`` on the CPU (no check
where that file does not exist), ``torch.cuda.mem_get_info`` on a CUDA device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MARGIN = 1.10
RESERVE_BYTES = 256 << 20
GIB = 1 << 30


def dtype_bytes(dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty((), dtype=dtype).element_size()


def parameter_count(config) -> int:
    """Parameters of a model with ``config`` (:class:`simsd.models.config.ModelConfig`; a tied
    ``lm_head`` counted once)."""
    c = config
    H, I, V, D = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    attn = H * c.num_attention_heads * D * 2 + H * c.num_key_value_heads * D * 2 + 2 * D
    moe = c.num_experts * (3 * H * c.moe_intermediate_size + H)  # experts and router
    mlps = sum(moe if c.is_moe_layer(i) else 3 * H * I for i in range(c.num_hidden_layers))
    return V * H * (1 if c.tie_word_embeddings else 2) + c.num_hidden_layers * (attn + 2 * H) + mlps + H


def weight_bytes(config, dtype) -> int:
    """Bytes of the model's parameters in ``dtype``."""
    return parameter_count(config) * dtype_bytes(dtype)


def kv_cache_bytes(config, dtype, batch_size: int, max_len: int, kv_heads: int | None = None) -> int:
    """Bytes of one :class:`simsd.models.cache.KVCache` (``max_len`` = capacity + margin)."""
    kv = kv_heads or config.num_key_value_heads
    return 2 * config.num_hidden_layers * batch_size * max_len * kv * config.head_dim * dtype_bytes(dtype)


def workspace_bytes(config, dtype, batch_size: int, query_tokens: int, key_tokens: int,
                    dense_attention: bool) -> int:
    """Transient bytes of one forward of ``query_tokens`` per row over ``key_tokens`` keys."""
    c = config
    rows, Lq = batch_size, query_tokens
    b = dtype_bytes(dtype)
    width = max(c.hidden_size, c.num_attention_heads * c.head_dim)
    layers = range(c.num_hidden_layers)
    mlp = 3 * c.intermediate_size * b if not all(map(c.is_moe_layer, layers)) else 0  # per token
    if any(map(c.is_moe_layer, layers)):  # k experts' gate/up/act and outputs; float32 probs, outputs, sum
        K = c.num_experts_per_tok
        moe = K * (3 * c.moe_intermediate_size + c.hidden_size) * b + (2 * c.num_experts + K * c.hidden_size) * 4
        mlp = max(mlp, moe)
    hidden = 8 * rows * Lq * width * b + rows * Lq * mlp
    logits = 5 * rows * Lq * c.vocab_size * 4  # float32 logits, masked copy, softmax, filtered probs, noise
    attn = 0
    if dense_attention:
        Lk = key_tokens
        attn = rows * Lq * Lk + rows * c.num_attention_heads * Lq * Lk * 4 \
            + 2 * rows * c.num_attention_heads * Lk * c.head_dim * b
    return hidden + logits + attn


@dataclass
class Estimate:
    """Bytes per part and device (see the module doc)."""
    parts: dict = field(default_factory=dict)  # device -> {"weights": n, "kv_caches": n, "workspace": n}

    def add(self, device, part: str, n: int) -> None:
        d = self.parts.setdefault(str(device), {"weights": 0, "kv_caches": 0, "workspace": 0})
        d[part] += int(n)

    def total(self, device) -> int:
        return sum(self.parts.get(str(device), {}).values())

    def needed(self, device) -> int:
        """With the safety margin and the runtime reserve."""
        return int(self.total(device) * MARGIN) + RESERVE_BYTES

    def describe(self, device) -> str:
        p = self.parts[str(device)]
        return (f"about {fmt_bytes(self.needed(device))} on {device} (weights {fmt_bytes(p['weights'])}, KV caches "
                f"{fmt_bytes(p['kv_caches'])}, workspace {fmt_bytes(p['workspace'])}, with a "
                f"{round((MARGIN - 1) * 100)}% margin)")


def fmt_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches (bytes, KiB, MiB, GiB), with two
    decimals below 100 of it: a small amount never reads as ``0.00 GiB``."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if n < 100 * size else f"{n / size:.0f} {unit}"
    return f"{int(n)} bytes"


def estimate(models: dict, batch_size: int, capacity: int, margin: int, with_weights: bool = True,
             pool_tokens: int | None = None) -> Estimate:
    """Bytes a run allocates: ``models`` maps a name to ``(config, dtype, device, dense_attention)``
    (``dense_attention``: the torch reference attention, which builds dense masks and scores);
    ``capacity`` and ``margin`` as in :class:`simsd.engine.batching.BatchEngine`; ``pool_tokens``:
    the slots of a shared page pool per model (its pages, the scratch page included, times the
    page size) instead of ``batch_size x (capacity + margin)``."""
    est = Estimate()
    for config, dtype, device, dense in models.values():
        if with_weights:
            est.add(device, "weights", weight_bytes(config, dtype))
        if pool_tokens is None:
            est.add(device, "kv_caches", kv_cache_bytes(config, dtype, batch_size, capacity + margin))
        else:
            est.add(device, "kv_caches", kv_cache_bytes(config, dtype, 1, pool_tokens))
        est.add(device, "workspace", workspace_bytes(config, dtype, batch_size, margin, capacity + margin, dense))
    return est


def available_bytes(device) -> int | None:
    """Free memory of ``device`` in bytes (CPU: ``MemAvailable``; CUDA: free device memory), or
    None where it cannot be known."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)  # plus what torch's caching allocator holds unused
        return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return meminfo("MemAvailable")


def total_bytes(device) -> int | None:
    """The total memory of ``device`` in bytes (CPU: ``MemTotal``; CUDA: the device's), or None
    where it cannot be known."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return meminfo("MemTotal")


def meminfo(field: str) -> int | None:
    """A ``/proc/meminfo`` field in bytes (``MemAvailable``, ``MemTotal``), or None where that
    file or field does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def shortfall(est: Estimate) -> tuple | None:
    """``(device, needed, available)`` of the first device the estimate does not fit, or None."""
    for device in est.parts:
        free = available_bytes(device)
        if free is not None and est.needed(device) > free:
            return device, est.needed(device), free
    return None


def largest_fitting(fits, low: int, high: int) -> int | None:
    """The largest ``n`` in ``[low, high]`` with ``fits(n)`` (assumed monotone), or None."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _dense(model) -> bool:
    """Whether ``model``'s attention holds dense scores (not a fused backend: the torch reference)."""
    try:
        return not model.attention_backend_class().fused
    except ValueError:  # an unavailable backend fails at its first forward; count the dense reference
        return True


def check_engine_memory(models: dict, batch_size: int, capacity: int, margin: int,
                        pool_tokens: int | None = None) -> None:
    """Before a :class:`simsd.engine.batching.BatchEngine` allocates its caches: ``ValueError``
    (one line: the estimate, the free memory and the largest batch size that fits) when the
    caches and the workspace of the largest forward do not fit a device's free memory (the
    models' weights are loaded already, so they are not counted again); ``pool_tokens``: a shared
    pool's slots per model (:func:`estimate`)."""
    import dataclasses

    def parts(n: int) -> Estimate:
        return estimate({name: (dataclasses.replace(m.config, num_key_value_heads=m.num_local_kv_heads)
                                if hasattr(m, "num_local_kv_heads") else m.config, m.dtype, m.device, _dense(m))
                         for name, m in models.items()}, n, capacity, margin, with_weights=False,
                        pool_tokens=pool_tokens)

    est = parts(batch_size)
    short = shortfall(est)
    if short is None:
        return
    device, needed, free = short
    best = largest_fitting(lambda n: shortfall(parts(n)) is None, 1, batch_size - 1)
    hint = f"; the largest batch size that fits is {best}" if best else ""
    raise ValueError(f"the KV caches and forward workspace of {batch_size} row(s) x {capacity + margin} tokens need "
                     f"{est.describe(device)} but {fmt_bytes(free)} are free{hint}")
