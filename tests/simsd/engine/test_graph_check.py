"""CUDA graphs prove themselves (issue 12 item 3), tested on the CPU with eager capture.

The first replay of each captured shape is compared with the same forward run eagerly; a
capture whose replay is wrong (stale logits, corrupted K/V writes) must be caught at once,
turn the engine's graphs off with one warning, and leave the tokens those of eager decoding.
Eager and graph engines round the cache capacity alike, so the kernels pick the same split
count (the same summation order) in both.
"""
import dataclasses
import warnings

import pytest
import torch

from simsd import DecodeConfig, load_checkpoint
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.engine import batching, graphs
from simsd.engine.graphs import GraphCheckWarning, eager_capture
from simsd.speculative import SpecConfig, speculative_generate_batch
from tests.helpers import random_checkpoint

V = 96
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 8, 13)]
CFG = DecodeConfig(block_length=4, strategy="static", max_new_tokens=12)


def ckpt(name, layers, seed):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2)
    return dataclasses.replace(load_checkpoint(path, dtype="float32", with_tokenizer=False), stop_ids=[])


@pytest.fixture(scope="module")
def pair():
    return ckpt("gc-target", 2, 0), ckpt("gc-draft", 1, 5)


@pytest.fixture
def graph_engines(monkeypatch):
    """Graph engines on the CPU: ``capture`` replaces the CUDA capture; the pool starts empty."""
    monkeypatch.setattr(graphs, "check_graphable", lambda model: None)
    monkeypatch.setattr(batching, "_POOL", {})

    def use(capture):
        monkeypatch.setattr(graphs, "cuda_capture", capture)
    return use


def decode(mode, target, draft, graphs_on):
    if mode == "vanilla":
        return vanilla_generate_batch(target.model, PROMPTS, CFG, target.mask_token_id, [], cuda_graphs=graphs_on)
    return speculative_generate_batch(target, draft, PROMPTS, CFG, SpecConfig(mode=mode), cuda_graphs=graphs_on)


def stale_capture(fn, cache, device, pool):
    """A broken capture: replay computes nothing (like a CUDA capture, the capture itself runs
    no kernel, so the static output holds whatever the pool held: zeros here)."""
    replay, out, pool = eager_capture(fn, cache, device, pool)
    if out is not None:
        out.zero_()
    return (lambda: None), out, pool


def corrupting_capture(fn, cache, device, pool):
    """A broken capture whose logits are right but whose K/V writes are off by one in layer 0."""
    replay, out, pool = eager_capture(fn, cache, device, pool)

    def bad_replay():
        before = cache.seqlens.clone()
        replay()
        past = torch.arange(cache.max_len)[None, :] >= before[:, None]
        cache.k[0][past] += 1.0
    return bad_replay, out, pool


def nan_capture(fn, cache, device, pool):
    """A broken capture whose replay leaves NaN in the logits (memory nothing wrote)."""
    replay, out, pool = eager_capture(fn, cache, device, pool)

    def bad_replay():
        replay()
        if out is not None:
            out.fill_(float("nan"))
    return bad_replay, out, pool


def _recorded(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, GraphCheckWarning)]


@pytest.mark.parametrize("mode", ["vanilla", "exact", "paper"])
def test_first_replay_of_every_shape_is_checked(pair, graph_engines, mode):
    graph_engines(eager_capture)
    target, draft = pair
    want = [r.token_ids for r in decode(mode, target, draft, False).results]
    got, caught = _recorded(lambda: decode(mode, target, draft, True))
    assert [r.token_ids for r in got.results] == want and not caught
    (engine,) = batching._POOL.values()
    for runner in engine.graphs.values():
        assert runner.disabled is None
        assert len(runner.checks) == runner.graphs > 0, "one comparison per captured shape"
        assert all(diff == 0.0 for _, diff, _ in runner.checks), runner.checks


@pytest.mark.parametrize("capture,mode", [(stale_capture, "vanilla"), (corrupting_capture, "exact"),
                                          (nan_capture, "paper")],
                         ids=["stale-logits-vanilla", "corrupt-kv-exact", "nan-logits-paper"])
def test_a_wrong_replay_disables_graphs_with_one_warning(pair, graph_engines, capture, mode):
    graph_engines(capture)
    target, draft = pair
    want = [r.token_ids for r in decode(mode, target, draft, False).results]
    got, caught = _recorded(lambda: decode(mode, target, draft, True))
    assert [r.token_ids for r in got.results] == want, "after the mismatch the run continues eagerly"
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "differs from eager" in str(caught[0].message) and "disabled" in str(caught[0].message)
    (engine,) = batching._POOL.values()
    assert all(r.disabled for r in engine.graphs.values()), "one engine state: every model's graphs are off"
    # the pooled engine stays off for the run: no new capture, no new warning
    shapes = {n: r.graphs for n, r in engine.graphs.items()}
    again, caught = _recorded(lambda: decode(mode, target, draft, True))
    assert [r.token_ids for r in again.results] == want and not caught
    assert {n: r.graphs for n, r in engine.graphs.items()} == shapes


def test_eager_and_graph_engines_pick_the_same_split_count(pair, graph_engines):
    """The split-KV plan of the kernels depends on the cache capacity: eager and graph engines
    of the same request must allocate the same capacity, so equal kernels sum in equal order
    (issue 12: graphs under 256-rounding picked 2 splits where eager picked 1)."""
    from simsd_kernels.split_plan import CUDA_FIGURES, TRITON_FIGURES, DeviceLimits, plan_attention, residency
    graph_engines(eager_capture)
    target, _ = pair
    m = target.model
    capacity, margin, B = 1000, 8, 3
    eager = batching.engine_for({"target": m}, 4, B, capacity, margin)
    graph = batching.engine_for({"target": m}, 4, B, capacity, margin, cuda_graphs=True)
    lmax = {name: e.caches["target"].k[0].shape[1] for name, e in (("eager", eager), ("graph", graph))}
    assert lmax["eager"] == lmax["graph"] == batching.round_capacity(capacity) + margin
    h200 = DeviceLimits()  # an H100/H200's SM count and limits, no GPU needed
    differs = 0
    for figures in (CUDA_FIGURES, TRITON_FIGURES):
        for Lq in (4, 8, 16):  # denoise, paper verify, exact verify at B=4 (SDAR-8B heads)
            plan = lambda cap: plan_attention(batch=B, q_len=Lq, num_q_heads=32, num_kv_heads=8,  # noqa: E731
                                              head_dim=128, cache_capacity=cap, num_sms=h200.num_sms,
                                              ctas_per_sm=residency(figures, 128, h200))
            plans = {k: plan(v) for k, v in lmax.items()}
            assert plans["eager"] == plans["graph"], (Lq, plans)
            differs += plan(capacity + margin).num_splits != plans["graph"].num_splits
    assert differs, "the test has teeth: the unrounded capacity would split differently somewhere"
