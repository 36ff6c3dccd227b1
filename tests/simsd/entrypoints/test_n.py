"""``SamplingParams(n=k)`` in the Python API: k independent choices, choice i sampled with
``choice_seed(seed, i)``, each equal to the n=1 request of its seed whatever else is in flight
(the bundled pair, float32, CPU)."""
import pytest

from simsd import LLM, ParamError, SamplingParams
from simsd.config.request import MAX_N, SEED_MAX, choice_seed, split_choices

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm():
    llm = LLM(mode="exact", dtype="float32", device="cpu", batch_size=3)
    yield llm
    assert llm.shutdown(timeout=60)


def test_choice_seeds():
    """Choice 0 keeps the request's seed; the others are distinct, in range, and a pure function
    of (seed, index) (the documented BLAKE2b derivation)."""
    import hashlib
    seeds = [choice_seed(7, i) for i in range(MAX_N)]
    assert seeds[0] == 7 and len(set(seeds)) == MAX_N and all(0 <= s <= SEED_MAX for s in seeds)
    assert seeds[1] == int.from_bytes(hashlib.blake2b(b"simsd-choice:7:1", digest_size=8).digest(), "big") >> 1
    assert choice_seed(8, 1) != seeds[1] and choice_seed(SEED_MAX, 3) <= SEED_MAX
    split = split_choices(SamplingParams(n=3, seed=7, temperature=0.8))
    assert [p.seed for p in split] == seeds[:3] and {p.n for p in split} == {1}
    fresh = split_choices(SamplingParams(n=2, temperature=0.8))
    assert fresh[1].seed == choice_seed(fresh[0].seed, 1)
    assert SamplingParams(n=MAX_N).n == MAX_N
    with pytest.raises(ParamError, match=rf"n must be an integer in \[1, {MAX_N}\], got {MAX_N + 1}") as err:
        SamplingParams(n=MAX_N + 1)
    assert err.value.param == "n"


def test_greedy_n_gives_identical_choices(llm):
    """Greedy decoding draws nothing at random: every choice is the n=1 output."""
    (one,) = llm.generate(PROMPT, SamplingParams(max_tokens=12))
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=12, n=2))
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.text for c in out.outputs] == [one.text, one.text] and out.text == one.text
    assert [c.token_ids for c in out.outputs] == [one.token_ids] * 2
    assert out.outputs[0].token_ids is out.token_ids and len(out.other_choices) == 1
    assert one.outputs == [one.outputs[0]] and one.other_choices == ()


def test_sampled_choices_equal_single_requests_of_their_seeds(llm):
    """Sampled n=3 beside other requests (3 rows, 5 requests: choices share rounds with each other
    and with the neighbours): choice i is the n=1 request of choice_seed(seed, i), run alone."""
    params = SamplingParams(max_tokens=16, temperature=1.2, seed=11, n=3)
    other = SamplingParams(max_tokens=9, temperature=0.9, seed=5)
    out, neighbour = llm.generate([PROMPT, "def add(a, b):"], [params, other])
    alone = [llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.2, seed=choice_seed(11, i)))[0]
             for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    assert [c.text for c in out.outputs] == [a.text for a in alone]
    assert [c.finish_reason for c in out.outputs] == [a.finish_reason for a in alone]
    assert out.seed == 11 and [o.seed for o in out.other_choices] == [choice_seed(11, 1), choice_seed(11, 2)]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the seeds differ, so do the samples
    assert [o.request_id for o in out.other_choices] == [f"{out.request_id}-1", f"{out.request_id}-2"]
    assert neighbour.token_ids == llm.generate("def add(a, b):", other)[0].token_ids


def test_a_request_without_seed_reports_the_one_drawn(llm):
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, n=2))
    assert out.other_choices[0].seed == choice_seed(out.seed, 1)
    (replay,) = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=out.seed))
    assert [c.token_ids for c in replay.outputs] == [c.token_ids for c in out.outputs]


def test_submit_and_stream_run_one_completion(llm):
    for run in (lambda p: llm.submit(PROMPT, p), lambda p: list(llm.stream(PROMPT, p))):
        with pytest.raises(ParamError, match=r"n=2: LLM.submit and LLM.stream run one completion") as err:
            run(SamplingParams(max_tokens=4, n=2))
        assert err.value.param == "n"


def test_chat_takes_n(llm):
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2)
    (out,) = llm.chat(messages, params)
    alone = [llm.chat(messages, SamplingParams(max_tokens=8, temperature=1.0, seed=choice_seed(3, i)))[0]
             for i in range(2)]
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
