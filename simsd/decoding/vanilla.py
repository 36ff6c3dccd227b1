"""Vanilla SDAR block decoding with one model (the baseline; docs/design.md §3)."""
from __future__ import annotations

import torch

from ..engine.batching import BatchResult, Row, engine_for
from ..engine.host_sync import to_device
from .config import DecodeConfig, GenerationResult, Timer, check_prompt, finish
from .noise import NoiseKey
from .step import Step


def new_block(tail: list, block_length: int, mask_id: int, device) -> torch.Tensor:
    """A fresh block ``(block_length,)``: the prompt ``tail`` then MASK (copied asynchronously)."""
    return to_device(list(tail) + [mask_id] * (block_length - len(tail)), device)


def vanilla_program(row: Row, tail: list, cfg: DecodeConfig, mask_id: int, stop_ids, seed: int, on_block=None):
    """One row's block decoding as a :mod:`simsd.engine.batching` program; returns ``(generated, blocks)``.
    Step ``s`` of the block at absolute position ``start`` samples with the noise keyed
    ``NoiseKey(seed, start)`` and ``s`` (:mod:`simsd.decoding.noise`). One host read per step:
    the new block (the step's decision).

    ``on_block(new_ids) -> bool``: called with the generated ids of each finished block (the
    tokens are final from then on; streaming reads them here); returning True ends the
    generation after that block (e.g. a stop string was found)."""
    block_length = cfg.block_length
    stops = set(stop_ids)
    generated: list = []
    blocks = 0
    while True:
        block = new_block(tail, block_length, mask_id, row.devices["target"])
        key = NoiseKey(seed, row.start("target"))
        block_host = list(tail) + [mask_id] * (block_length - len(tail))
        first_gen = len(tail)
        tail = []
        step = 0
        while mask_id in block_host:
            masks = block_host.count(mask_id)
            block, _, _ = yield row.denoise("target", block, Step(block, step, cfg, mask_id, key))
            block_host = block.tolist()
            if block_host.count(mask_id) >= masks:  # a step reveals at least one position
                raise RuntimeError(f"row {row.index}: denoising step {step} of block {blocks} revealed no position "
                                   f"({masks} MASK left): decoding would not progress")
            step += 1
        blocks += 1
        new = block_host[first_gen:]
        generated.extend(new)
        if on_block is not None and on_block(new):
            return generated, blocks
        if stops.intersection(new) or len(generated) >= cfg.max_new_tokens:
            return generated, blocks  # the last block's K/V is never read: no commit forward
        fwd = row.commit("target", block, fold=cfg.fold_commit)
        if fwd is not None:
            yield fwd


def row_seeds(cfg: DecodeConfig, n: int, first_index: int = 0, seeds: list | None = None) -> list:
    """The seeds of ``n`` rows: ``seeds`` when given (one per row), else ``cfg.seed + first_index + i``.

    Raises:
        ValueError: ``seeds`` of another length than ``n``."""
    if seeds is None:
        return [cfg.seed + first_index + i for i in range(n)]
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} prompts")
    return list(seeds)


def vanilla_generate_batch(model, prompts: list, cfg: DecodeConfig, mask_id: int, stop_ids,
                           first_index: int = 0, cuda_graphs: bool = False, seeds: list | None = None) -> BatchResult:
    """Decode ``prompts`` (lists of ids) together, each with independent progress.

    Row ``i`` samples with the stateless noise of :mod:`simsd.decoding.noise` under the row seed
    ``seeds[i]``, by default ``cfg.seed + first_index + i``, so prompt ``j`` of a prompt set
    decodes the same in any batch (and alone with ``seed + j``). Per-row
    ``stats`` are those of :func:`vanilla_generate` (forward counts are the row's own; its
    ``decode_seconds`` is the batch's), plus ``batch_size``. ``cuda_graphs``: replay the
    forwards as CUDA graphs (:mod:`simsd.engine.graphs`; token-identical to eager static shapes).

    Raises:
        ValueError: bad prompt ids (outside the vocabulary, the mask id), or a prompt too long
            for the model.
    """
    block_length = cfg.block_length
    capacity = max(check_prompt(p, model.config, cfg.max_new_tokens, block_length, mask_id) for p in prompts)
    engine = engine_for({"target": model}, block_length, len(prompts), capacity, 2 * block_length, cuda_graphs)
    tails = [engine.prefill(i, p) for i, p in enumerate(prompts)]
    seeds = row_seeds(cfg, len(prompts), first_index, seeds)
    programs = [vanilla_program(engine.rows[i], tails[i], cfg, mask_id, stop_ids, seeds[i])
                for i in range(len(prompts))]
    with Timer(model.device) as timer:
        outs = engine.run(programs)
    results = []
    for row, (generated, blocks) in zip(engine.rows, outs):
        token_ids = finish(generated, stop_ids, cfg.max_new_tokens)
        stats = vanilla_stats(row, len(token_ids), blocks, timer.seconds, len(generated) - len(token_ids))
        stats["batch_size"] = len(prompts)
        results.append(GenerationResult(token_ids, stats))
    return BatchResult(results, batch_stats(results, timer.seconds, engine.forwards))


def vanilla_stats(row: Row, n: int, blocks: int, seconds: float, cut_tokens: int = 0) -> dict:
    """A row's statistics after ``n`` returned tokens and ``blocks`` blocks in ``seconds`` of
    decoding (see :func:`vanilla_generate`); ``cut_tokens``: tokens decoded after a stop or past
    the budget, not returned."""
    return {
        "mode": "vanilla",
        "new_tokens": n,
        "cut_tokens": cut_tokens,
        "decode_seconds": seconds,
        "tokens_per_second": n / seconds if seconds > 0 else float("nan"),
        "target_forwards": row.forwards["target"],
        "target_forwards_per_token": row.forwards["target"] / max(n, 1),
        "prefill_forwards": row.prefill_forwards,
        "blocks": blocks,
    }


def batch_stats(results: list, seconds: float, forwards: dict) -> dict:
    n = sum(r.stats["new_tokens"] for r in results)
    return {"batch_size": len(results), "new_tokens": n, "decode_seconds": seconds,
            "tokens_per_second": n / seconds if seconds > 0 else float("nan"),
            "batched_forwards": dict(forwards)}


def vanilla_generate(model, prompt_ids: list, cfg: DecodeConfig, mask_id: int, stop_ids) -> GenerationResult:
    """Decode ``prompt_ids`` block by block with ``model``.

    Stops after a block that contains a stop id or once ``max_new_tokens`` are generated.
    ``stats``: ``mode, new_tokens, cut_tokens, decode_seconds, tokens_per_second, target_forwards,
    prefill_forwards, blocks``; ``new_tokens`` counts returned tokens (up to and including the
    stop id), ``cut_tokens`` the tokens decoded in the last block after the stop id or past
    ``max_new_tokens`` (not returned); decode time excludes the prefill.

    Raises:
        ValueError: bad prompt ids, or a prompt too long for the model.
    """
    return vanilla_generate_batch(model, [prompt_ids], cfg, mask_id, stop_ids).results[0]
