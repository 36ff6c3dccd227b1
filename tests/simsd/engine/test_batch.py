"""Batched decoding: a batch of N prompts equals N single runs, in every mode (docs/design.md §6)."""
import dataclasses

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint, vanilla_generate
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.models.cache import KVCache
from simsd.models.model import labels_for
from simsd.speculative import SpecConfig, speculative_generate, speculative_generate_batch
from tests.helpers import random_checkpoint

V = 96
# lengths: shorter than a block, multiples of B, and not
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 8, 13, 6)]


def ckpt(name, layers=2, seed=0):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2)
    return load_checkpoint(path, dtype="float64", with_tokenizer=False)


@pytest.fixture(scope="module")
def pair():
    return ckpt("target"), ckpt("poor-draft", layers=1, seed=11)


def with_stop(c, decode):
    """``c`` with a stop id taken from prompt 1's free output, so that rows stop at different points."""
    free = decode(c, PROMPTS[1])
    return dataclasses.replace(c, stop_ids=[free[5]])


def single(mode, target, draft, prompt, cfg, spec):
    if mode == "vanilla":
        return vanilla_generate(target.model, prompt, cfg, target.mask_token_id, target.stop_ids)
    return speculative_generate(target, draft, prompt, cfg, spec)


def batch(mode, target, draft, prompts, cfg, spec):
    if mode == "vanilla":
        return vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id, target.stop_ids)
    return speculative_generate_batch(target, draft, prompts, cfg, spec)


COUNTERS = ("new_tokens", "target_forwards", "draft_forwards", "blocks", "proposed", "accepted", "rounds",
            "fallback_steps", "prefill_forwards")


@pytest.mark.parametrize("mode,on_reject,fold", [("vanilla", "redraft", False), ("vanilla", "redraft", True),
                                                 ("paper", "redraft", False), ("paper", "fallback", False),
                                                 ("exact", "redraft", False), ("exact", "redraft", True),
                                                 ("paper", "redraft", True)])
def test_greedy_batch_equals_single_runs(pair, mode, on_reject, fold):
    target, draft = pair
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=14, fold_commit=fold)
    spec = SpecConfig(mode=mode if mode != "vanilla" else "exact", on_reject=on_reject)
    target = with_stop(target, lambda c, p: single(mode, c, draft, p, cfg, spec).token_ids)
    singles = [single(mode, target, draft, p, cfg, spec) for p in PROMPTS]
    got = batch(mode, target, draft, PROMPTS, cfg, spec)
    assert [r.token_ids for r in got.results] == [r.token_ids for r in singles]
    assert len({len(r.token_ids) for r in singles}) > 1  # rows stop at different points
    for b, s in zip(got.results, singles):
        assert {k: b.stats.get(k) for k in COUNTERS} == {k: s.stats.get(k) for k in COUNTERS}
    assert got.stats["new_tokens"] == sum(len(r.token_ids) for r in singles)
    # batching shares forwards between rows
    assert got.stats["batched_forwards"]["target"] < sum(s.stats["target_forwards"] for s in singles)


@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_sampling_batch_equals_seeded_single_runs(pair, mode):
    target, draft = pair
    cfg = DecodeConfig(block_length=4, max_new_tokens=10, seed=5, sampling=SamplingParams(temperature=4.0, top_k=40))
    spec = SpecConfig(mode=mode if mode != "vanilla" else "exact")
    got = batch(mode, target, draft, PROMPTS[:3], cfg, spec)
    for i, p in enumerate(PROMPTS[:3]):
        want = single(mode, target, draft, p, dataclasses.replace(cfg, seed=cfg.seed + i), spec)
        assert got.results[i].token_ids == want.token_ids
    # the rows do not share a random stream: the same prompt in two rows samples differently
    twice = batch(mode, target, draft, [PROMPTS[2], PROMPTS[2]], cfg, spec)
    assert twice.results[0].token_ids != twice.results[1].token_ids


def test_exact_batch_equals_vanilla_target(pair):
    target, draft = pair
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=12)
    want = vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, target.stop_ids)
    got = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode="exact"))
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]


@pytest.mark.bitwise
def test_per_row_num_write_and_row_views():
    """A batched forward writes each row's own count of K/V at that row's length: the same bits
    as a forward of the row alone (shape-invariant numerics: each 4-token unit's projections are
    one fixed-shape call, so the bits do not depend on the BLAS's choice by the number of rows,
    which differs between CPUs; MKL's AVX2 float64 GEMM gave the 12-row batch other bits)."""
    c = ckpt("target")
    m = c.model
    m.invariant = True
    cache = m.new_cache(3, 32)
    cache.seqlens.copy_(torch.tensor([0, 4, 8], dtype=torch.int32))
    ids = torch.randint(0, V - 2, (3, 4), generator=torch.Generator().manual_seed(0))
    pos = cache.seqlens.long()[:, None] + torch.arange(4)[None]
    lab = labels_for(4, "cpu").repeat(3, 1, 1)
    ref = [KVCache.for_model(m.config, 1, 32, m.dtype, "cpu") for _ in range(3)]
    m(ids, pos, lab, "bidirectional", cache, torch.tensor([4, 0, 2], dtype=torch.int32), None, unit=4)
    assert cache.seqlens.tolist() == [4, 4, 10]
    for b, n in enumerate([4, 0, 2]):
        view = cache.rows(b, b + 1)
        ref[b].seqlens.fill_(int(pos[b, 0]))
        m(ids[b:b + 1], pos[b:b + 1], lab[:1], "bidirectional", ref[b], n, None, unit=4)
        got = [view.slots(t, torch.arange(int(view.seqlens[0]))[None])[0] for t in view.k]  # through the view's table
        want = [ref[b].slots(t, torch.arange(int(ref[b].seqlens[0]))[None])[0] for t in ref[b].k]
        assert all(torch.equal(g[int(pos[b, 0]):], w[int(pos[b, 0]):]) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="rows"):
        cache.rows(2, 4)


def test_engine_refuses_a_write_past_a_rows_capacity():
    """The engine checks cache room on the host (its caches skip the device-side check)."""
    from simsd.engine.batching import BatchEngine, Fwd
    m = ckpt("target").model
    engine = BatchEngine({"target": m}, 4, 2, capacity=8, margin=0)
    assert not engine.caches["target"].check_lengths
    engine.rows[1].cached["target"] = 6
    block = torch.zeros(4, dtype=torch.int64)
    fwd = Fwd("target", block, range(4), [(0, 0, 0)] * 4, "bidirectional", num_write=4)
    with pytest.raises(ValueError, match="row 1 of target: 4 tokens written, 2 free slots"):
        engine.forward("target", "bidirectional", {1: fwd})
    engine.rows[1].cached["target"] = 4
    engine.forward("target", "bidirectional", {1: fwd})
    assert engine.rows[1].cached["target"] == 8


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_static_shapes_equal_dynamic(pair, mode, fold, monkeypatch):
    """The fixed shapes that CUDA graphs replay (all rows, padded queries) give the same tokens."""
    import functools

    import simsd.decoding.vanilla
    import simsd.speculative.decoder
    from simsd.engine.batching import BatchEngine
    static = functools.partial(BatchEngine, static_shapes=True)
    target, draft = pair
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=10, fold_commit=fold)
    spec = SpecConfig(mode=mode if mode != "vanilla" else "exact")
    want = batch(mode, target, draft, PROMPTS, cfg, spec)
    monkeypatch.setattr(simsd.decoding.vanilla, "BatchEngine", static)
    monkeypatch.setattr(simsd.speculative.decoder, "BatchEngine", static)
    got = batch(mode, target, draft, PROMPTS, cfg, spec)
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]


def test_triton_batch_equals_single_runs():
    """Padded batched forwards through the (interpreted on CPU) Triton kernels."""
    pytest.importorskip("triton")
    from simsd_kernels.backends import resolve_backend
    path = random_checkpoint("target", tokenizer=False, vocab_size=V, num_hidden_layers=2, seed=0, std=0.2)
    t = load_checkpoint(path, dtype="float32", with_tokenizer=False)
    try:
        resolve_backend("triton", t.model.device)
    except ValueError as exc:
        pytest.skip(str(exc))
    t.model.attention_backend = "triton"
    cfg = DecodeConfig(block_length=4, max_new_tokens=4)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10]]
    got = speculative_generate_batch(t, t, prompts, cfg, SpecConfig(mode="paper"))
    want = [speculative_generate(t, t, p, cfg, SpecConfig(mode="paper")).token_ids for p in prompts]
    assert [r.token_ids for r in got.results] == want


def test_cuda_graphs_refused_on_cpu(pair):
    from simsd.engine.graphs import GraphRunner
    target, _ = pair
    with pytest.raises(ValueError, match="CUDA"):
        GraphRunner(target.model, target.model.new_cache(1, 8), 4)


@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_graph_runner_buffer_logic_with_eager_capture(pair, mode, monkeypatch):
    """The graph engine's static buffers, shape keys, per-row writes and output copies, with the
    CUDA capture replaced by eager replay: stale buffers would change the tokens. The batch
    functions make one engine per call; an engine that is kept (as :class:`simsd.LLM` keeps
    its engine) replays the shapes it captured in later runs."""
    import simsd.engine.graphs
    from simsd.decoding.config import check_prompt
    from simsd.decoding.program import generate_batch
    from simsd.decoding.vanilla import VanillaRow
    from simsd.engine.batching import BatchEngine, round_capacity
    from simsd.speculative.decoder import SpeculativeDecoder
    monkeypatch.setattr(simsd.engine.graphs, "cuda_capture", simsd.engine.graphs.eager_capture)
    monkeypatch.setattr(simsd.engine.graphs, "check_graphable", lambda model: None)
    target, draft = pair
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=14)
    spec = SpecConfig(mode=mode if mode != "vanilla" else "exact")
    want = [r.token_ids for r in batch(mode, target, draft, PROMPTS, cfg, spec).results]
    if mode == "vanilla":
        got = vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, target.stop_ids,
                                     cuda_graphs=True)
    else:
        got = speculative_generate_batch(target, draft, PROMPTS, cfg, spec, cuda_graphs=True)
    assert [r.token_ids for r in got.results] == want
    caps = [check_prompt(p, target.config, cfg.max_new_tokens, 4) for p in PROMPTS]
    models = {"target": target.model} if mode == "vanilla" else {"target": target.model, "draft": draft.model}
    engine = BatchEngine(models, 4, len(PROMPTS), round_capacity(max(caps)), (4 + 2) * 4, cuda_graphs=True)
    dec = SpeculativeDecoder(target, draft, cfg, spec)
    new = (lambda row, i: VanillaRow(row, cfg, target.mask_token_id, target.stop_ids, cfg.seed + i)) \
        if mode == "vanilla" else (lambda row, i: dec.new_row(row, cfg.seed + i))
    runner = engine.graphs["target"]
    for run in range(2):
        got = generate_batch(engine, PROMPTS, caps, new)
        assert [r.token_ids for r in got.results] == want
        if run == 0:
            shapes, replays = runner.graphs, runner.replays
    assert 0 < runner.graphs == shapes <= 2 * (4 + 2)  # a few shapes, captured in the first run only
    assert runner.replays >= 2 * replays > 2 * runner.graphs  # many replays
