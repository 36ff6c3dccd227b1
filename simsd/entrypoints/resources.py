"""Will a run fit? The memory of a whole run (weights, KV caches, verify workspaces; see
:mod:`simsd.engine.memory`) estimated from the settings and the prompts' lengths, before any
weight is loaded, and the largest settings that would fit when it does not."""
from __future__ import annotations

from dataclasses import dataclass

from ..config.speculative import is_self_draft, max_query_blocks
from ..config.vocabulary import ParamError, opt
from ..engine.memory import Estimate, estimate, fmt_bytes, largest_fitting, shortfall, weight_bytes


@dataclass
class RunShape:
    """What the memory of a run depends on. ``models``: name -> ``(config, dtype, device,
    dense_attention)`` (``target``, and ``draft`` when a speculative mode runs); ``gamma``
    None = the block length; ``modes``: one :class:`~simsd.entrypoints.run_modes.RunMode` per
    engine of the run (its ``draft``: ``"self"`` or None, a draft model); ``width``: the
    self-speculative ``speculation_width``."""
    models: dict
    prompt_lengths: list
    max_new_tokens: int
    block_length: int
    gamma: int | None
    batch_size: int
    modes: list
    width: object = "auto"


def capacity_of(prompt_lengths, max_new_tokens: int, block_length: int) -> int:
    """Cache tokens a row needs (as :func:`simsd.decoding.config.check_prompt` computes them)."""
    return max(-(-(p + max_new_tokens) // block_length) * block_length + block_length for p in prompt_lengths)


def run_estimate(shape: RunShape, **change) -> Estimate:
    """The bytes per device of a run with ``shape`` (fields replaced by ``change``)."""
    s = RunShape(**{**shape.__dict__, **change})
    block_length = s.block_length
    gamma = min(s.gamma or block_length, block_length)
    capacity = capacity_of(s.prompt_lengths, s.max_new_tokens, block_length)
    total = Estimate()
    for name, (config, dtype, device, _) in s.models.items():
        total.add(device, "weights", weight_bytes(config, dtype))
    for rm in s.modes:  # one engine per mode, side by side (simsd bench); one forward at a time
        own = rm.mode != "vanilla" and not is_self_draft(rm.draft)  # a draft model of its own
        names = ["target", "draft"] if own else ["target"]
        margin = max_query_blocks(rm.mode, gamma, is_self_draft(rm.draft), s.width) * block_length
        est = estimate({n: s.models[n] for n in names if n in s.models}, s.batch_size, capacity, margin,
                       with_weights=False)
        for device, parts in est.parts.items():
            have = total.parts[device]
            have["kv_caches"] += parts["kv_caches"]
            have["workspace"] = max(have["workspace"], parts["workspace"])
    return total


def check_run_memory(shape: RunShape) -> Estimate:
    """:class:`ParamError` (one line: the estimate, the free memory and the largest block length,
    gamma, batch size and max_tokens that would fit, each with the others unchanged) when the
    run does not fit a device; returns the estimate otherwise."""
    est = run_estimate(shape)
    short = shortfall(est)
    if short is None:
        return est
    device, _, free = short

    def fits(**change) -> bool:
        return shortfall(run_estimate(shape, **change)) is None

    hints = []
    gamma = shape.gamma or shape.block_length
    knobs = [("block_length", shape.block_length, lambda v: fits(block_length=v))]
    if any(m != "vanilla" for m in shape.modes):
        knobs.append(("gamma", gamma, lambda v: fits(gamma=v)))
    knobs += [("batch_size", shape.batch_size, lambda v: fits(batch_size=v)),
              ("max_tokens", shape.max_new_tokens, lambda v: fits(max_new_tokens=v))]
    for attr, value, ok in knobs:
        if value > 1:
            best = largest_fitting(ok, 1, value - 1)
            if best is not None:
                hints.append(f"{opt(attr)} {best}")
    hint = ("; it fits with " + " or ".join(hints) + (" (each alone)" if len(hints) > 1 else "")) if hints else \
        "; no smaller block length, gamma, batch size or max_tokens fits (a smaller model or dtype may)"
    raise ParamError("batch_size", f"this run needs {est.describe(device)} but {fmt_bytes(free)} are free{hint}")


@dataclass
class EngineSize:
    """The engine an :class:`~simsd.entrypoints.api.LLM` builds, sized before any weight loads:
    ``rows`` (``batch_size``, or fewer within ``kv_cache_memory``), ``capacity`` and ``margin``
    (tokens per row, as :class:`simsd.engine.batching.BatchEngine` takes them) and
    ``row_bytes`` (the KV caches of one row, every model); with ``page_size`` a shared pool of
    ``num_pages`` pages (every model's; ``page_bytes`` each, every model) instead of a region
    per row."""
    rows: int
    capacity: int
    margin: int
    row_bytes: int
    page_size: int | None = None
    num_pages: int | None = None
    page_bytes: int = 0

    @property
    def kv_cache_bytes(self) -> int:
        if self.num_pages is not None:
            return (self.num_pages + 1) * self.page_bytes  # the scratch page included
        return self.rows * self.row_bytes

    @property
    def pool_tokens(self) -> int | None:
        """A pool's slots per model (its pages and the scratch page), None without one."""
        return None if self.num_pages is None else (self.num_pages + 1) * self.page_size


def engine_models(config, infos: dict) -> dict:
    """``{role: (config, dtype, device, dense_attention)}`` of the models an LLM of ``config``
    (resolved by :func:`~simsd.entrypoints.builder.check_engine`) runs, as they will be once loaded:
    a loaded checkpoint keeps its dtype, device and backend; a tensor-parallel target caches its
    share of the KV heads."""
    import dataclasses

    import torch

    from simsd_kernels.backends import resolve_backend
    out = {}
    for role, device in (("target", config.device), ("draft", config.draft_device)):
        info = infos.get(role)
        if info is None:
            continue
        model = getattr(info, "model", None)
        dtype, backend = config.dtype, config.attention_backend or "auto"
        if model is not None:  # a loaded Checkpoint
            dtype, device = model.dtype, model.device
            backend = config.attention_backend or getattr(model, "attention_backend", "auto")
        cfg = info.config
        if role == "target" and config.tp > 1:
            cfg = dataclasses.replace(cfg, num_key_value_heads=cfg.num_key_value_heads // config.tp)
        try:
            dense = resolve_backend(backend, torch.device(device)).name == "torch"
        except ValueError:  # refused by check_engine already; count the dense reference
            dense = True
        out[role] = (cfg, dtype, str(device), dense)
    return out


def engine_size(config, infos: dict) -> EngineSize:
    """The rows, capacity and margin of the engine of ``config`` (see :class:`EngineSize`);
    :class:`ParamError` (``kv_cache_memory``) when ``kv_cache_memory`` holds no row."""
    from ..engine.batching import round_capacity
    from ..engine.memory import kv_cache_bytes
    block_length, L = config.block_length, config.max_model_len
    capacity = round_capacity(-(-L // block_length) * block_length + block_length)
    gamma = config.max_gamma or block_length
    margin = max_query_blocks(config.mode, gamma, is_self_draft(config.draft),
                              config.speculation_width) * block_length  # the longest query
    models = engine_models(config, infos)
    row_bytes = sum(kv_cache_bytes(cfg, dtype, 1, capacity + margin) for cfg, dtype, _, _ in models.values())
    rows, budget, name = config.batch_size, config.kv_cache_memory, "kv_cache_memory"
    if config.gpu_memory_utilization is not None:
        budget, name = kv_budget(config, models, rows, capacity, margin), "gpu_memory_utilization"
    # what the budget is, as the errors name it
    given = None if budget is None else (
        f"{opt(name)} {fmt_bytes(max(budget, 0))}" if name == "kv_cache_memory" else
        f"{opt(name)} {config.gpu_memory_utilization} leaves {fmt_bytes(max(budget, 0))}: it")
    if config.page_size is not None:
        ps = config.page_size
        per_row = -(-(capacity + margin) // ps)  # a row's pages at most
        page_bytes = sum(kv_cache_bytes(cfg, dtype, 1, ps) for cfg, dtype, _, _ in models.values())
        num_pages = rows * per_row if budget is None else int(budget // page_bytes) - 1  # less the scratch page
        if num_pages < per_row:
            raise ParamError(name, f"{given} holds {max(num_pages, 0)} KV pages of {ps} tokens "
                                   f"({fmt_bytes(page_bytes)} each), fewer than one request of {L} tokens needs "
                                   f"({per_row}); lower {opt('max_model_len')}")
        return EngineSize(rows, capacity, margin, row_bytes, ps, num_pages, page_bytes)
    if budget is not None:
        rows = min(rows, int(budget // row_bytes))
        if rows < 1:
            raise ParamError(name, f"{given} holds no row of {L} tokens ({fmt_bytes(row_bytes)} per row); lower "
                                   f"{opt('max_model_len')}")
    return EngineSize(rows, capacity, margin, row_bytes)


def kv_budget(config, models: dict, rows: int, capacity: int, margin: int) -> float:
    """The bytes ``gpu_memory_utilization`` leaves the KV caches on the target's device: that
    share of its total memory (:func:`simsd.engine.memory.total_bytes`) less the weights of the
    models on it, the workspace of the largest forward and the runtime's reserve."""
    from ..engine.memory import RESERVE_BYTES, total_bytes
    device = models["target"][2]
    total = total_bytes(device)
    if total is None:
        raise ParamError("gpu_memory_utilization", f"{opt('gpu_memory_utilization')}: the total memory of {device} "
                                                   f"is unknown here; give {opt('kv_cache_memory')}")
    rest = estimate(models, rows, capacity, margin, pool_tokens=0)  # weights and workspace, no KV
    return config.gpu_memory_utilization * total - rest.total(device) - RESERVE_BYTES


def llm_estimate(config, infos: dict, size: EngineSize) -> Estimate:
    """The bytes per device an LLM of ``config`` will allocate: the weights of the checkpoints
    not loaded yet (a loaded one's are in memory already), the KV caches of ``size.rows`` rows
    and the workspace of the largest forward."""
    models = engine_models(config, infos)
    total = estimate(models, size.rows, size.capacity, size.margin, with_weights=False, pool_tokens=size.pool_tokens)
    for role, (_, dtype, device, _) in models.items():
        if getattr(infos[role], "model", None) is None:
            total.add(device, "weights", weight_bytes(infos[role].config, dtype))  # whole, before any TP shard
    return total


def check_llm_memory(config, infos: dict, size: EngineSize) -> Estimate:
    """Before an LLM loads any weight: :class:`ParamError` (one line: the estimate, the free
    memory, and the largest ``batch_size`` or ``max_model_len`` that would fit, each with the
    other unchanged) when its weights, KV caches and workspace do not fit a device's free memory
    (:func:`simsd.engine.memory.shortfall`); returns the estimate otherwise."""
    import dataclasses
    est = llm_estimate(config, infos, size)
    short = shortfall(est)
    if short is None:
        return est
    device, _, free = short

    def fits(**change) -> bool:
        changed = dataclasses.replace(config, **change)
        try:
            return shortfall(llm_estimate(changed, infos, engine_size(changed, infos))) is None
        except ParamError:
            return False

    hints = []
    if size.rows > 1:
        best = largest_fitting(lambda n: fits(batch_size=n), 1, size.rows - 1)
        if best is not None:
            hints.append(f"{opt('batch_size')} {best}")
    if config.max_model_len > config.block_length + 1:
        best = largest_fitting(lambda n: fits(max_model_len=n), config.block_length + 1, config.max_model_len - 1)
        if best is not None:
            hints.append(f"{opt('max_model_len')} {best}")
    hint = ("; it fits with " + " or ".join(hints) + (" (each alone)" if len(hints) > 1 else "")) if hints else \
        "; no smaller batch size or max_model_len fits (a smaller model, dtype or another device may)"
    raise ParamError("batch_size", f"the models and the engine need {est.describe(device)} but {fmt_bytes(free)} "
                                   f"are free{hint}")
