"""Log-probabilities on the OpenAI-compatible server (in-process, bundled pair, exact mode, float32,
CPU): OpenAI's client examples with ``logprobs`` and ``n=2`` run unchanged, the numbers are the
Python API's (:attr:`simsd.RequestOutput.logprobs`), streamed ones equal the whole response's,
``echo`` with ``logprobs`` scores the prompt as lm-eval's ``local-completions`` reads it, and bad
values are 400s naming the field."""
import math

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from simsd import SamplingParams  # noqa: E402
from tests.simsd.entrypoints.openai.test_n_echo import CHAT, NAME, TIMEOUT, events, post  # noqa: E402

PROMPT = "Once upon a time"


def client(url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def api_choices(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params))[0].outputs


def test_openai_completions_example_with_logprobs_and_n2(llm, url):
    r = client(url).completions.create(model=NAME, prompt=PROMPT, n=2, max_tokens=8, temperature=0.8, seed=1,
                                       logprobs=3)
    want = api_choices(llm, PROMPT, n=2, max_tokens=8, temperature=0.8, seed=1, logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c, w in zip(r.choices, want):
        lp = c.logprobs
        assert lp.token_logprobs == [d[t].logprob for t, d in zip(w.token_ids, w.logprobs)]
        assert lp.tokens == [d[t].decoded_token for t, d in zip(w.token_ids, w.logprobs)]
        assert "".join(lp.tokens) == c.text
        assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]
        for top, t, d in zip(lp.top_logprobs, w.token_ids, w.logprobs):
            assert 3 <= len(top) <= 4 and top[d[t].decoded_token] == d[t].logprob  # the token and the top 3
            assert max(top.values()) == max(v.logprob for v in d.values())
        assert math.isclose(sum(lp.token_logprobs), w.cumulative_logprob, rel_tol=1e-12)
    assert r.choices[0].text != r.choices[1].text


def test_openai_chat_example_with_logprobs_and_n2(llm, url):
    r = client(url).chat.completions.create(model=NAME, messages=CHAT, n=2, max_tokens=8, temperature=0.8, seed=3,
                                            logprobs=True, top_logprobs=2)
    want = llm.chat(CHAT, SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=3, logprobs=2))[0].outputs
    for c, w in zip(r.choices, want):
        content = c.logprobs.content
        assert [x.logprob for x in content] == [d[t].logprob for t, d in zip(w.token_ids, w.logprobs)]
        assert "".join(x.token for x in content) == c.message.content
        for x, t, d in zip(content, w.token_ids, w.logprobs):
            assert x.bytes == list(x.token.encode())
            assert [y.logprob for y in x.top_logprobs] == sorted((v.logprob for v in d.values() if v.rank <= 2),
                                                                 reverse=True)
            assert len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.logprob


def test_without_logprobs_the_field_is_null(url):
    r = post(url, "/v1/completions", prompt=PROMPT, max_tokens=4)
    assert r["choices"][0]["logprobs"] is None
    r = post(url, "/v1/chat/completions", messages=CHAT, max_tokens=4, logprobs=False)
    assert r["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,prompt,ask", [
    ("/v1/completions", {"prompt": PROMPT}, {"logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT}, {"logprobs": True, "top_logprobs": 2}),
])
def test_streamed_logprobs_are_the_whole_responses(url, path, prompt, ask):
    body = {**prompt, **ask, "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2}
    whole = post(url, path, **body)
    chunks = events(url, path, **body)
    for i, c in enumerate(whole["choices"]):
        parts = [x["logprobs"] for ch in chunks for x in ch["choices"] if x["index"] == i and x["logprobs"]]
        if "messages" in prompt:
            assert [y for p in parts for y in p["content"]] == c["logprobs"]["content"]
        else:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert [y for p in parts for y in p[key]] == c["logprobs"][key], key


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(llm, url):
    """lm-eval's local-completions loglikelihood request: prompt = context + continuation (token
    ids), echo, max_tokens 1, logprobs 1, temperature 0; it sums ``token_logprobs[ctxlen:-1]``."""
    ctx, cont = [11, 12, 13, 14, 15, 16], [17, 18, 19]
    r = post(url, "/v1/completions", prompt=[ctx + cont, ctx + [20, 21]], echo=True, max_tokens=1, logprobs=1,
             temperature=0)
    want = llm.generate([ctx + cont], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ctx + cont) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:-1] == [d[t].logprob for t, d in zip((ctx + cont)[1:], want[1:])]
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    score = sum(lp["token_logprobs"][len(ctx):-1])
    assert score < 0 and math.isclose(score, sum(want[i][t].logprob for i, t in enumerate(cont, len(ctx))))
    other = r["choices"][1]["logprobs"]["token_logprobs"]
    assert other[:len(ctx)] == lp["token_logprobs"][:len(ctx)]  # the shared context scores the same


def test_streamed_echo_sends_the_prompts_logprobs_first(url):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 2}
    whole = post(url, "/v1/completions", **body)
    chunks = events(url, "/v1/completions", **body)
    for i, c in enumerate(whole["choices"]):
        mine = [x for ch in chunks for x in ch["choices"] if x["index"] == i]
        assert mine[0]["text"] == PROMPT and mine[0]["logprobs"]["token_logprobs"][0] is None
        assert "".join(x["text"] for x in mine) == c["text"]
        parts = [x["logprobs"] for x in mine if x["logprobs"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [y for p in parts for y in p[key]] == c["logprobs"][key], key


def test_vllm_prompt_logprobs_field(llm, url):
    r = post(url, "/v1/completions", prompt=[11, 12, 13, 14, 15], max_tokens=2, prompt_logprobs=2)
    got = r["choices"][0]["prompt_logprobs"]
    want = llm.generate([[11, 12, 13, 14, 15]], SamplingParams(max_tokens=2, prompt_logprobs=2))[0].prompt_logprobs
    assert got[0] is None and len(got) == 5
    for g, w in zip(got[1:], want[1:]):
        assert {int(t): (v["logprob"], v["rank"]) for t, v in g.items()} == \
            {t: (v.logprob, v.rank) for t, v in w.items()}
    assert r["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_bad_logprobs_are_400_naming_the_field(url, path, body, param):
    r = httpx.post(url + path, json={"model": NAME, "max_tokens": 2, **body}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
