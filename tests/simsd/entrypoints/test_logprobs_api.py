"""``SamplingParams(logprobs=k, prompt_logprobs=k)`` in the Python API (vLLM's shapes): per generated
token ``{token_id: Logprob(logprob, rank, decoded_token)}`` of the token and the top k,
``cumulative_logprob``, ``prompt_logprobs`` with None first; exact mode (with ``invariant``
numerics) reports vanilla's, bit for bit, with a draft model and with ``draft="self"``; streamed
deltas carry their tokens' entries; bad values are refused naming the field (the bundled pair,
float32, CPU)."""
import math

import pytest

from simsd import LLM, ParamError, SamplingParams
from simsd.decoding.logprobs import Logprob

PROMPTS = ["Once upon a time", [{"role": "user", "content": "Write a function that reverses a list."}]]


@pytest.fixture(scope="module")
def llms():
    made = {name: LLM(mode=mode, draft=draft, invariant=True, dtype="float32", device="cpu", batch_size=3,
                      scheduler_thread=False)
            for name, mode, draft in (("vanilla", "vanilla", None), ("exact", "exact", None),
                                      ("self", "exact", "self"), ("paper", "paper", None))}
    yield made
    for llm in made.values():
        assert llm.shutdown(timeout=60)


PARAMS = [SamplingParams(max_tokens=14, logprobs=2, prompt_logprobs=1),
          SamplingParams(max_tokens=14, logprobs=3, temperature=0.9, seed=4, n=2)]


def test_exact_and_self_speculation_report_vanillas_logprobs(llms):
    want = llms["vanilla"].generate(PROMPTS * 2, PARAMS * 2)
    for name in ("exact", "self"):
        got = llms[name].generate(PROMPTS * 2, PARAMS * 2)
        for g, w in zip(got, want):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            assert [c.logprobs for c in g.outputs] == [c.logprobs for c in w.outputs], name
            assert [c.cumulative_logprob for c in g.outputs] == [c.cumulative_logprob for c in w.outputs]
            assert g.prompt_logprobs == w.prompt_logprobs


def test_vllm_shapes(llms):
    llm = llms["exact"]
    tok = llm.get_tokenizer()
    (out,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, logprobs=2, prompt_logprobs=3, temperature=0.8,
                                                     seed=1, n=2))
    assert len(out.outputs) == 2
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for t, d in zip(c.token_ids, c.logprobs):
            assert next(iter(d)) == t and 2 <= len(d) <= 3  # the token first, then the top 2
            assert all(isinstance(v, Logprob) and v.decoded_token == tok.decode([i]) for i, v in d.items())
            top = sorted((v for i, v in d.items() if v.rank <= 2), key=lambda v: v.rank)
            assert [v.rank for v in top] == [1, 2] and top[0].logprob >= top[1].logprob
            assert d[t].logprob <= top[0].logprob and (d[t].rank <= 2) == (d[t].logprob >= top[1].logprob)
        assert math.isclose(c.cumulative_logprob, sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)))
    assert out.outputs[0].logprobs != out.outputs[1].logprobs  # the choices' own tokens
    p = out.prompt_logprobs
    assert len(p) == len(out.prompt_token_ids) and p[0] is None
    assert all(next(iter(d)) == t for t, d in zip(out.prompt_token_ids[1:], p[1:]))
    assert all(len(d) in (3, 4) for d in p[1:])


def test_off_by_default_and_in_a_batch_with_requests_that_ask(llms):
    llm = llms["exact"]
    plain, asked = llm.generate([PROMPTS[0]] * 2, [SamplingParams(max_tokens=9),
                                                   SamplingParams(max_tokens=9, logprobs=0)])
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    assert plain.prompt_logprobs is None
    assert plain.token_ids == asked.token_ids  # asking changes no token
    assert [list(d) for d in asked.outputs[0].logprobs] == [[t] for t in asked.token_ids]


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(llms):
    llm = llms["vanilla"]
    (full,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, logprobs=1, ignore_eos=True))
    stop = full.text[4:6]
    (cut,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, logprobs=1, ignore_eos=True, stop=[stop]))
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(full.token_ids)
    assert cut.outputs[0].logprobs == full.outputs[0].logprobs[:len(cut.token_ids)]


def test_streamed_deltas_carry_their_tokens_logprobs(llms):
    llm = llms["self"]
    params = SamplingParams(max_tokens=12, logprobs=2, temperature=0.7, seed=8)
    handle = llm.submit(PROMPTS[0], params)
    ids, entries, out = [], [], None
    for kind, payload in handle.events(timeout=120):
        if kind == "delta":
            ids += payload[1]
            entries += payload[2]
        else:
            out = payload
    assert ids == out.token_ids and entries == out.logprobs


def test_paper_mode_reports_every_token(llms):
    (out,) = llms["paper"].generate(PROMPTS[0], SamplingParams(max_tokens=12, logprobs=1))
    assert len(out.outputs[0].logprobs) == len(out.token_ids)
    assert all(d[t].logprob <= 0 for t, d in zip(out.token_ids, out.outputs[0].logprobs))


@pytest.mark.parametrize("name,value", [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21),
                                        ("prompt_logprobs", 1.5), ("logprobs", True)])
def test_bad_values_are_refused_naming_the_field(name, value):
    with pytest.raises(ParamError, match=name) as exc:
        SamplingParams(**{name: value})
    assert exc.value.param == name
