"""Vanilla SDAR block decoding with one model (the baseline; DESIGN.md §3)."""
from __future__ import annotations

import torch

from .decoding import (DecodeConfig, GenerationResult, SequenceRunner, Timer, check_prompt, denoise_step,
                       finish)


def new_block(tail: list, block_length: int, mask_id: int, device) -> torch.Tensor:
    ids = list(tail) + [mask_id] * (block_length - len(tail))
    return torch.tensor(ids, dtype=torch.int64, device=device)


def vanilla_generate(model, prompt_ids: list, cfg: DecodeConfig, mask_id: int, stop_ids) -> GenerationResult:
    """Decode ``prompt_ids`` block by block with ``model``.

    Stops after a block that contains a stop id or once ``max_new_tokens`` are generated.
    ``stats``: ``mode, new_tokens, decode_seconds, tokens_per_second, target_forwards,
    prefill_forwards, blocks``; ``new_tokens`` counts returned tokens (up to and including the
    stop id); decode time excludes the prefill.

    Raises:
        ValueError: bad prompt ids, or a prompt too long for the model.
    """
    B = cfg.block_length
    capacity = check_prompt(prompt_ids, model.config, cfg.max_new_tokens, B)
    runner = SequenceRunner(model, B, capacity)
    generator = torch.Generator().manual_seed(cfg.seed)
    stops = set(stop_ids)
    tail = runner.prefill(prompt_ids)
    generated: list = []
    blocks = 0
    with Timer(model.device) as timer:
        while True:
            block = new_block(tail, B, mask_id, model.device)
            first_gen = len(tail)
            tail = []
            step = 0
            while bool((block == mask_id).any()):
                logits = runner.denoise_logits(block)
                block, _, _ = denoise_step(logits, block, mask_id, cfg, step, generator)
                step += 1
            blocks += 1
            new = block[first_gen:].tolist()
            generated.extend(new)
            if stops.intersection(new) or len(generated) >= cfg.max_new_tokens:
                break  # the last block's K/V is never read: no commit forward
            runner.commit(block, fold=cfg.fold_commit)
    token_ids = finish(generated, stop_ids, cfg.max_new_tokens)
    n = len(token_ids)
    stats = {
        "mode": "vanilla",
        "new_tokens": n,
        "decode_seconds": timer.seconds,
        "tokens_per_second": n / timer.seconds if timer.seconds > 0 else float("nan"),
        "target_forwards": runner.forwards,
        "target_forwards_per_token": runner.forwards / max(n, 1),
        "prefill_forwards": runner.prefill_forwards,
        "blocks": blocks,
    }
    return GenerationResult(token_ids, stats)
