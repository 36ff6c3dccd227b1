"""KV page pools through the API (issue 37 items 1-3; ``LLM(page_size=..., kv_cache_memory=...,
enable_prefix_caching=..., gpu_memory_utilization=...)``, :mod:`simsd.engine.pages`):

* a pool gives the tokens of the contiguous caches (vanilla and exact, greedy and seeded);
* a pool too small for every row at once preempts requests, which start over with the same
  tokens; a streamed request delivers each block once (listener events), and every page comes back;
* the prefix cache shares a system prompt's pages between requests (hits counted, fewer prefill
  forwards) and gives the tokens of a run without it (shape-invariant numerics: the same K/V
  bits), in float32 and bfloat16; under pressure cached pages are evicted and counted;
* a cancelled request's pages come back; settings that cannot work are refused by name;
  ``gpu_memory_utilization`` sizes the pool from the device's total memory.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from simsd import LLM, ParamError, SamplingParams
from simsd.engine.memory import RESERVE_BYTES, total_bytes

SYSTEM = [(7 * i) % 90 + 10 for i in range(40)]  # a 40-token shared prefix (the bundled pair: blocks of 4)
PROMPTS = [[11 + i, 12, 13, 14 + i] * (1 + i % 3) for i in range(5)]


def run(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


def params(n, temperature):
    return [SamplingParams(max_tokens=10 + 3 * i, temperature=temperature, seed=40 + i) for i in range(n)]


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_page_pool_gives_the_contiguous_tokens(mode, temperature):
    kw = dict(mode=mode, dtype="float32", device="cpu", batch_size=3, max_model_len=96, scheduler_thread=False)
    want = run(LLM(**kw), PROMPTS, params(5, temperature))
    llm = LLM(page_size=16, **kw)
    assert run(llm, PROMPTS, params(5, temperature)) == want
    pages = llm.metrics()["kv_pages"]
    assert pages["page_size"] == 16 and all(pages[m]["pages_used"] == 0 for m in llm.engine.caches)
    assert pages["target"]["pages_free"] == pages["target"]["pages_total"]


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_preempted_requests_start_over_with_the_same_tokens_and_stream_each_block_once(mode):
    kw = dict(mode=mode, dtype="float32", device="cpu", batch_size=4, max_model_len=128, scheduler_thread=False)
    ps = [SamplingParams(max_tokens=100, temperature=1.0, seed=7 + i, ignore_eos=True) for i in range(4)]
    want = run(LLM(**kw), PROMPTS[:4], ps)
    llm = LLM(page_size=16, **kw)
    per_row = llm.engine.caches["target"].allocator.max_pages
    small = LLM(page_size=16, kv_cache_memory=(per_row + 3) * page_bytes(llm), **kw)  # 4 rows need 28 pages
    assert small.metrics()["kv_pages"]["target"]["pages_total"] == per_row + 2
    events = [[] for _ in ps]
    handles = [small.submit(p, q, listener=lambda kind, payload, i=i: events[i].append((kind, payload)))
               for i, (p, q) in enumerate(zip(PROMPTS[:4], ps))]
    while not all(h.done for h in handles):
        small.scheduler.step()
    m = small.metrics()
    assert m["preemptions"] > 0 and sum(h.request.preemptions for h in handles) == m["preemptions"]
    for i, evs in enumerate(events):
        deltas = [tuple(p[1]) for kind, p in evs if kind == "delta"]
        assert [tok for d in deltas for tok in d] == want[i]  # each token delivered once, in order
        assert evs[-1][0] == "done" and evs[-1][1].token_ids == want[i]
    assert m["kv_pages"]["target"]["pages_used"] == 0 and m["kv_pages"]["draft" if mode == "exact" else "target"][
        "pages_free"] == per_row + 2


def page_bytes(llm) -> int:
    """Bytes of one KV page of every model of ``llm`` (float32)."""
    return sum(2 * m.config.num_hidden_layers * 16 * m.config.num_key_value_heads * m.config.head_dim * 4
               for m in llm.engine.models.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_a_shared_system_prompt_is_prefilled_once_and_gives_the_same_tokens(dtype, mode):
    kw = dict(mode=mode, dtype=dtype, device="cpu", batch_size=2, max_model_len=128, invariant=True,
              scheduler_thread=False)
    prompts = [SYSTEM + [20 + i, 21, 22 + i] for i in range(4)]
    ps = [SamplingParams(max_tokens=12, temperature=1.0, seed=3 + i) for i in range(4)]
    plain = LLM(page_size=16, **kw)
    want = run(plain, prompts, ps)
    cached = LLM(page_size=16, enable_prefix_caching=True, **kw)
    outs = [cached.generate([p], [q])[0] for p, q in zip(prompts, ps)]  # one by one: each finds the ones before
    assert [o.token_ids for o in outs] == want
    assert [o.stats["cached_prompt_tokens"] for o in outs] == [0, 32, 32, 32]
    pages = cached.metrics()["kv_pages"]
    assert pages["prefix_queried_tokens"] == 4 * 32  # two whole pages of the 40-token block-aligned prompt
    assert pages["prefix_hit_tokens"] == 3 * 32  # the first request computes them, the others share them
    # the two shared pages, and each request's third (its own tokens and answer: slots 32-47) when it ended
    assert pages["target"]["pages_cached"] == 2 + 4 and pages["target"]["pages_used"] == 0
    assert cached.totals.snapshot()["prompt_tokens"] == plain.totals.snapshot()["prompt_tokens"]
    a, b = plain.metrics()["prefill_tokens"], cached.metrics()["prefill_tokens"]
    assert {n: a[n] - b[n] for n in a} == {n: 3 * 32 for n in cached.engine.models}  # every model skipped them
    # all four again at once on two rows: concurrent requests hold the same cached pages
    held = []
    reserve = cached.engine.reserve
    cached.engine.reserve = lambda name, reqs: (reserve(name, reqs), held.append(
        max(cached.engine.caches[name].allocator._refs)))[0]
    assert run(cached, prompts, ps) == want
    assert max(held) == 2


def test_cached_pages_are_evicted_under_pressure():
    kw = dict(mode="vanilla", dtype="float32", device="cpu", batch_size=4, max_model_len=64, scheduler_thread=False)
    probe = LLM(page_size=16, **kw)
    per_row = probe.engine.caches["target"].allocator.max_pages
    llm = LLM(page_size=16, enable_prefix_caching=True, kv_cache_memory=(per_row + 1) * page_bytes(probe), **kw)
    p = SamplingParams(max_tokens=8)
    first = run(llm, [SYSTEM], [p])
    assert llm.metrics()["kv_pages"]["target"]["pages_cached"] == 2
    others = [[20 + 4 * j + i % 50 for i in range(48)] for j in range(4)]  # 4 rows of 5 pages: 20 > 17 - 2
    run(llm, others, [SamplingParams(max_tokens=16, ignore_eos=True)] * 4)
    pages = llm.metrics()["kv_pages"]
    assert pages["target"]["evictions"] > 0 and pages["target"]["pages_total"] == per_row
    assert run(llm, [SYSTEM], [p]) == first


def test_a_cancelled_request_gives_its_pages_back():
    llm = LLM(mode="exact", dtype="float32", device="cpu", batch_size=2, page_size=16, scheduler_thread=False)
    h = llm.submit(PROMPTS[2], SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(4):
        llm.scheduler.step()
    assert llm.metrics()["kv_pages"]["target"]["pages_used"] > 0
    assert h.cancel()
    llm.scheduler.step()
    pages = llm.metrics()["kv_pages"]
    assert all(pages[m]["pages_used"] == 0 and pages[m]["pages_free"] == pages[m]["pages_total"]
               for m in ("target", "draft"))


@pytest.mark.parametrize("kw, param, says", [
    (dict(page_size=6), "page_size", "whole number of blocks"),
    (dict(enable_prefix_caching=True), "enable_prefix_caching", "page_size"),
    (dict(page_size=16, kv_cache_memory=1e6, gpu_memory_utilization=0.5), "gpu_memory_utilization", "one of them"),
    (dict(page_size=16, kv_cache_memory=1e3), "kv_cache_memory", "fewer than one request"),
])
def test_settings_that_cannot_work_are_refused_by_name(kw, param, says):
    with pytest.raises(ParamError, match=says) as exc:
        LLM(mode="vanilla", dtype="float32", device="cpu", **kw)
    assert exc.value.param == param


def test_gpu_memory_utilization_sizes_the_pool_from_the_total_memory():
    total = total_bytes("cpu")
    if total is None:
        pytest.skip("no /proc/meminfo here")
    kw = dict(mode="vanilla", dtype="float32", device="cpu", batch_size=2, max_model_len=64, page_size=16,
              scheduler_thread=False)
    u = (RESERVE_BYTES + (64 << 20)) / total  # the runtime's reserve and about 64 MiB
    small, large = (LLM(gpu_memory_utilization=x, **kw) for x in (u, u + 0.001))
    a, b = (x.metrics()["kv_pages"]["target"]["pages_total"] for x in (small, large))
    step = 0.001 * total / page_bytes(small)  # what the extra share holds in pages
    assert a >= small.engine.caches["target"].allocator.max_pages and abs((b - a) - step) <= 1
    assert (a + 1) * page_bytes(small) <= (64 << 20)  # weights and workspace took the rest


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_a_next_turn_finds_the_previous_answer_cached(mode):
    """When a request ends, its prompt's and output's full pages are offered to the cache: a
    next turn whose prompt starts with them (a chat's history) prefills only what follows, with
    the tokens of a run without the cache (``--invariant``)."""
    kw = dict(mode=mode, dtype="float32", device="cpu", batch_size=1, max_model_len=256, invariant=True,
              page_size=16, scheduler_thread=False)
    p = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=9)
    turn1 = SYSTEM[:30]
    plain, cached = LLM(**kw), LLM(enable_prefix_caching=True, **kw)
    answer = run(cached, [turn1], [p])[0]
    assert answer == run(plain, [turn1], [p])[0]
    turn2 = turn1 + answer + [12, 13, 14]  # 73 tokens: the first 64 are 4 pages of prompt and answer
    before = cached.metrics()["kv_pages"]["prefix_hit_tokens"]
    assert run(cached, [turn2], [p]) == run(plain, [turn2], [p])
    assert cached.metrics()["kv_pages"]["prefix_hit_tokens"] - before == 64


def test_a_replayed_block_is_not_delivered_again_and_one_that_differs_is_an_error():
    """What a preempted request's handle does when its program starts over (``RequestHandle.start``,
    ``on_block``): blocks delivered before are swallowed when they come out the same, and one that
    comes out otherwise (numerics that depend on the batch: bfloat16 without ``--invariant``) fails
    the request with the block named, never a silent change of what was streamed."""
    llm = LLM(mode="vanilla", dtype="float32", device="cpu", batch_size=1, page_size=16, scheduler_thread=False)
    events = []
    h = llm.submit([11, 12, 13], SamplingParams(max_tokens=64, ignore_eos=True),
                   listener=lambda kind, payload: events.append((kind, payload)))
    program = SimpleNamespace(logprobs=None)  # a row program as the handle reads it
    h.start(program)
    assert h.on_block([20, 21, 22]) is False and h.on_block([23, 24, 25, 26]) is False
    assert [p[1] for k, p in events if k == "delta"] == [[20, 21, 22], [23, 24, 25, 26]]
    h.start(program)  # started over after a preemption
    assert h.on_block([20, 21, 22]) is False and len(events) == 2  # replayed: not delivered again
    with pytest.raises(RuntimeError, match=r"decoded block 1 as \[23, 24, 25, 27\], not \[23, 24, 25, 26\]"):
        h.on_block([23, 24, 25, 27])
    assert h.cancel()
