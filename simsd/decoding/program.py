"""A request's decoding as an engine program, and the batch decoders' driver (docs/design.md §6).

:class:`RowProgram` is one request on one engine row: :meth:`RowProgram.program` is the
generator the :class:`~simsd.engine.scheduler.Scheduler` drives (it yields forward requests
and receives logits or step results), block by block: fill the block (:meth:`advance`, a
denoising step in vanilla decoding, a SimSD round in :mod:`simsd.speculative`), hand the
finished block to the caller, stop or commit it. Its statistics are built in one place
(:meth:`RowProgram.stats_for`), for the batch decoders and the Python API alike.

:func:`generate_batch` runs one program per prompt through a scheduler on the calling thread
(the batch decoders: :func:`simsd.decoding.vanilla.vanilla_generate_batch`,
:func:`simsd.speculative.speculative_generate_batch`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.batching import BatchEngine, Row
from ..engine.host_sync import to_device
from ..engine.scheduler import Request, decode_span, run_requests
from .config import BatchResult, DecodeConfig, GenerationResult, finish
from .layouts import RowLayouts
from .logprobs import BlockLogprobs
from .penalties import TokenHistory


@dataclass
class BlockState:
    """The block a row decodes: ``block (L,)`` on the target's device and ``host``, its host
    copy; ``start``: the absolute position of its first token (the noise keys); ``first``: the
    index of its first generated token (after the prompt tail); ``step``: denoising steps taken
    in the block so far (a SimSD round takes several); ``lp``: the log-probabilities of its
    revealed tokens when the request asks for them (:class:`~simsd.decoding.logprobs.BlockLogprobs`), else None."""
    block: torch.Tensor
    host: list
    start: int
    first: int
    step: int = 0
    lp: BlockLogprobs | None = None


class RowProgram:
    """One request's block decoding on engine row ``row`` (vanilla: :class:`simsd.decoding.vanilla.VanillaRow`;
    SimSD: :class:`simsd.speculative.spec_row.SpecRow`).

    Args:
        row: the engine :class:`~simsd.engine.batching.Row`.
        cfg: the decoding settings; ``mask_id``: the MASK token id.
        stop_ids: generation ends after a block that holds one of these.
        seed: the row seed of the keyed sampling noise (:mod:`simsd.decoding.noise`).

    ``generated``: the decoded ids so far (whole blocks, before any cut); ``blocks``: blocks
    finished; ``history``: the :class:`~simsd.decoding.penalties.TokenHistory` before the current
    block when the request has penalties (None otherwise), which its steps carry; ``logprobs``:
    with ``cfg.logprobs``, one entry per id of ``generated`` (:mod:`simsd.decoding.logprobs`; set
    before ``on_block`` sees the block), else None.
    Subclasses define :meth:`advance` (one step of the block) and may extend
    :meth:`commit`, :meth:`finish_block` and :meth:`stats_for`.
    """
    mode = "vanilla"
    #: what :meth:`advance` is called in the no-progress error, and what it failed to do
    progress = ("denoising step", "revealed no position")

    def __init__(self, row: Row, cfg: DecodeConfig, mask_id: int, stop_ids, seed: int):
        self.row, self.cfg, self.mask_id, self.seed = row, cfg, mask_id, seed
        self.layouts = RowLayouts(row)
        self.stop_ids = list(stop_ids)
        self.generated: list = []
        row.output = self.generated  # the engine offers the committed output's pages to a prefix cache
        self.logprobs: list | None = None if cfg.logprobs is None else []
        self.blocks = 0
        self.history = None

    def program(self, tail: list, on_block=None):
        """The row's decoding as a :mod:`simsd.engine.batching` program; returns ``generated``.

        ``tail``: the prompt tail after the block-aligned prefill (it opens the first block).
        ``on_block(new_ids) -> bool``: called with the generated ids of each finished block (the
        tokens are final from then on; streaming reads them here); returning True ends the
        generation after that block (e.g. a stop string was found).

        Raises:
            RuntimeError: a step (or round) that changes nothing: decoding would not progress.
        """
        if self.cfg.sampling.penalized:
            self.history = TokenHistory.start(self.row.prompt, len(tail), self.cfg.block_length, self.mask_id,
                                              self.row.devices["target"])
        while True:
            blk = self.new_block(tail)
            tail = []
            while self.mask_id in blk.host:
                masks, step = blk.host.count(self.mask_id), blk.step
                yield from self.advance(blk)
                if blk.host.count(self.mask_id) >= masks:  # a step reveals at least one position
                    what, failed = self.progress
                    raise RuntimeError(f"row {self.row.index}: the {what} at block step {step} of block "
                                       f"{self.blocks} {failed} ({masks} MASK left): decoding would not progress")
            new = blk.host[blk.first:]
            done = self.ends(new)
            self.generated.extend(new)
            if blk.lp is not None:
                self.logprobs.extend(blk.lp.read(blk.first))
            self.blocks += 1
            self.finish_block(blk)
            if (on_block is not None and on_block(new)) or done:
                return self.generated  # the last block's K/V is never read: no commit forward
            if self.history is not None:
                self.history = self.history.after(blk.block)
            yield from self.commit(blk)

    def new_block(self, tail: list) -> BlockState:
        """A fresh block: the prompt ``tail`` then MASK (copied to the device asynchronously)."""
        host = list(tail) + [self.mask_id] * (self.cfg.block_length - len(tail))
        return BlockState(to_device(host, self.row.devices["target"]), host, self.layouts.start("target"), len(tail),
                          lp=self.block_logprobs())

    def block_logprobs(self) -> BlockLogprobs | None:
        """A new block's log-probability record (None when the request asks for none)."""
        if self.cfg.logprobs is None:
            return None
        return BlockLogprobs(self.cfg.logprobs, self.cfg.block_length, self.row.devices["target"])

    def stepped(self, blk: BlockState, out: tuple) -> None:
        """Take the result ``out`` of a target :class:`~simsd.decoding.step.Step` on ``blk``
        (``keep_logits`` set when the block records log-probabilities): the new block, and the
        log-probabilities of the tokens it revealed."""
        if blk.lp is not None:
            blk.lp.note(out[3], out[0], out[1])
        blk.block = out[0]

    def ends(self, new: list) -> bool:
        """Whether the block whose generated ids are ``new`` ends the generation (a stop id, or
        the token budget reached), before ``new`` is added."""
        return bool(set(self.stop_ids).intersection(new)) or len(self.generated) + len(new) >= self.cfg.max_new_tokens

    def advance(self, blk: BlockState):
        """One step of the block (a generator of forward requests): updates ``blk``."""
        raise NotImplementedError

    def read(self, parts: list, blk: BlockState) -> list:
        """``parts`` (1-D int64 device tensors: the row's decision) on the host, concatenated, read
        together with the row's non-finite-logits flags (one concatenation, one host read).

        Raises:
            NonFiniteLogits: a forward of the target or the draft gave this row non-finite
                logits (:meth:`simsd.engine.batching.Row.check_finite`).
        """
        host = torch.cat([*parts, self.row.nonfinite_flags(parts[0].device)]).tolist()
        n = sum(p.shape[0] for p in parts)
        self.row.check_finite(host[n:], self.blocks, blk.step)
        return host[:n]

    def finish_block(self, blk: BlockState) -> None:
        """Bookkeeping of a finished block (nothing here)."""

    def commit(self, blk: BlockState):
        """The finished block's commit forward (folded into the next request with ``fold_commit``)."""
        fwd = self.layouts.commit("target", blk.block, fold=self.cfg.fold_commit)
        if fwd is not None:
            yield fwd

    def token_ids(self) -> list:
        """The generated ids cut after the first stop id and at ``max_new_tokens``."""
        return finish(self.generated, self.stop_ids, self.cfg.max_new_tokens)

    def token_logprobs(self, n: int) -> list | None:
        """The log-probability entries of the first ``n`` generated ids (None: not asked for)."""
        return None if self.logprobs is None else self.logprobs[:n]

    def stats_for(self, n: int, seconds: float) -> dict:
        """The row's statistics after ``n`` returned tokens in ``seconds`` of decoding (docs/statistics.md,
        "Statistics"): ``mode, new_tokens, cut_tokens`` (decoded after a stop or past the budget,
        not returned), ``decode_seconds, tokens_per_second, target_forwards,
        target_forwards_per_token, target_query_tokens_per_forward`` (the row's own query tokens
        per target forward: the forward's width, padding excluded), ``prefill_forwards,
        cached_prompt_tokens`` (found in the prefix cache, not prefilled), ``blocks``."""
        fw = self.row.forwards["target"]
        return {
            "mode": self.mode,
            "new_tokens": n,
            "cut_tokens": len(self.generated) - n,
            "decode_seconds": seconds,
            "tokens_per_second": n / seconds if seconds > 0 else float("nan"),
            "target_forwards": fw,
            "target_forwards_per_token": fw / max(n, 1),
            "target_query_tokens_per_forward": self.row.query_tokens["target"] / max(fw, 1),
            "prefill_forwards": self.row.prefill_forwards,
            "cached_prompt_tokens": self.row.prefix_hit,
            "blocks": self.blocks,
        }


def row_seeds(cfg: DecodeConfig, n: int, first_index: int = 0, seeds: list | None = None) -> list:
    """The seeds of ``n`` rows: ``seeds`` when given (one per row), else ``cfg.seed + first_index + i``.

    Raises:
        ValueError: ``seeds`` of another length than ``n``."""
    if seeds is None:
        return [cfg.seed + first_index + i for i in range(n)]
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} prompts")
    return list(seeds)


def batch_stats(results: list, seconds: float, forwards: dict) -> dict:
    n = sum(r.stats["new_tokens"] for r in results)
    return {"batch_size": len(results), "new_tokens": n, "decode_seconds": seconds,
            "tokens_per_second": n / seconds if seconds > 0 else float("nan"),
            "batched_forwards": dict(forwards)}


def generate_batch(engine: BatchEngine, prompts: list, capacities: list, new_program) -> BatchResult:
    """Decode ``prompts`` on ``engine`` (one row each), through a scheduler on this thread.

    ``new_program(row, i) -> RowProgram``: prompt ``i``'s program on engine row ``row``;
    ``capacities[i]``: the cache tokens prompt ``i`` needs. Every row's ``decode_seconds`` is
    the batch's (the scheduler's decode clock: prefills excluded).

    Raises:
        the first failed row's exception (e.g. ``RuntimeError`` for a program that makes no
        progress), after every row has ended.
    """
    programs: list = [None] * len(prompts)

    def starter(i: int):
        def start(row: Row, tail: list):
            programs[i] = new_program(row, i)
            return programs[i].program(tail)
        return start

    requests = [Request(p, starter(i), c) for i, (p, c) in enumerate(zip(prompts, capacities))]
    run_requests(engine, requests)
    seconds = decode_span(requests)
    results = []
    for prog in programs:
        token_ids = prog.token_ids()
        stats = prog.stats_for(len(token_ids), seconds)
        stats["batch_size"] = len(prompts)
        results.append(GenerationResult(token_ids, stats, logprobs=prog.token_logprobs(len(token_ids))))
    return BatchResult(results, batch_stats(results, seconds, engine.forwards))
