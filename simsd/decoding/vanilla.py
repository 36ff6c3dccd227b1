"""Vanilla SDAR block decoding with one model (the baseline; docs/design.md §3)."""
from __future__ import annotations

from ..engine.batching import BatchEngine, round_capacity
from .config import BatchResult, DecodeConfig, GenerationResult, check_prompt
from .noise import NoiseKey
from .program import BlockState, RowProgram, generate_batch, row_seeds
from .step import Step


class VanillaRow(RowProgram):
    """One row's block decoding with the target alone (:class:`~simsd.decoding.program.RowProgram`).
    Step ``s`` of the block at absolute position ``start`` samples with the noise keyed
    ``NoiseKey(seed, start)`` and ``s`` (:mod:`simsd.decoding.noise`). One host read per step:
    the new block (the step's decision) with the non-finite-logits flags. The log-probabilities
    of a token (when asked for) are read from the logits of the step that revealed it."""

    def advance(self, blk: BlockState):
        step = Step(blk.block, blk.step, self.cfg, self.mask_id, NoiseKey(self.seed, blk.start),
                    keep_logits=blk.lp is not None, history=self.history)
        self.stepped(blk, (yield self.layouts.denoise("target", blk.block, step)))
        blk.host = self.read([blk.block], blk)
        blk.step += 1


def vanilla_generate_batch(model, prompts: list, cfg: DecodeConfig, mask_id: int, stop_ids,
                           first_index: int = 0, cuda_graphs: bool = False, seeds: list | None = None) -> BatchResult:
    """Decode ``prompts`` (lists of ids) together, each with independent progress.

    Row ``i`` samples with the stateless noise of :mod:`simsd.decoding.noise` under the row seed
    ``seeds[i]``, by default ``cfg.seed + first_index + i``, so prompt ``j`` of a prompt set
    decodes the same in any batch (and alone with ``seed + j``). Per-row
    ``stats`` are those of :func:`vanilla_generate` (forward counts are the row's own; its
    ``decode_seconds`` is the batch's), plus ``batch_size``. ``cuda_graphs``: replay the
    forwards as CUDA graphs (:mod:`simsd.engine.graphs`; token-identical to eager static shapes;
    captured per call: :class:`simsd.LLM` keeps its engine and graphs).

    Raises:
        ValueError: bad prompt ids (outside the vocabulary, the mask id), or a prompt too long
            for the model.
    """
    block_length = cfg.block_length
    capacities = [check_prompt(p, model.config, cfg.max_new_tokens, block_length, mask_id) for p in prompts]
    engine = BatchEngine({"target": model}, block_length, len(prompts), round_capacity(max(capacities)),
                         2 * block_length, cuda_graphs=cuda_graphs)
    seeds = row_seeds(cfg, len(prompts), first_index, seeds)
    return generate_batch(engine, prompts, capacities,
                          lambda row, i: VanillaRow(row, cfg, mask_id, stop_ids, seeds[i]))


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
