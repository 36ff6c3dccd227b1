"""Continuous batching (simsd.engine.scheduler): a request's tokens do not depend on what else is
in flight, rows are admitted and retired between rounds, faults and cancellations stay with
their request."""
import dataclasses
import threading
import time

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint
from simsd.decoding.config import check_prompt, finish
from simsd.decoding.vanilla import VanillaRow, vanilla_generate_batch
from simsd.engine.batching import BatchEngine
from simsd.engine.scheduler import QueueFull, Request, Scheduler, SchedulerClosed
from simsd.speculative import SpecConfig, SpeculativeDecoder
from tests.helpers import random_checkpoint

V = 96
# prompt lengths below, at and past a block multiple, each with its own token limit
LENGTHS = [(3, 9), (8, 14), (13, 5), (6, 17), (1, 11), (11, 8)]
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(50 + n)).tolist()
           for n, _ in LENGTHS]
MAX_NEW = [m for _, m in LENGTHS]
SEEDS = [7, 123456789, 3, 2**40 + 5, 0, 99]


def ckpt(name, layers=2, seed=0):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2)
    return load_checkpoint(path, dtype="float32", with_tokenizer=False)


@pytest.fixture(scope="module")
def pair():
    return ckpt("target"), ckpt("poor-draft", layers=1, seed=11)


def with_stop(target, draft, mode):
    """``target`` with a stop id taken from a free greedy run of request 1 in ``mode``, so that
    some requests stop early and others run to their limit."""
    free = single(mode, dataclasses.replace(target, stop_ids=[]), draft, 1, False).token_ids
    return dataclasses.replace(target, stop_ids=[free[6]])


def config(i, sampling, fold=False):
    params = SamplingParams(temperature=3.0, top_k=40) if sampling else SamplingParams()
    return DecodeConfig(block_length=4, strategy="static", max_new_tokens=MAX_NEW[i], sampling=params,
                        fold_commit=fold)


def single(mode, target, draft, i, sampling, fold=False):
    """Request ``i`` decoded alone (the existing batch decoders with one prompt and its seed)."""
    cfg = config(i, sampling, fold)
    if mode == "vanilla":
        out = vanilla_generate_batch(target.model, [PROMPTS[i]], cfg, target.mask_token_id, target.stop_ids,
                                     seeds=[SEEDS[i]])
    else:
        out = SpeculativeDecoder(target, draft, cfg, SpecConfig(mode=mode)).generate_batch([PROMPTS[i]],
                                                                                           seeds=[SEEDS[i]])
    return out.results[0]


def engine_for(mode, target, draft, rows, max_prefill_tokens=None, num_pages=None):
    models = {"target": target.model} if mode == "vanilla" else {"target": target.model, "draft": draft.model}
    margin = 2 * 4 if mode == "vanilla" else (4 + 2) * 4
    pages = {} if num_pages is None else {"page_size": 4, "num_pages": num_pages}
    return BatchEngine(models, 4, rows, capacity=64, margin=margin, max_prefill_tokens=max_prefill_tokens, **pages)


def request(mode, target, draft, i, sampling, done, fold=False):
    """Request ``i`` for a scheduler; ``req.rows`` records its engine row (and SimSD row state)."""
    cfg = config(i, sampling, fold)
    if mode == "vanilla":
        def program(row, tail):
            prog = VanillaRow(row, cfg, target.mask_token_id, target.stop_ids, SEEDS[i])
            req.rows.append(prog)
            return prog.program(tail)
    else:
        dec = SpeculativeDecoder(target, draft, cfg, SpecConfig(mode=mode), check=False)

        def program(row, tail):
            spec_row = dec.new_row(row, SEEDS[i])
            req.rows.append(spec_row)
            return spec_row.program(tail)
    req = Request(PROMPTS[i], program, check_prompt(PROMPTS[i], target.config, MAX_NEW[i], 4),
                  on_finish=done.append, request_id=str(i))
    req.rows = []
    return req


def counters(req) -> dict:
    """The row counters of a finished scheduled request, named as in the decoders' stats."""
    (r,) = req.rows
    row = r.row
    out = {"target_forwards": row.forwards["target"], "prefill_forwards": row.prefill_forwards}
    if "draft" in row.forwards:
        out.update(draft_forwards=row.forwards["draft"], accepted=r.stats.accepted, proposed=r.stats.proposed,
                   rounds=r.stats.rounds)
    return out


def run_staggered(sched, reqs, arrivals):
    """Submit ``reqs[k]`` before round ``arrivals[k]`` and step until all have ended."""
    order = sorted(range(len(reqs)), key=lambda k: arrivals[k])
    r = 0
    while order or sched.num_running or sched.num_waiting:
        while order and arrivals[order[0]] <= r:
            sched.submit(reqs[order.pop(0)])
        sched.step()
        r += 1
        assert r < 2000


ARRIVALS = {"together": [0] * 6, "staggered": [0, 3, 4, 9, 17, 30], "reversed": [40, 31, 20, 9, 2, 0]}


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_outputs_do_not_depend_on_what_else_is_in_flight(pair, mode, sampling):
    """Float32: every request equals its single run whatever the arrival pattern, with 3 rows for
    6 requests (rows are reused, requests wait) and mixed prompt lengths and token limits."""
    target, draft = pair
    target = with_stop(target, draft, mode)
    singles = [single(mode, target, draft, i, sampling) for i in range(len(PROMPTS))]
    assert len({len(s.token_ids) for s in singles}) > 2
    assert sampling or any(s.token_ids[-1] in target.stop_ids for s in singles)  # some stop early
    engine = engine_for(mode, target, draft, rows=3)
    for name, arrivals in ARRIVALS.items():
        done = []
        sched = Scheduler(engine, max_waiting=8)
        reqs = [request(mode, target, draft, i, sampling, done) for i in range(len(PROMPTS))]
        run_staggered(sched, reqs, arrivals)
        assert len(done) == len(reqs) and all(r.error is None and not r.cancelled for r in reqs)
        for i, req in enumerate(reqs):
            generated = req.result
            assert finish(generated, target.stop_ids, MAX_NEW[i]) == singles[i].token_ids, (name, i)
            got = counters(req)
            assert got == {k: singles[i].stats[k] for k in got}, (name, i)
        assert sched.num_running == 0 and sorted(sched._free) == [0, 1, 2]


def test_rows_are_admitted_between_rounds_and_retired_at_once(pair):
    target, draft = pair
    engine = engine_for("vanilla", target, draft, rows=2)
    sched = Scheduler(engine, max_waiting=8)
    done = []
    reqs = [request("vanilla", target, draft, i, False, done) for i in (2, 3, 4)]  # 5, 17, 11 tokens
    for r in reqs:
        sched.submit(r)
    assert (sched.num_running, sched.num_waiting) == (0, 3)
    sched.step()
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    assert [r.row for r in reqs] == [0, 1, None]
    while not reqs[0].done:
        sched.step()
    # the row of the finished request is free in the same round, the waiting one takes it next round
    assert sched.num_running == 1 and 0 in sched._free
    sched.step()
    assert reqs[2].row == 0 and sched.num_running == 2
    sched.run_until_idle(max_rounds=500)
    assert [d.request_id for d in done][0] == reqs[0].request_id and len(done) == 3


def test_decode_clock_excludes_every_prefill(pair, monkeypatch):
    """A request's ``decode_seconds`` is its time from the end of its prefill to its end less
    every prefill chunk in between (those of requests admitted meanwhile, interleaved with its
    rounds); the clock's span over a run is the run's decode time: its wall time less the
    prefill chunks after the first prefill's end."""
    import time
    target, draft = pair
    engine = engine_for("vanilla", target, draft, rows=2, max_prefill_tokens=4)
    prefills, forward = [], engine.forward

    def slow_forward(name, mode, reqs):  # prefill chunks long enough to see in the clocks
        if not any(r.prefill for r in reqs.values()):
            return forward(name, mode, reqs)
        t0 = time.perf_counter()
        time.sleep(0.1)
        out = forward(name, mode, reqs)
        prefills.append((t0, time.perf_counter()))
        return out
    monkeypatch.setattr(engine, "forward", slow_forward)
    sched = Scheduler(engine, max_waiting=8)
    reqs = [request("vanilla", target, draft, i, False, []) for i in (2, 3, 5, 1)]  # prompts of 13, 6, 11, 8
    for r in reqs:
        sched.submit(r)
    start = time.perf_counter()
    sched.run_until_idle(max_rounds=2000)
    wall = time.perf_counter() - start
    assert all(r.error is None for r in reqs)
    assert len(prefills) == 3 + 1 + 2 + 2 and sched.prefill_seconds >= 0.8
    assert [r.rows[0].row.prefill_forwards for r in reqs] == [3, 1, 2, 2]
    overlapped = 0
    for r in reqs:
        inside = sum(b - a for a, b in prefills if r.admitted < a < r.finished)
        overlapped += inside > 0
        assert r.decode_seconds == pytest.approx(r.finished - r.admitted - inside, abs=0.03), r.request_id
    assert overlapped >= 1  # a request decoded while another one's prompt was prefilled
    span = max(r.decode_interval[1] for r in reqs) - min(r.decode_interval[0] for r in reqs)
    first = min(r.admitted for r in reqs)
    assert span == pytest.approx(wall - (first - start) - sum(b - a for a, b in prefills if a > first), abs=0.03)


def test_a_full_queue_counts_the_requests_that_wait(pair):
    """max_waiting=1: the refusal says 1 request waits, whether the rows are running (a request
    waits behind them) or free but not yet taken (two queued, one of them for the free row)."""
    target, draft = pair
    sched = Scheduler(engine_for("vanilla", target, draft, rows=1), max_waiting=1)
    reqs = [request("vanilla", target, draft, i, False, []) for i in range(4)]
    sched.submit(reqs[0])
    sched.submit(reqs[1])
    refusal = r"^1 request already waiting for a row \(max_waiting=1; 1 row, all taken\)$"
    with pytest.raises(QueueFull, match=refusal):
        sched.submit(reqs[2])
    sched.step()  # reqs[0] takes the row, reqs[1] waits behind it
    assert sched.num_running == 1 and sched.num_waiting == 1
    with pytest.raises(QueueFull, match=refusal):
        sched.submit(reqs[2])
    sched.run_until_idle(max_rounds=2000)
    assert all(r.error is None for r in reqs[:2])


def test_queue_bound_refuses_or_blocks(pair):
    target, draft = pair
    sched = Scheduler(engine_for("vanilla", target, draft, rows=1), max_waiting=2)
    reqs = [request("vanilla", target, draft, i, False, []) for i in range(5)]
    for r in reqs[:3]:  # one for the free row, two waiting
        assert sched.has_room
        sched.submit(r)
    assert not sched.has_room  # full: exactly max_waiting + free rows queued
    with pytest.raises(QueueFull, match=r"^2 requests already waiting for a row \(max_waiting=2; 1 row, all taken\)$"):
        sched.submit(reqs[3])  # the one for the free row does not wait (it was counted: 3)
    with pytest.raises(QueueFull):
        sched.submit(reqs[3], block=True, timeout=0.05)
    # a blocking submit goes in once the first request ends and the next one takes its row
    t = threading.Thread(target=sched.submit, args=(reqs[3],), kwargs={"block": True, "timeout": 60})
    t.start()
    while not reqs[0].done:
        assert t.is_alive()
        sched.step()
    t.join(60)  # the freed row makes room
    assert not t.is_alive() and reqs[3] in sched._waiting
    sched.run_until_idle(max_rounds=2000)
    assert all(r.error is None for r in reqs[:4])
    with pytest.raises(ValueError, match="cache tokens"):
        sched.submit(Request([1] * 70, reqs[4].program, capacity=80))


def test_a_request_may_use_a_whole_row(pair):
    """A request whose capacity is exactly a row's is admitted and decodes as alone; one token
    more is refused (naming both)."""
    target, draft = pair
    engine = engine_for("vanilla", target, draft, rows=1)
    sched = Scheduler(engine, max_waiting=1)
    cap = engine.capacity
    block_length = 4
    prompt = [5 + i % 80 for i in range(cap - 2 * block_length)]  # a whole block of generation, plus one of room
    cfg = DecodeConfig(block_length=block_length, strategy="static", max_new_tokens=block_length)
    need = check_prompt(prompt, target.config, block_length, block_length)
    assert need == cap
    with pytest.raises(ValueError, match=f"needs {cap + 1} cache tokens, a row holds {cap}"):
        sched.submit(Request(prompt, lambda row, tail: None, capacity=cap + 1))

    def program(row, tail):
        return VanillaRow(row, cfg, target.mask_token_id, [], 3).program(tail)
    req = sched.submit(Request(prompt, program, capacity=need))
    sched.run_until_idle(max_rounds=100)
    want = vanilla_generate_batch(target.model, [prompt], cfg, target.mask_token_id, [], seeds=[3])
    assert req.error is None and req.result == want.results[0].token_ids


def test_cancel_waiting_and_running_requests_frees_rows(pair):
    target, draft = pair
    sched = Scheduler(engine_for("exact", target, draft, rows=2), max_waiting=4)
    done = []
    reqs = [request("exact", target, draft, i, False, done) for i in (1, 3, 5)]
    for r in reqs:
        sched.submit(r)
    for _ in range(3):
        sched.step()
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert sched.cancel(reqs[2]) and reqs[2].cancelled and sched.num_waiting == 0  # waiting: at once
    assert sched.cancel(reqs[0])
    assert sched.num_running == 2  # a running request leaves before the next round
    sched.step()
    assert sched.num_running == 1 and reqs[0].cancelled and reqs[0].result is None
    assert not sched.cancel(reqs[0])  # already ended
    sched.run_until_idle(max_rounds=2000)
    assert sched.num_running == 0 and sched.finished == {"ok": 1, "error": 0, "cancelled": 2}
    # the survivor is unaffected, and the freed rows serve later requests correctly
    want = single("exact", target, draft, 3, False).token_ids
    assert finish(reqs[1].result, target.stop_ids, MAX_NEW[3]) == want
    later = request("exact", target, draft, 0, False, done)
    sched.submit(later)
    sched.run_until_idle(max_rounds=2000)
    assert finish(later.result, target.stop_ids, MAX_NEW[0]) == single("exact", target, draft, 0, False).token_ids


def test_a_failing_program_fails_only_its_request(pair):
    target, draft = pair
    sched = Scheduler(engine_for("vanilla", target, draft, rows=3), max_waiting=4)
    done = []
    reqs = [request("vanilla", target, draft, i, True, done) for i in range(3)]
    inner = reqs[1].program

    def broken(row, tail):
        prog = inner(row, tail)
        yield next(prog)
        raise RuntimeError("boom in request 1")
    reqs[1].program = broken
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle(max_rounds=2000)
    assert isinstance(reqs[1].error, RuntimeError) and sched.finished["error"] == 1
    for i in (0, 2):
        assert finish(reqs[i].result, target.stop_ids, MAX_NEW[i]) == single("vanilla", target, draft, i,
                                                                                True).token_ids


@pytest.mark.parametrize("where", ["forward", "step", "commit", "folded"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_a_failing_batched_forward_is_rerun_row_by_row(pair, monkeypatch, sampling, where):
    """A batched forward that fails because of one row (in the model, after its cache write; or
    in the rows' denoising step, after the noise draw) is undone (cache lengths; the noise is
    stateless) and re-run row by row: only that row's request fails, the others keep their
    single-run tokens and counters. ``commit``: the failing forward is a commit that writes the
    K/V of the poisoned row and of an innocent one (requests 0 and 5 share their prompt tail, so
    their commits share forwards): the innocent row's cache length must be rolled back before
    its re-run, or its next forwards read a block of stale slots. ``folded``: the same with
    folded commits, failing in the step after the forward (the rows' cached lengths were
    advanced already)."""
    from simsd.decoding.step import Step
    target, draft = pair
    poison = 123457  # a position no request reaches
    real_forward, real_steps = type(target.model).forward, Step.run_batch
    writes = []  # rows that wrote K/V in each poisoned forward
    last = [0]  # ... in the latest forward

    def forward(self, ids, positions, labels, mask_mode, cache=None, num_write=0, *args, **kwargs):
        out = real_forward(self, ids, positions, labels, mask_mode, cache, num_write, *args, **kwargs)
        nw = num_write.tolist() if isinstance(num_write, torch.Tensor) else [num_write] * ids.shape[0]
        last[0] = sum(1 for n in nw if n > 0)
        if bool((positions == poison).any()):
            writes.append(last[0])
            raise RuntimeError("poisoned row")
        return out

    def run_batch(steps, logits):
        out = real_steps(steps, logits)
        if any(getattr(s, "poisoned", False) for s in steps):
            writes.append(last[0])
            raise RuntimeError("poisoned row")
        return out
    sched = Scheduler(engine_for("vanilla", target, draft, rows=3), max_waiting=4)
    done = []
    which = [0, 5, 2] if where in ("commit", "folded") else [0, 1, 2]
    fold = where == "folded"
    reqs = [request("vanilla", target, draft, i, sampling, done, fold) for i in which]
    reqs[1].program = _with_poison(reqs[1].program, poison, where)
    monkeypatch.setattr(type(target.model), "forward", forward)
    monkeypatch.setattr(Step, "run_batch", staticmethod(run_batch))
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle(max_rounds=2000)
    monkeypatch.undo()
    assert isinstance(reqs[1].error, RuntimeError) and "poisoned" in str(reqs[1].error)
    if where in ("commit", "folded"):
        assert writes[0] >= 2  # the batched forward that failed wrote an innocent row's K/V too
    for k in (0, 2):
        i = which[k]
        want = single("vanilla", target, draft, i, sampling, fold)
        assert reqs[k].error is None
        assert finish(reqs[k].result, target.stop_ids, MAX_NEW[i]) == want.token_ids
        got = counters(reqs[k])  # the failed forward is not counted as one the row took part in
        assert got == {key: want.stats[key] for key in got}


def _with_poison(make, poison, where):
    """The program of ``make`` with its third denoising forward poisoned: ``poison`` as its last
    position (``forward``) or a mark on its step (``step``); ``commit``: its first commit forward
    (``poison`` as its last position); ``folded``: a mark on the step of its first folded
    commit."""
    def program(row, tail):
        prog = make(row, tail)
        fwd, seen = next(prog), 0
        while True:
            if where in ("commit", "folded"):
                if fwd.num_write and (fwd.step is None) == (where == "commit") and not seen:
                    seen = 1
                    if where == "commit":
                        fwd.positions = list(fwd.positions)
                        fwd.positions[-1] = poison
                    else:
                        fwd.step.poisoned = True
            elif fwd.step is not None:
                seen += 1
                if seen == 3:
                    if where == "forward":
                        fwd.positions = list(fwd.positions)
                        fwd.positions[-1] = poison
                    else:
                        fwd.step.poisoned = True
            value = yield fwd
            fwd = prog.send(value)
    return program


def test_background_thread_drains_on_stop(pair):
    target, draft = pair
    sched = Scheduler(engine_for("exact", target, draft, rows=2), max_waiting=8)
    finished = threading.Event()
    done = []

    def on_finish(req):
        done.append(req)
        if len(done) == 4:
            finished.set()
    reqs = [request("exact", target, draft, i, False, done) for i in range(4)]
    for r in reqs:
        r.on_finish = on_finish
    sched.start()
    for r in reqs:
        sched.submit(r)
    assert sched.stop(drain=True, timeout=120)  # every submitted request finishes before the thread ends
    assert finished.is_set() and all(r.error is None and not r.cancelled for r in reqs)
    with pytest.raises(SchedulerClosed):
        sched.submit(request("exact", target, draft, 0, False, done))
    for i, r in enumerate(reqs):
        assert finish(r.result, target.stop_ids, MAX_NEW[i]) == single("exact", target, draft, i, False).token_ids


def test_stop_without_drain_cancels(pair):
    target, draft = pair
    sched = Scheduler(engine_for("vanilla", target, draft, rows=1), max_waiting=8)
    reqs = [request("vanilla", target, draft, i, False, []) for i in range(3)]
    sched.start()
    for r in reqs:
        sched.submit(r)
    assert sched.stop(drain=False, timeout=60)
    assert all(r.done for r in reqs) and sched.num_running == 0 and sched.num_waiting == 0
    assert sum(r.cancelled for r in reqs) >= 2


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_graph_engine_shapes_with_continuous_batching(pair, mode, monkeypatch):
    """The CUDA-graph engine (every forward covers all rows, free ones included, at a few padded
    shapes; capture replaced by eager replay on the CPU) admits and retires rows as well."""
    import simsd.engine.graphs
    monkeypatch.setattr(simsd.engine.graphs, "cuda_capture", simsd.engine.graphs.eager_capture)
    monkeypatch.setattr(simsd.engine.graphs, "check_graphable", lambda model: None)
    target, draft = pair
    target = with_stop(target, draft, mode)
    singles = [single(mode, target, draft, i, False) for i in range(len(PROMPTS))]
    models = {"target": target.model} if mode == "vanilla" else {"target": target.model, "draft": draft.model}
    engine = BatchEngine(models, 4, 3, capacity=64, margin=(4 + 2) * 4, cuda_graphs=True)
    done = []
    sched = Scheduler(engine, max_waiting=8)
    reqs = [request(mode, target, draft, i, False, done) for i in range(len(PROMPTS))]
    run_staggered(sched, reqs, ARRIVALS["staggered"])
    for i, req in enumerate(reqs):
        assert finish(req.result, target.stop_ids, MAX_NEW[i]) == singles[i].token_ids, i
    runner = engine.graphs["target"]
    assert runner.graphs <= 2 * 6 and runner.replays > runner.graphs


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
@pytest.mark.parametrize("chunk, pages", [(None, None), (4, None), (None, "small")], ids=["whole", "chunked", "pages"])
def test_a_follower_given_the_leaders_inputs_runs_the_same_rounds(pair, mode, chunk, pages):
    """What ``simsd serve --tp`` relies on (simsd/engine/tp_rounds.py): a scheduler whose rounds
    take a leader's published inputs (:meth:`Scheduler.run_round` with the requests rebuilt)
    runs the leader's rounds: the same rows, cancellations and results, with staggered arrivals,
    a waiting and a running request cancelled, 3 rows for 6 requests; with chunked prefill too
    (the prefill chunks are rounds: the same picks on both sides); and over a page pool too small
    for every row (the same preemptions on both sides: a follower drops its preempted copy, the
    leader admits the request again and publishes it)."""
    target, draft = pair
    num_pages = None if pages is None else {"vanilla": 10, "exact": 14}[mode]  # a row needs up to 9 or 13
    done = []
    followers = {}  # leader's request -> the follower's copy

    def publish(cancels, admits):
        for r in admits:
            followers[r] = request(mode, target, draft, int(r.request_id), True, [])
        follower.run_round([followers[r] for r in cancels], [followers[r] for r in admits])
    leader = Scheduler(engine_for(mode, target, draft, rows=3, max_prefill_tokens=chunk, num_pages=num_pages),
                       max_waiting=8, publish=publish)
    follower = Scheduler(engine_for(mode, target, draft, rows=3, max_prefill_tokens=chunk, num_pages=num_pages),
                         max_waiting=0)
    follower.requeue = False  # as simsd.engine.tp_rounds.follow sets it
    reqs = [request(mode, target, draft, i, True, done) for i in range(len(PROMPTS))]
    arrivals, r = [0, 0, 2, 3, 5, 9], 0
    while r < 2000 and (r <= max(arrivals) or leader.num_running or leader.num_waiting):
        for k, at in enumerate(arrivals):
            if at == r:
                leader.submit(reqs[k])
        if r == 6:
            leader.cancel(reqs[1])  # running since round 0
            leader.cancel(reqs[5])  # not yet submitted: a no-op on both sides
        if r == 9:
            leader.cancel(reqs[5])  # waiting
        leader.step()
        assert follower.rounds == leader.rounds and follower._running.keys() == leader._running.keys(), r
        r += 1
    assert [q.cancelled for q in reqs] == [False, True, False, False, False, True]
    assert set(followers) == set(reqs) - {reqs[5]}  # a request cancelled while waiting never reached the follower
    for q, f in followers.items():
        assert (f.result, f.cancelled, f.error) == (q.result, q.cancelled, q.error) and f.row == q.row
    assert follower.rounds == leader.rounds > 0 and follower.num_running == 0 and sorted(follower._free) == [0, 1, 2]
    assert follower.preemptions == leader.preemptions and (leader.preemptions > 0) == (pages is not None)
    assert follower.num_waiting == 0


def test_a_leader_whose_publish_fails_halts(pair):
    """A tensor-parallel leader whose broadcast fails (a rank is gone) fails the requests it was
    admitting, the running and the waiting ones with that error, takes no new requests and keeps
    the error (``simsd serve --tp`` then exits)."""
    target, draft = pair
    gone = ConnectionError("rank 1 is gone")
    published = []

    def publish(cancels, admits):
        published.append(len(admits))
        if len(published) == 3:
            raise gone
    sched = Scheduler(engine_for("vanilla", target, draft, rows=1), max_waiting=8, publish=publish)
    finished = threading.Event()
    done = []

    def on_finish(req):
        done.append(req)
        if len(done) == 3:
            finished.set()
    reqs = [request("vanilla", target, draft, i, False, done) for i in range(3)]
    for r in reqs:
        r.on_finish = on_finish
        sched.submit(r)
    sched.start()
    assert finished.wait(120)
    assert all(r.error is gone for r in reqs) and sched.error is gone and sched.closed
    with pytest.raises(SchedulerClosed):
        sched.submit(request("vanilla", target, draft, 0, False, []))
    assert sched.stop(timeout=60) and sched.num_running == 0 and sched.num_waiting == 0


def test_stop_without_drain_cancels_the_requests_being_admitted(pair):
    """``stop(drain=False)`` while a round is admitting requests (taken off the queue, in no row
    yet: here during a leader's publish) cancels them too, not only the running and waiting ones."""
    target, draft = pair
    stopper = []

    def publish(cancels, admits):
        if admits and not stopper:
            t = threading.Thread(target=sched.stop, kwargs={"drain": False, "timeout": 60})
            t.start()
            stopper.append(t)
            while not sched.closed:
                time.sleep(0.001)
    sched = Scheduler(engine_for("vanilla", target, draft, rows=2), max_waiting=8, publish=publish)
    reqs = [request("vanilla", target, draft, i, False, []) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    sched.start()
    end = time.monotonic() + 60
    while not stopper and time.monotonic() < end:
        time.sleep(0.01)
    stopper[0].join(60)
    assert not sched.alive and all(r.done and r.cancelled for r in reqs), [(r.done, r.cancelled) for r in reqs]
    assert sched.num_running == 0 and sched.num_waiting == 0
