"""The decoding engine over a shared KV page pool (``BatchEngine(page_size, num_pages)``,
:mod:`simsd.engine.pages`): pages of one block taken as the rows grow (so a row's pages interleave
with its neighbours'), returned when they end. It gives the tokens of the contiguous caches (one
region per row) -- vanilla and exact SimSD, greedy and seeded sampling, float32 and bfloat16 --
and exact SimSD over pages gives vanilla's tokens; with a pool too small for every row at once,
rows are preempted and start over, with the same tokens.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint
from simsd.decoding import vanilla
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.engine.batching import BatchEngine
from simsd.engine.pages import PagesExhausted
from simsd.speculative import SpecConfig, decoder, speculative_generate_batch
from tests.helpers import random_checkpoint

V = 96
BLOCK = 4
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 6)]


def ckpt(name, dtype, layers=2, seed=0, std=0.2):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=std)
    c = load_checkpoint(path, dtype=dtype, with_tokenizer=False)
    c.model.invariant = True
    return dataclasses.replace(c, stop_ids=[])


class Recorded(BatchEngine):
    """An engine over a pool that keeps every row's pages before each forward and the engines made."""
    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.snapshots, self.exhausted = [], 0
        Recorded.made.append(self)

    def reserve(self, name, reqs):
        try:
            super().reserve(name, reqs)
        except PagesExhausted:  # the scheduler preempts a row
            self.exhausted += 1
            raise
        self.snapshots.append([list(p) for p in self.caches[name].allocator.pages])


@pytest.fixture
def pool(monkeypatch):
    """``pool(num_pages)``: the batch decoders' engines get a shared pool of that many pages of one block."""
    Recorded.made = []

    def use(num_pages):
        engine = functools.partial(Recorded, page_size=BLOCK, num_pages=num_pages)
        monkeypatch.setattr(vanilla, "BatchEngine", engine)
        monkeypatch.setattr(decoder, "BatchEngine", engine)
        return Recorded.made
    return use


def decode(mode, target, draft, cfg):
    if mode == "vanilla":
        return [r.token_ids for r in vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id,
                                                            target.stop_ids).results]
    spec = SpecConfig(mode="exact")
    return [r.token_ids for r in speculative_generate_batch(target, draft, PROMPTS, cfg, spec).results]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_caches_give_the_contiguous_tokens_and_exact_equals_vanilla(dtype, temperature, pool):
    target, draft = ckpt("target", dtype), ckpt("target", dtype, std=0.22)
    sampling = SamplingParams(temperature=temperature) if temperature else SamplingParams()
    cfg = DecodeConfig(block_length=BLOCK, strategy="static", max_new_tokens=12, seed=3, sampling=sampling)
    want = {m: decode(m, target, draft, cfg) for m in ("vanilla", "exact")}
    made = pool(200)
    got = {m: decode(m, target, draft, cfg) for m in ("vanilla", "exact")}
    assert len(made) == 2 and all(c.page_size == BLOCK and c.shared for e in made for c in e.caches.values())
    rows = [pages for e in made for snap in e.snapshots for pages in snap]
    assert any(p != list(range(p[0], p[0] + len(p))) for p in rows if p)  # interleaved: not consecutive
    assert all(e.exhausted == 0 for e in made)
    assert got == want
    assert got["exact"] == got["vanilla"]
    for e in made:  # every page back in the pool
        assert all(c.allocator.free_pages == 200 for c in e.caches.values())


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_pool_too_small_for_every_row_preempts_and_gives_the_same_tokens(mode, temperature, pool):
    target, draft = ckpt("target", "float32"), ckpt("target", "float32", std=0.22)
    sampling = SamplingParams(temperature=temperature) if temperature else SamplingParams()
    cfg = DecodeConfig(block_length=BLOCK, strategy="static", max_new_tokens=24, seed=5, sampling=sampling)
    want = decode(mode, target, draft, cfg)
    pages = {"vanilla": 13, "exact": 18}[mode]  # a row needs 10 or 14 pages at most: two rarely fit at once
    made = pool(pages)
    got = decode(mode, target, draft, cfg)
    assert got == want
    assert made[0].exhausted > 0
    assert all(c.allocator.free_pages == pages for c in made[0].caches.values())


def test_admission_waits_for_pages_and_a_request_larger_than_the_pool_is_refused():
    from simsd.decoding.vanilla import VanillaRow
    from simsd.engine.scheduler import Request, Scheduler
    target = ckpt("target", "float32")
    cfg = DecodeConfig(block_length=BLOCK, strategy="static", max_new_tokens=8)
    # rows of 72 slots (18 pages), a pool of 12: a 20-token prompt and the margin (8) need 7, so one at a time
    engine = BatchEngine({"target": target.model}, BLOCK, 2, 64, 8, page_size=BLOCK, num_pages=12)
    sched = Scheduler(engine)
    with pytest.raises(ValueError, match=r"needs 14 KV pages of 4 tokens \(48 tokens and a forward's 8\), the pool "
                                         r"holds 12"):
        sched.submit(Request([5] * 16, None, capacity=48))
    reqs = [Request([5 + i] * 20, lambda row, tail: VanillaRow(row, cfg, target.mask_token_id, [], 0).program(tail),
                    capacity=32) for i in range(2)]
    for r in reqs:
        sched.submit(r)
    sched.step()
    assert sched.num_running == 1 and sched.num_waiting == 1  # a free row, but not the pages
    sched.run_until_idle()
    assert all(r.error is None and r.result for r in reqs)
    assert engine.pages.stats()["target"]["pages_free"] == 12


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_the_triton_door_over_a_pool_gives_the_contiguous_tokens(mode, pool):
    """The same engine over the Triton kernels (interpreted on the CPU): pages of one block taken
    as rows grow, a pool small enough to preempt, the tokens of the contiguous caches."""
    pytest.importorskip("triton")
    from simsd_kernels.backends import resolve_backend
    target, draft = ckpt("target", "float32"), ckpt("target", "float32", std=0.22)
    try:
        resolve_backend("triton", target.model.device)
    except ValueError as exc:
        pytest.skip(str(exc))
    target.model.attention_backend = draft.model.attention_backend = "triton"
    cfg = DecodeConfig(block_length=BLOCK, strategy="static", max_new_tokens=12, seed=2,
                       sampling=SamplingParams(temperature=1.0))
    want = decode(mode, target, draft, cfg)
    made = pool({"vanilla": 9, "exact": 13}[mode])
    assert decode(mode, target, draft, cfg) == want
    assert made[0].exhausted > 0


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_graph_engines_over_a_pool_give_the_contiguous_tokens(mode, pool, monkeypatch):
    """CUDA-graph engines (the capture replaced by eager replay, as tests/simsd/engine/test_batch.py
    does) over a pool that preempts: every forward covers every row with static shapes, the rows'
    page tables change in place between replays, the tokens stay the contiguous caches'."""
    import simsd.engine.graphs
    monkeypatch.setattr(simsd.engine.graphs, "cuda_capture", simsd.engine.graphs.eager_capture)
    monkeypatch.setattr(simsd.engine.graphs, "check_graphable", lambda model: None)
    target, draft = ckpt("target", "float32"), ckpt("target", "float32", std=0.22)
    cfg = DecodeConfig(block_length=BLOCK, strategy="static", max_new_tokens=16, seed=4,
                       sampling=SamplingParams(temperature=1.0))
    want = decode(mode, target, draft, cfg)
    made = pool({"vanilla": 11, "exact": 15}[mode])
    if mode == "vanilla":
        got = vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, [], cuda_graphs=True)
    else:
        got = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode="exact"), cuda_graphs=True)
    assert [r.token_ids for r in got.results] == want
    assert made[0].graphs and made[0].graphs["target"].replays > 0 and made[0].exhausted > 0
