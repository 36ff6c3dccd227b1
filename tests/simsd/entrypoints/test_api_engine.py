"""The Python API's engine options and driving (simsd.LLM): the scheduler on the calling thread
(what the command line uses), decode time without prefills, invariant numerics, max_gamma and
the draft's threshold, role-marker stops of chat prompts, refused combinations."""
import time

import pytest
import torch

from simsd import LLM, ParamError, SamplingParams
from simsd.engine.scheduler import decode_span
from simsd.speculative import SpecConfig, SpeculativeDecoder
from tests.simsd.entrypoints.serving import single

PROMPTS = [[11 + i, 12, 13, 14 + i] * (1 + i % 3) for i in range(5)]


@pytest.fixture(scope="module")
def exact():
    llm = LLM(mode="exact", dtype="float32", device="cpu", batch_size=2, scheduler_thread=False)
    yield llm
    assert llm.shutdown()


def params(n=5, **kw):
    return [SamplingParams(max_tokens=6 + 3 * i, temperature=1.0, seed=40 + i, **kw) for i in range(n)]


def test_calling_thread_runs_the_same_rounds_every_time(exact):
    """Without a scheduling thread, generate queues every request before the first round: the
    same rows share every forward in every run, and the outputs equal single runs and a
    threaded LLM's."""
    assert not exact.scheduler.alive
    log = []
    forward = exact.engine.forward

    def logged(name, mode, reqs):
        log.append((name, mode, tuple(sorted(reqs))))
        return forward(name, mode, reqs)
    exact.engine.forward = logged
    try:
        runs = []
        for _ in range(2):
            log.clear()
            runs.append((exact.generate(PROMPTS, params()), list(log)))
    finally:
        del exact.engine.forward
    (a, log_a), (b, log_b) = runs
    assert log_a == log_b and any(len(rows) == 2 for _, _, rows in log_a)  # two rows shared forwards
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert not exact.scheduler.alive  # no thread was started
    threaded = LLM(exact.target, exact.draft, "exact", batch_size=3)
    try:
        c = threaded.generate(PROMPTS, params())
    finally:
        threaded.shutdown()
    for p, sp, x, y in zip(PROMPTS, params(), a, c):
        assert x.token_ids == y.token_ids == single(exact, p, sp, sp.seed).token_ids


def test_decode_seconds_leave_out_every_prefill(exact, monkeypatch):
    """A run's decode time (the outputs' ``decode_span``) and each request's
    ``decode_seconds`` exclude the prefill forwards, also those that run while others decode."""
    forward, slowed = exact.engine.forward, []

    def slow(name, mode, reqs):
        if any(r.prefill for r in reqs.values()):
            time.sleep(0.25)
            slowed.append(name)
        return forward(name, mode, reqs)
    monkeypatch.setattr(exact.engine, "forward", slow)
    start = time.perf_counter()
    outs = exact.generate(PROMPTS, params())
    wall = time.perf_counter() - start
    span = decode_span(outs)
    assert len(slowed) >= 5 and 0 < span <= wall - len(slowed) * 0.25
    for o in outs:
        a, b = o.decode_interval
        assert o.stats["decode_seconds"] == pytest.approx(b - a) and b - a <= span
        assert o.stats["tokens_per_second"] == pytest.approx(o.stats["new_tokens"] / (b - a))


def test_generate_iter_yields_in_order_and_cancels_on_close(exact):
    it = exact.generate_iter(PROMPTS, params())
    first = next(it)
    assert first.token_ids == single(exact, PROMPTS[0], params()[0], 40).token_ids
    it.close()  # the others are cancelled, their rows freed at the next round
    exact.scheduler.step()
    assert exact.scheduler.num_running == 0 and exact.scheduler.num_waiting == 0
    chat = [{"role": "user", "content": "Reverse a list."}]  # streaming runs the rounds here too
    pieces = list(exact.stream(chat, params()[3]))
    assert len(pieces) > 1 and "".join(pieces) == exact.generate(chat, params()[3])[0].text
    assert not exact.scheduler.alive


def test_calling_thread_with_a_full_queue_runs_rounds_until_there_is_room(exact):
    """Without a scheduling thread and without waiting room (``max_waiting=0``), a generate of
    more prompts than rows runs rounds on the calling thread until a row frees, then queues the
    next: every prompt is answered as in a roomier LLM."""
    llm = LLM(exact.target, exact.draft, "exact", batch_size=1, max_waiting=0, scheduler_thread=False)
    outs = llm.generate(PROMPTS[:3], params(3))
    assert [o.token_ids for o in outs] == [o.token_ids for o in exact.generate(PROMPTS[:3], params(3))]
    assert llm.shutdown()


def test_max_gamma_bounds_and_defaults_the_requests(exact):
    llm = LLM(exact.target, exact.draft, "exact", batch_size=2, max_gamma=2, scheduler_thread=False)
    assert llm.engine.caches["target"].max_len - llm.engine.capacity == (2 + 2) * 4
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10))[0]
    assert out.stats["gamma"] == 2
    cfg = SpeculativeDecoder(exact.target, exact.draft, __import__("simsd").DecodeConfig(max_new_tokens=10),
                             SpecConfig(gamma=2))
    assert out.token_ids == cfg.generate(PROMPTS[1]).token_ids
    assert llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, gamma=2))[0].token_ids == out.token_ids  # the edge
    with pytest.raises(ParamError, match="max_gamma 2") as err:
        llm.generate(PROMPTS[1], SamplingParams(gamma=3))
    assert err.value.param == "gamma"
    # without max_gamma a request may ask for the whole block (gamma = the block length = 4), not more
    full = exact.generate(PROMPTS[1], SamplingParams(max_tokens=10, gamma=4))[0]
    dec = SpeculativeDecoder(exact.target, exact.draft, __import__("simsd").DecodeConfig(max_new_tokens=10),
                             SpecConfig(gamma=4))
    assert full.stats["gamma"] == 4 and full.token_ids == dec.generate(PROMPTS[1]).token_ids
    with pytest.raises(ValueError, match=r"max_gamma must be in \[1, 4\] \(the block length\), got 5"):
        LLM(exact.target, exact.draft, "exact", max_gamma=5)
    with pytest.raises(ValueError, match="max_gamma: used by the paper and exact modes only"):
        LLM(exact.target, mode="vanilla", max_gamma=2)


def test_draft_threshold_reaches_the_draft(exact):
    sp = SamplingParams(max_tokens=12, draft_strategy="dynamic", draft_threshold=0.01)
    out = exact.generate(PROMPTS[2], sp)[0]
    from simsd import DecodeConfig
    dec = SpeculativeDecoder(exact.target, exact.draft, DecodeConfig(max_new_tokens=12),
                             SpecConfig(draft_strategy="dynamic", draft_threshold=0.01))
    want = dec.generate(PROMPTS[2])
    assert out.token_ids == want.token_ids and out.stats["draft_forwards"] == want.stats["draft_forwards"]
    default = exact.generate(PROMPTS[2], SamplingParams(max_tokens=12, draft_strategy="dynamic"))[0]
    assert default.stats["draft_forwards"] != out.stats["draft_forwards"]  # 0.01, not the default 0.9
    with pytest.raises(ParamError, match="draft_threshold of the dynamic strategy is a confidence in") as err:
        SamplingParams(draft_strategy="dynamic", draft_threshold=3)
    assert err.value.param == "draft_threshold"
    with pytest.raises(ParamError, match="draft_threshold applies to the dynamic and entropy"):
        SamplingParams(draft_threshold=0.5)  # the draft runs the target's static strategy
    vanilla = LLM(exact.target, mode="vanilla", batch_size=1, scheduler_thread=False)
    with pytest.raises(ParamError, match="draft_threshold: used by the paper and exact modes only"):
        vanilla.generate(PROMPTS[0], SamplingParams(strategy="dynamic", draft_threshold=0.5))


def test_invariant_and_refused_engine_combinations(exact):
    llm = LLM(str(exact.target.path), mode="vanilla", batch_size=1, invariant=True, scheduler_thread=False)
    assert llm.target.model.invariant and not exact.target.model.invariant
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=8))[0].token_ids == \
        single(exact, PROMPTS[0], SamplingParams(max_tokens=8), 0).token_ids
    with pytest.raises(ValueError, match="invariant is not available with cuda_graphs"):
        LLM(exact.target, mode="vanilla", invariant=True, cuda_graphs=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graphs needs CUDA devices, got cpu"):
            LLM(exact.target, mode="vanilla", cuda_graphs=True)
    with pytest.raises(ValueError, match="tp 2: this process group has 1 rank"):
        LLM(exact.target, mode="vanilla", tp=2)
    with pytest.raises(ValueError, match="fold_commit is not combined with optimistic=True"):
        LLM(exact.target, exact.draft, "exact", fold_commit=True, optimistic=True)


def test_chat_prompts_stop_at_a_new_turn(exact):
    """A chat prompt (through the template) also stops at the template's role markers, as in
    ``simsd generate``; text and id prompts do not, nor does a request with ignore_eos. (The
    tiny model never starts a turn: a token it does write stands in for the marker.)"""
    from simsd.entrypoints.encoding import role_markers
    llm = LLM(exact.target, mode="vanilla", batch_size=2, scheduler_thread=False)
    tok = llm.tokenizer
    builder = llm.requests  # the request builder holds the template's stop ids
    assert builder.template_stop_ids == role_markers(tok) and \
        tok.convert_ids_to_tokens(builder.template_stop_ids) == ["<|im_start|>"]
    chat, ids = [{"role": "user", "content": "Reverse a list."}], [11, 12, 13, 14, 15]
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    c, r = (llm.generate(p, free)[0].token_ids for p in (chat, ids))
    common = [t for t in c[2:] if t in r and t not in llm.target.stop_ids]
    assert common, "no token written after both prompts"
    marker = common[0]
    builder.template_stop_ids = [marker]
    p = SamplingParams(max_tokens=24)
    stopped = llm.generate(chat, p)[0]
    k = c.index(marker)
    assert stopped.token_ids == c[:k + 1] and (stopped.finish_reason, stopped.stop_reason) == ("stop", marker)
    plain = llm.generate(ids, p)[0].token_ids  # not a stop for ids
    assert marker in plain and plain == r[:len(plain)]
    assert llm.generate(chat, free)[0].token_ids == c  # nor with ignore_eos
