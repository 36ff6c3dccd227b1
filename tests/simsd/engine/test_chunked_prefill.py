"""Chunked prefill (issue 37 item 4; BatchEngine.prefill, Scheduler): a prompt's block-aligned
part is prefilled in chunks of at most ``max_prefill_tokens`` interleaved with the other rows'
forwards. A request's tokens, and its decoding forward counts, do not depend on the chunk size;
with shape-invariant numerics on the torch backend the KV a chunked prefill writes is the whole
prefill's, bit for bit; no pending request waits more than ``MAX_WAIT + rows - 1`` rounds."""
import dataclasses

import pytest
import torch

from simsd import LLM, DecodeConfig, ParamError, SamplingParams, load_checkpoint
from simsd.assets import DEFAULT_TARGET
from simsd.decoding.config import check_prompt, finish
from simsd.decoding.vanilla import VanillaRow
from simsd.engine.batching import MAX_WAIT, BatchEngine, Fwd
from simsd.engine.scheduler import Request, Scheduler
from simsd.speculative import SpecConfig, SpeculativeDecoder
from tests.helpers import random_checkpoint

V = 96
L = 4
# aligned parts 0, 4, 16, 20, 28: no prefill, shorter than a chunk of 2 blocks, exactly 2 and 4 chunks of
# 2 blocks (no tail), 5 and 7 chunks of one block
LENGTHS = (3, 6, 16, 21, 30)
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(70 + n)).tolist() for n in LENGTHS]
MAX_NEW = (9, 13, 8, 11, 6)
SEEDS = (5, 2**33 + 1, 17, 0, 421)
CHUNKS = (L, 2 * L, None)


def ckpt(name, dtype, layers, seed):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2)
    c = load_checkpoint(path, dtype=dtype, with_tokenizer=False)
    return dataclasses.replace(c, stop_ids=[])


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def pair(request):
    """An invariant target (shape-invariant numerics: the promise of bf16 identity) and a draft."""
    target, draft = ckpt("chunk-target", request.param, 2, 0), ckpt("chunk-draft", request.param, 1, 11)
    target.model.invariant = True
    return target, draft


def engine(mode, target, draft, rows, chunk, capacity=64, **kw):
    models = {"target": target.model} if mode == "vanilla" else {"target": target.model, "draft": draft.model}
    return BatchEngine(models, L, rows, capacity=capacity, margin=(L + 2) * L, max_prefill_tokens=chunk, **kw)


def request(mode, target, draft, i, sampling, out):
    params = SamplingParams(temperature=1.5, top_k=30) if sampling else SamplingParams()
    cfg = DecodeConfig(block_length=L, strategy="static", max_new_tokens=MAX_NEW[i], sampling=params)

    def program(row, tail):
        if mode == "vanilla":
            prog = VanillaRow(row, cfg, target.mask_token_id, [], SEEDS[i])
        else:
            prog = SpeculativeDecoder(target, draft, cfg, SpecConfig(mode=mode), check=False).new_row(row, SEEDS[i])
        out.append(prog)
        return prog.program(tail)
    req = Request(PROMPTS[i], program, check_prompt(PROMPTS[i], target.config, MAX_NEW[i], L))
    req.progs = out
    return req


def run(mode, target, draft, chunk, sampling, rows=3):
    """The 5 requests through a scheduler of ``rows`` rows (later ones admitted while others
    decode): per request ``(tokens, target forwards, prefill chunks)``."""
    eng = engine(mode, target, draft, rows, chunk)
    sched = Scheduler(eng, max_waiting=len(PROMPTS))
    reqs = [request(mode, target, draft, i, sampling, []) for i in range(len(PROMPTS))]
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle(max_rounds=5000)
    out = []
    for i, r in enumerate(reqs):
        assert r.error is None, r.error
        (prog,) = r.progs
        out.append((finish(r.result, [], MAX_NEW[i]), prog.row.forwards["target"], prog.row.prefill_forwards))
    return out


def chunks_of(chunk):
    return [0 if n < L else -(-(n // L * L) // (chunk or n // L * L)) for n in LENGTHS]


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_tokens_do_not_depend_on_the_chunk_size(pair, sampling):
    """Vanilla and exact, chunks of 1 block, 2 blocks and unlimited, 3 rows for 5 prompts of
    different lengths: every request's tokens and target forwards equal the unlimited vanilla
    run's; ``prefill_forwards`` counts the chunks."""
    target, draft = pair
    ref = run("vanilla", target, draft, None, sampling)
    assert len({tuple(t) for t, _, _ in ref}) == len(PROMPTS) and all(len(t) == m for (t, _, _), m in zip(ref, MAX_NEW))
    for mode in ("vanilla", "exact"):
        for chunk in CHUNKS:
            got = run(mode, target, draft, chunk, sampling)
            assert [t for t, _, _ in got] == [t for t, _, _ in ref], (mode, chunk)
            assert [p for _, _, p in got] == chunks_of(chunk), (mode, chunk)
            if mode == "vanilla":
                assert [f for _, f, _ in got] == [f for _, f, _ in ref], chunk
    assert chunks_of(L) == [0, 1, 4, 5, 7] and chunks_of(2 * L) == [0, 1, 2, 3, 4]


def prefill_kv(target, chunk, prompt):
    """The target's K/V (per layer, ``(aligned, Hkv, D)``) after ``prompt``'s prefill in row 1 of
    a 2-row engine, its requests run one by one through ``BatchEngine.forward``."""
    eng = BatchEngine({"target": target.model}, L, 2, capacity=64, margin=2 * L, max_prefill_tokens=chunk)
    eng.release(1)
    gen, widths = eng.prefill(1, prompt), []
    try:
        fwd = next(gen)
        while True:
            widths.append(len(fwd.positions))
            fwd = gen.send(eng.forward(fwd.model, fwd.mask_mode, {1: fwd})[1])
    except StopIteration as stop:
        tail = stop.value
    n = len(prompt) // L * L
    cache = eng.caches["target"]
    assert eng.rows[1].cached["target"] == n and int(cache.seqlens[1]) == n and tail == prompt[n:]
    assert eng.forwards["target"] == 0 and eng.rows[1].forwards["target"] == 0  # prefill is not counted
    return [k[1, :n].clone() for k in cache.k] + [v[1, :n].clone() for v in cache.v], widths


def test_chunked_prefill_writes_the_whole_prefills_bits(pair):
    """Invariant numerics on the torch backend: chunk boundaries are block boundaries, so the K/V
    a chunked prefill writes are the bits of the whole prefill (float32 and bfloat16)."""
    target, _ = pair
    prompt = PROMPTS[-1] + PROMPTS[-2]  # 51 tokens: 12 blocks and a tail of 3
    whole, widths = prefill_kv(target, None, prompt)
    assert widths == [48]
    for chunk, want in ((L, [4] * 12), (2 * L, [8] * 6), (5 * L, [20, 20, 8])):
        kv, widths = prefill_kv(target, chunk, prompt)
        assert widths == want
        for a, b in zip(kv, whole):
            assert torch.equal(a, b), chunk


def test_a_lone_prefill_is_not_starved_and_no_request_waits_long(pair):
    """Two rows decode (vanilla, exact verify and draft forwards); a prompt of 32 chunks is
    admitted into the third: its chunks alternate with the others' forwards (never two in a row
    while a decoding request waits), no pending request is passed over more than
    ``MAX_WAIT + rows - 1`` rounds, and the tokens are those of the unlimited run."""
    target, draft = pair
    long = [(7 * j) % (V - 2) for j in range(32 * L + 1)]
    for mode in ("vanilla", "exact"):
        eng = engine(mode, target, draft, 3, L, capacity=256)
        sched = Scheduler(eng, max_waiting=4)
        picks, pick = [], eng.pick

        def recording(pending, waited=None, held=frozenset()):
            chosen = pick(pending, waited, held)
            picks.append(({i: f.prefill for i, (_, f) in pending.items()}, chosen[2]))
            return chosen
        eng.pick = recording
        reqs = [request(mode, target, draft, i, False, []) for i in (1, 2)]
        for r in reqs:
            sched.submit(r)
        for _ in range(6):
            sched.step()
        progs = []
        cfg = DecodeConfig(block_length=L, strategy="static", max_new_tokens=4)
        lone = Request(long, lambda row, tail: progs.append(VanillaRow(row, cfg, target.mask_token_id, [], 1))
                       or progs[-1].program(tail), capacity=check_prompt(long, target.config, 4, L))
        sched.submit(lone)
        sched.run_until_idle(max_rounds=5000)
        assert all(r.error is None for r in reqs + [lone]) and progs[0].row.prefill_forwards == 32
        assert lone.row == 2
        waits, worst, chunk_rounds = {}, 0, []
        for k, (pending, rows) in enumerate(picks):
            for i in pending:
                waits[i] = 0 if i in rows else waits.get(i, 0) + 1
                worst = max(worst, waits[i])
            waits = {i: w for i, w in waits.items() if i in pending}
            if rows == [lone.row] and pending[lone.row]:
                chunk_rounds.append(k)
        assert worst <= MAX_WAIT + 3 - 1, worst
        assert len(chunk_rounds) == 32 * len(eng.models)
        decoding = [k for k in chunk_rounds if any(not p for p in picks[k][0].values())]
        assert len(decoding) > 10  # the chunks did run while the others decoded
        for k in decoding:  # a chunk round is never followed by another while a decoding request waits
            if k + 1 in chunk_rounds:
                assert not any(not p for p in picks[k + 1][0].values()), (mode, k)
        alone = run("vanilla", target, draft, None, False)
        assert [finish(r.result, [], MAX_NEW[i]) for r, i in zip(reqs, (1, 2))] == [alone[1][0], alone[2][0]]


def test_pick_ages_requests_and_prefers_one_chunk_per_row(pair):
    """``BatchEngine.pick``: the largest group, draft first; a row's prefill chunk before them
    unless its row is held; a request passed over ``MAX_WAIT`` rounds before everything."""
    target, draft = pair
    eng = engine("exact", target, draft, 4, L)

    def fwd(model, mode, prefill=False):
        return (None, Fwd(model, None, [0], [], mode, prefill=prefill))
    pending = {0: fwd("target", "exact"), 1: fwd("target", "exact"), 2: fwd("draft", "bidirectional"),
               3: fwd("target", "block_causal", prefill=True)}
    assert eng.pick(pending, {}, frozenset()) == ("target", "block_causal", [3])
    assert eng.pick(pending, {}, frozenset({3})) == ("draft", "bidirectional", [2])
    del pending[2]
    assert eng.pick(pending, {3: MAX_WAIT - 1}, frozenset({3})) == ("target", "exact", [0, 1])
    assert eng.pick(pending, {3: MAX_WAIT, 0: 1}, frozenset({3})) == ("target", "block_causal", [3])
    assert eng.pick(pending, {3: MAX_WAIT, 1: MAX_WAIT + 1}, frozenset({3})) == ("target", "exact", [0, 1])
    pending[2] = fwd("target", "block_causal", prefill=True)  # prefill requests never share a forward
    assert eng.pick(pending, {}, frozenset({3})) == ("target", "block_causal", [2])


def test_a_request_cancelled_while_prefilling_frees_its_row(pair):
    target, draft = pair
    eng = engine("vanilla", target, draft, 2, L)
    sched = Scheduler(eng, max_waiting=4)
    reqs = [request("vanilla", target, draft, i, False, []) for i in (4, 0)]
    for r in reqs:
        sched.submit(r)
    sched.step()
    sched.step()
    assert eng.rows[0].prefill_forwards == 1 and reqs[0].admitted is None  # 7 chunks: still prefilling
    sched.cancel(reqs[0])
    sched.run_until_idle(max_rounds=500)
    assert reqs[0].cancelled and reqs[0].decode_interval is None and reqs[1].error is None
    assert sorted(sched._free) == [0, 1]


def test_static_shape_engines_run_prefill_chunks_alone_and_eagerly(pair, monkeypatch):
    """A CUDA-graph engine (capture replaced by eager replay on the CPU) runs each chunk over its
    row alone, eagerly: no graph of a chunk's width is captured, the decoding shapes are."""
    import simsd.engine.graphs
    monkeypatch.setattr(simsd.engine.graphs, "cuda_capture", simsd.engine.graphs.eager_capture)
    monkeypatch.setattr(simsd.engine.graphs, "check_graphable", lambda model: None)
    target, draft = pair
    eng = engine("vanilla", target, draft, 3, 2 * L, cuda_graphs=True)
    shapes, forward = [], type(target.model).forward

    def recording(self, ids, positions, labels, mask_mode, cache=None, num_write=0, *a, **k):
        shapes.append((mask_mode, tuple(ids.shape), cache.batch_size))
        return forward(self, ids, positions, labels, mask_mode, cache, num_write, *a, **k)
    monkeypatch.setattr(type(target.model), "forward", recording)
    sched = Scheduler(eng, max_waiting=len(PROMPTS))
    reqs = [request("vanilla", target, draft, i, False, []) for i in range(len(PROMPTS))]
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle(max_rounds=5000)
    monkeypatch.undo()
    ref = run("vanilla", target, draft, None, False)
    assert [finish(r.result, [], MAX_NEW[i]) for i, r in enumerate(reqs)] == [t for t, _, _ in ref]
    chunks = [s for s in shapes if s[0] == "block_causal"]
    assert sorted(chunks) == [("block_causal", (1, 4), 1)] * 3 + [("block_causal", (1, 8), 1)] * 7
    runner = eng.graphs["target"]
    assert runner.graphs and all(key[0] != "block_causal" for key in runner._graphs)


def test_max_prefill_tokens_is_a_whole_number_of_blocks():
    with pytest.raises(ValueError, match=r"^max_prefill_tokens must be a positive multiple of the block length 4 "
                                         r"\(whole blocks per prefill forward\), got 6$"):
        BatchEngine({}, 4, 1, 8, 8, max_prefill_tokens=6)
    for bad in (6, 2):
        with pytest.raises(ParamError, match=rf"^max_prefill_tokens must be a whole number of blocks \(a multiple "
                                             rf"of the block length 4\), got {bad}$") as exc:
            LLM(mode="vanilla", device="cpu", max_prefill_tokens=bad)
        assert exc.value.param == "max_prefill_tokens"
    with pytest.raises(ParamError) as exc:
        LLM(mode="vanilla", device="cpu", max_prefill_tokens=0)
    assert exc.value.param == "max_prefill_tokens"


def test_the_api_chunks_prefills_with_the_same_tokens():
    """``LLM(max_prefill_tokens=...)`` and SGLang's ``chunked_prefill_size`` reach the engine; the
    bundled pair in exact mode gives the unchunked engine's tokens, greedy and seeded."""
    prompts = ["Write a Python function that reverses a list and explain how it works.", "Hi"]
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=10, temperature=1.0, seed=3)]
    outs = []
    for kw in ({}, {"max_prefill_tokens": 4}, {"chunked_prefill_size": 8}):
        llm = LLM(str(DEFAULT_TARGET), device="cpu", batch_size=2, scheduler_thread=False, **kw)
        assert llm.engine.max_prefill_tokens == (kw and next(iter(kw.values())) or None)
        got = llm.generate(prompts, params)
        outs.append([(o.token_ids, o.stats["target_forwards"], o.stats["prefill_forwards"]) for o in got])
        llm.shutdown()
    (whole, by4, by8) = outs
    assert [t for t, _, _ in by4] == [t for t, _, _ in whole] == [t for t, _, _ in by8]
    assert whole[0][2] == 1 and by4[0][2] > by8[0][2] > 1 and [p for _, _, p in whole[1:]] == [0]
