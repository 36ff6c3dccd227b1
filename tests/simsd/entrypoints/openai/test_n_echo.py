"""``n`` and ``echo`` on the OpenAI-compatible server (in-process, bundled pair, float32, CPU):
``n`` choices per prompt in OpenAI's order, choice i of the request's seed equal to the n=1
request of ``choice_seed(seed, i)``, usage counting each prompt once; streamed chunks name their
choice; ``echo`` puts the prompt's text before each completion's."""
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from simsd.config.request import choice_seed  # noqa: E402
from tests.simsd.entrypoints import serving  # noqa: E402
from tests.simsd.entrypoints.serving import CHAT, IDS, NAME, TIMEOUT  # noqa: E402


def post(url, path, **body):
    r = serving.post(url, path, **body)
    assert r.status_code == 200, r.text
    return r.json()


def events(url, path, **body) -> list:
    """The JSON chunks of a streamed request (``[DONE]`` last, left out)."""
    with httpx.stream("POST", url + path, json={"model": NAME, "stream": True, **body}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def text_of(choice) -> str:
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_greedy_n_gives_identical_choices_and_counts_the_prompt_once(url):
    one = post(url, "/v1/completions", prompt=IDS, max_tokens=8)
    r = post(url, "/v1/completions", prompt=IDS, max_tokens=8, n=2)
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["text"] for c in r["choices"]] == [one["choices"][0]["text"]] * 2
    tokens = one["usage"]["completion_tokens"]
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 2 * tokens, "total_tokens": 5 + 2 * tokens}


@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": IDS}), ("/v1/chat/completions",
                                                                              {"messages": CHAT})])
def test_sampled_choices_are_the_n1_requests_of_their_seeds(url, path, prompt):
    sampled = {"max_tokens": 12, "temperature": 1.2}
    r = post(url, path, **prompt, **sampled, n=3, seed=9)
    seeds = [choice_seed(9, i) for i in range(3)]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["simsd"]["seed"] for c in r["choices"]] == seeds
    singles = [post(url, path, **prompt, **sampled, seed=s) for s in seeds]
    assert [text_of(c) for c in r["choices"]] == [text_of(s["choices"][0]) for s in singles]
    assert len({text_of(c) for c in r["choices"]}) > 1
    assert r["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert r["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]


def test_several_prompts_times_n_in_openais_order(url):
    prompts = [[11, 12, 13], [21, 22, 23, 24]]
    r = post(url, "/v1/completions", prompt=prompts, max_tokens=6, temperature=1.0, seed=4, n=2)
    seeds = [c["simsd"]["seed"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3] and seeds == [4, choice_seed(4, 1)] * 2
    for i, c in enumerate(r["choices"]):  # choice i: prompt i // 2, seed of choice i % 2
        single = post(url, "/v1/completions", prompt=prompts[i // 2], max_tokens=6, temperature=1.0, seed=seeds[i])
        assert c["text"] == single["choices"][0]["text"]
    assert r["usage"]["prompt_tokens"] == 7


def test_a_request_without_seed_reports_the_one_drawn(url):
    r = post(url, "/v1/completions", prompt=IDS, max_tokens=6, temperature=1.0, n=2)
    s0, s1 = (c["simsd"]["seed"] for c in r["choices"])
    assert s1 == choice_seed(s0, 1)


@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": IDS}), ("/v1/chat/completions",
                                                                              {"messages": CHAT})])
def test_streamed_chunks_carry_their_choice_index(url, path, prompt):
    sampled = {"max_tokens": 16, "temperature": 1.2, "seed": 2, "n": 2}
    whole = post(url, path, **prompt, **sampled)
    chunks = events(url, path, **prompt, **sampled, stream_options={"include_usage": True})
    got = {0: "", 1: ""}
    for ch in chunks:
        for c in ch["choices"]:
            got[c["index"]] += c["text"] if "text" in c else c["delta"].get("content") or ""
    assert [got[0], got[1]] == [text_of(c) for c in whole["choices"]]
    finals = [c for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert sorted(c["index"] for c in finals) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    if "messages" in prompt:
        assert [c["index"] for c in chunks[0]["choices"]] == [0, 1]  # the role chunk opens both


@pytest.mark.parametrize("body,words", [
    ({"n": 17}, "n must be an integer in [1, 16], got 17"),
    ({"n": 16, "prompt": [IDS] * 5}, "5 prompts x n=16 = 80 completions in one request, but this server holds at "
                                     "most 68 at once"),
])
def test_too_many_choices_are_400_naming_n(url, body, words):
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, **body},
                   timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n" and words in r.json()["error"]["message"]


def test_the_openai_client_asks_for_two_completions(url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    r = client.completions.create(model=NAME, prompt="Once upon a time", n=2, max_tokens=8, temperature=0.8,
                                  seed=1)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.model_extra["simsd"]["seed"] for c in r.choices] == [1, choice_seed(1, 1)]


def test_echo_puts_the_prompt_before_each_completion(llm, url):
    plain = post(url, "/v1/completions", prompt="Once upon a time", max_tokens=8)["choices"][0]["text"]
    r = post(url, "/v1/completions", prompt="Once upon a time", max_tokens=8, echo=True, n=2)
    assert [c["text"] for c in r["choices"]] == ["Once upon a time" + plain] * 2
    ids = post(url, "/v1/completions", prompt=IDS, max_tokens=8)["choices"][0]["text"]
    r = post(url, "/v1/completions", prompt=IDS, max_tokens=8, echo=True)
    assert r["choices"][0]["text"] == llm.tokenizer.decode(IDS) + ids
    assert post(url, "/v1/completions", prompt=IDS, max_tokens=8, echo=False)["choices"][0]["text"] == ids
    chunks = events(url, "/v1/completions", prompt="Once upon a time", max_tokens=8, echo=True)
    assert chunks[0]["choices"][0]["text"] == "Once upon a time"
    assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == "Once upon a time" + plain


def test_echo_with_max_tokens_0_is_refused(url):
    """OpenAI's echo with max_tokens 0 returns the prompt only; simsd generates at least one token
    (max_tokens >= 1), so it is a 400 naming max_tokens."""
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 0, "echo": True},
                   timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
