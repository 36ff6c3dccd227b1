"""The OpenAI-compatible server, in-process on 127.0.0.1 and a free port (bundled pair, float32,
CPU): the official ``openai`` client for completions, chat and streaming; plain HTTP for the
error cases; cancellation on disconnect; fault isolation; 16 concurrent requests equal to their
single runs."""
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from simsd import LLM, SamplingParams  # noqa: E402
from simsd.entrypoints.openai.api_server import build_app  # noqa: E402
from simsd.speculative.spec_row import SpecRow  # noqa: E402
from tests.simsd.entrypoints.serving import (  # noqa: E402
    CHAT,
    NAME,
    TIMEOUT,
    doc_blocks,
    readme_blocks,
    running_server,
    single_text,
    wait_for,
)


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def test_the_readme_server_examples_show_text(url, capsys):
    """The README's first requests to ``simsd serve`` (the curl body, the openai client's stream),
    run as written against the bundled pair: both answer text (issue 21: a first curl that
    returned "" read as a broken server). docs/serving.md shows the same examples."""
    (curl,), (client_code,) = readme_blocks("Server", "bash"), readme_blocks("Server", "python")
    assert doc_blocks("docs/serving.md", "Serving", "bash") == [curl]
    assert doc_blocks("docs/serving.md", "Serving", "python") == [client_code]
    path = re.search(r"localhost:8000(/v1/\S+) ", curl).group(1)
    r = httpx.post(url + path, json=json.loads(re.search(r"-d '(.*)'", curl).group(1)), timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].strip(), r.text
    exec(client_code.replace("http://127.0.0.1:8000", url), {})
    assert capsys.readouterr().out.strip()


def chat_ids(llm, messages=CHAT):
    return llm.prompt_ids(messages)


def test_completions_and_chat_with_the_openai_client(llm, client):
    r = client.completions.create(model=NAME, prompt=[11, 12, 13, 14, 15], max_tokens=10)
    text, ids = single_text(llm, [11, 12, 13, 14, 15], SamplingParams(max_tokens=10))
    (choice,) = r.choices
    assert choice.text == text and choice.finish_reason in ("stop", "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, len(ids), 5 + len(ids))
    ext = choice.model_extra["simsd"]
    assert isinstance(ext["seed"], int) and 0 <= ext["stats"]["acceptance_rate"] <= 1
    assert ext["stats"]["new_tokens"] == len(ids) and ext["stats"]["mode"] == "exact"
    c = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12)
    text, ids = single_text(llm, chat_ids(llm), SamplingParams(max_tokens=12))
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == text and c.usage.completion_tokens == len(ids)
    # several prompts: one choice each, in order; the usage counts every choice
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25, 26]]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=6)
    want = [single_text(llm, p, SamplingParams(max_tokens=6)) for p in prompts]
    assert [ch.index for ch in r.choices] == [0, 1]
    assert [ch.text for ch in r.choices] == [text for text, _ in want]
    c = sum(len(ids) for _, ids in want)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (9, c, 9 + c)


def test_streaming_with_the_openai_client(llm, client):
    text, ids = single_text(llm, chat_ids(llm), SamplingParams(max_tokens=20))
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(pieces) > 2 and "".join(pieces) == text
    final = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].model_extra["simsd"]["stats"]["new_tokens"] == len(ids)
    assert final[0].usage.completion_tokens == len(ids)  # the finish chunk carries the usage too
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    # completions, without include_usage: no usage-only chunk (a plain client reads choices[0] of every chunk)
    text, _ = single_text(llm, [11, 12, 13, 14, 15], SamplingParams(max_tokens=16))
    chunks = list(client.completions.create(model=NAME, prompt=[11, 12, 13, 14, 15], max_tokens=16, stream=True))
    assert all(ch.choices for ch in chunks) and "".join(ch.choices[0].text for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_stream_of_several_prompts_reports_the_usage_of_all_choices(llm, client):
    """Two prompts of different lengths in one streamed completion: each choice's text is its
    single run, and the usage on the last finish chunk and on the usage-only chunk counts both
    choices (not the last one to finish)."""
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25, 26]]
    want = [single_text(llm, p, SamplingParams(max_tokens=6)) for p in prompts]
    chunks = list(client.completions.create(model=NAME, prompt=prompts, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    for i, (text, _) in enumerate(want):
        assert "".join(c.text for ch in chunks for c in ch.choices if c.index == i) == text
    p = sum(len(q) for q in prompts)
    c = sum(len(ids) for _, ids in want)
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 2 and finals[0].usage is None and len(usage) == 2
    for u in usage:  # the last finish chunk, then the usage-only chunk
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (p, c, p + c)


def test_chat_max_completion_tokens_limits_the_answer(llm, client):
    """``max_completion_tokens`` (chat's name for ``max_tokens``) bounds the answer like
    ``max_tokens`` does, below the server's default."""
    text, ids = single_text(llm, chat_ids(llm), SamplingParams(max_tokens=5))
    assert len(ids) == 5 and ids[-1] not in llm.target.stop_ids  # the premise: the free answer is longer
    c = client.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=5)
    assert c.choices[0].message.content == text and c.usage.completion_tokens == 5
    assert c.choices[0].finish_reason == "length"


def test_metrics_are_the_totals_of_the_finished_requests(llm, url):
    """``GET /metrics`` reads the LLM's totals: every counter grows by the sums over the requests
    that finished in between (prompt and generated tokens, the forwards their rows took part in,
    the draft's proposed and accepted tokens, from each output's own statistics), and the two
    rates are the totals' ratios (acceptance: accepted / proposed; target forwards per
    generated token)."""
    def scrape(h) -> dict:
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in h.get("/metrics").text.splitlines()
                if line and not line.startswith("#")}
    prompts = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (7, 12, 9)]
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        before = scrape(h)
        outs = llm.generate(prompts, params)
        after = scrape(h)
    delta = {k: after[k] - before[k] for k in after if "_total" in k}
    want = {"simsd_prompt_tokens_total": sum(len(p) for p in prompts),
            "simsd_generation_tokens_total": sum(len(o.token_ids) for o in outs),
            "simsd_target_forwards_total": sum(o.stats["target_forwards"] for o in outs),
            "simsd_draft_forwards_total": sum(o.stats["draft_forwards"] for o in outs),
            "simsd_draft_tokens_proposed_total": sum(o.stats["proposed"] for o in outs),
            "simsd_draft_tokens_accepted_total": sum(o.stats["accepted"] for o in outs)}
    # the premise: figures that differ from each other, so that one read for another shows
    assert want["simsd_generation_tokens_total"] == 28
    assert 0 < want["simsd_draft_tokens_accepted_total"] < want["simsd_draft_tokens_proposed_total"]
    assert want["simsd_draft_forwards_total"] != want["simsd_target_forwards_total"]
    assert {k: delta[k] for k in want} == want
    assert delta['simsd_requests_total{finish_reason="length"}'] == 3
    assert after["simsd_acceptance_rate"] == pytest.approx(after["simsd_draft_tokens_accepted_total"]
                                                           / after["simsd_draft_tokens_proposed_total"], rel=1e-12)
    assert after["simsd_target_forwards_per_token"] == pytest.approx(
        after["simsd_target_forwards_total"] / after["simsd_generation_tokens_total"], rel=1e-12)


def test_latency_histograms_of_a_request(llm):
    """Per request: the latency, the time to the first token, and the time per output token
    after the first, (latency - TTFT) / (tokens - 1) as vLLM defines it: a request of 5 tokens,
    TTFT 1 s, latency 3 s gives 0.5 s per output token."""
    from types import SimpleNamespace

    from simsd.entrypoints.openai.metrics import Metrics
    m = Metrics(llm)
    m.observe(SimpleNamespace(token_ids=[1, 2, 3, 4, 5], stats={"time_to_first_token": 1.0}), 3.0)
    m.observe(SimpleNamespace(token_ids=[1], stats={"time_to_first_token": 0.25}), 0.25)  # one token: no TPOT
    got = lambda name: m.registry.get_sample_value(name)  # noqa: E731
    for name, want in (("request_latency", (2, 3.25)), ("time_to_first_token", (2, 1.25)),
                       ("time_per_output_token", (1, 0.5))):
        assert (got(f"simsd_{name}_seconds_count"), got(f"simsd_{name}_seconds_sum")) == want


def test_seed_is_reported_and_replays(client):
    a = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=16, temperature=1.3)
    seed = a.choices[0].model_extra["simsd"]["seed"]
    b = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=16, temperature=1.3, seed=seed)
    assert b.choices[0].text == a.choices[0].text and b.choices[0].model_extra["simsd"]["seed"] == seed


def test_models_health_metrics(url):
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        models = h.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [NAME] and models["object"] == "list"
        assert h.get("/health").json()["status"] == "ok"
        h.post("/v1/completions", json={"model": NAME, "prompt": [11, 12, 13], "max_tokens": 8})
        text = h.get("/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    for name in ("simsd_requests_running", "simsd_requests_waiting", "simsd_generation_tokens_total",
                 "simsd_acceptance_rate", "simsd_target_forwards_per_token", "simsd_round_seconds_count",
                 "simsd_round_seconds_sum", "simsd_time_to_first_token_seconds_count"):
        assert name in values, name
    assert values["simsd_generation_tokens_total"] >= 8 and values["simsd_round_seconds_count"] > 0
    assert 0 < values["simsd_target_forwards_per_token"] < 3


BAD = [
    (b'{"model": "tiny-sdar-target", "prompt": ', None, "malformed JSON"),
    ({"model": NAME, "prompt": [11] * 2048}, "prompt", "max_model_len"),
    ({"model": NAME, "prompt": [11] * 2000, "max_tokens": 100}, "max_tokens", "exceeds"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "ten"}, "max_tokens", "integer"),
    ({"model": NAME, "prompt": "hi", "n": 17}, "n", "n must be an integer in [1, 16], got 17"),  # test_n_echo.py
    ({"model": NAME, "prompt": "hi", "n": 0}, "n", "n must be an integer in [1, 16], got 0"),
    ({"model": NAME, "prompt": "hi", "temperature": -1}, "temperature", ">= 0"),
    ({"model": NAME, "prompt": "hi", "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"model": NAME, "prompt": "hi", "logprobs": 21}, "logprobs", "in [0, 20], got 21"),
    ({"model": NAME, "prompt": "hi", "frobnicate": 1}, "frobnicate", "Extra inputs"),
    ({"model": NAME, "prompt": "hi", "gamma": 9}, "gamma", "block length"),
    ({"model": NAME, "prompt": "hi", "strategy": "dynamic", "draft_threshold": 1.5}, "draft_threshold", "[0, 1]"),
    ({"model": NAME, "prompt": [11, 3, 12]}, "prompt", "mask token"),
    ({"model": NAME}, "prompt", "Field required"),
    ({"model": NAME, "prompt": [[]]}, "prompt", "must not be empty"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "5"}, "max_tokens", "integer"),  # no coercion
    ({"model": NAME, "prompt": "hi", "max_tokens": True}, "max_tokens", "integer"),
    ({"model": NAME, "prompt": "hi", "stream": 1}, "stream", "boolean"),
    (json.dumps({"model": NAME, "prompt": "a \ud800 b"}).encode(), "prompt", "lone surrogate"),  # JSON escape
    # more prompts than 4 rows + 64 waiting can ever hold: a 400 (a 503 would be retried in vain)
    ({"model": NAME, "prompt": [[11, 12]] * 69, "max_tokens": 2}, "prompt", "at most 68 at once"),
]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}),
])
def test_an_unknown_model_is_404_as_vllm_answers(url, path, body):
    """vLLM answers a model it does not serve with a 404: type ``NotFoundError``, param ``model``,
    code 404 (OpenAI's client raises ``openai.NotFoundError``)."""
    r = httpx.post(url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("NotFoundError", "model", 404)
    assert "gpt-4" in err["message"] and NAME in err["message"]


def test_an_unknown_model_raises_not_found_in_the_openai_client(client):
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)


@pytest.mark.parametrize("body,param,words", BAD)
def test_bad_completion_requests_are_400_naming_the_field(url, body, param, words):
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        if isinstance(body, bytes):
            r = h.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        else:
            r = h.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and words in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"model": NAME, "messages": []}, "messages"),
    ({"model": NAME, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"model": NAME, "messages": CHAT, "max_tokens": 5, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"model": NAME, "messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({"model": NAME, "messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": NAME, "messages": [{"role": "tool", "content": "42"}]}, "messages.0.role"),
    (json.dumps({"model": NAME, "messages": [{"role": "user", "content": "a \ud800 b"}]}).encode(), "messages"),
    ({"model": NAME, "messages": [{"role": "user", "content": None}]}, "messages.0.content"),  # a user turn needs text
    ({"model": NAME, "messages": [{"role": "user"}]}, "messages.0.content"),
    ({"model": NAME, "messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ({"model": NAME, "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"model": NAME, "messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"model": NAME, "messages": CHAT, "prompt_logprobs": 2}, "prompt_logprobs"),
])
def test_bad_chat_requests_are_400_naming_the_field(url, body, param):
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        if isinstance(body, bytes):
            r = h.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        else:
            r = h.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_non_text_content_is_refused_in_words(url):
    """An image part gets a sentence about text content, not a pydantic union error."""
    body = {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x"}}]}]}
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        r = h.post("/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages.0.content", r.text
    assert err["message"] == ("messages.0.content: only text content is supported (a string, or parts of type "
                              "'text'), got a part of type 'image_url'")


def _stream_lines(h, body):
    """An open streaming response and an iterator over its ``data:`` payloads."""
    cm = h.stream("POST", "/v1/completions", json=body)
    resp = cm.__enter__()
    assert resp.status_code == 200
    lines = (line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: "))
    return cm, lines


def test_client_disconnect_cancels_and_frees_the_row(llm, url):
    before = llm.metrics()
    body = {"model": NAME, "prompt": [11, 12, 13], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        cm, lines = _stream_lines(h, body)
        first = json.loads(next(lines))
        assert first["choices"][0]["text"] is not None
        assert llm.scheduler.num_running == 1
        cm.__exit__(None, None, None)  # the client goes away mid-stream
    assert wait_for(lambda: llm.scheduler.num_running == 0 and llm.metrics()["requests"]["cancelled"]
                    == before["requests"]["cancelled"] + 1, TIMEOUT)
    after = llm.metrics()
    assert after["generation_tokens"] - before["generation_tokens"] < 1500  # cut short, not finished
    # later requests are unaffected
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        r = h.post("/v1/completions", json={"model": NAME, "prompt": [11, 12, 13, 14, 15], "max_tokens": 10})
    assert r.json()["choices"][0]["text"] == single_text(llm, [11, 12, 13, 14, 15], SamplingParams(max_tokens=10))[0]


MARK = 4321  # a stop id that makes a request fail inside the engine (monkeypatched below)


@pytest.fixture
def failing(monkeypatch):
    real = SpecRow.program

    def program(self, tail, on_block=None):
        if MARK in self.stop_ids:
            prog = real(self, tail, on_block)
            yield next(prog)
            raise RuntimeError("injected fault")
        return (yield from real(self, tail, on_block))
    monkeypatch.setattr(SpecRow, "program", program)


def test_an_exception_inside_one_request_is_500_for_it_only(llm, url, failing):
    good_body = {"model": NAME, "prompt": [11, 12, 13, 14, 15], "max_tokens": 24}
    bad_body = {"model": NAME, "prompt": [11, 12, 13, 14, 15], "max_tokens": 24, "stop_token_ids": [MARK]}
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h, ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(h.post, "/v1/completions", json=b) for b in (good_body, bad_body, good_body)]
        good1, bad, good2 = [f.result(TIMEOUT) for f in futures]
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
        assert "injected fault" in bad.json()["error"]["message"]
        want = single_text(llm, [11, 12, 13, 14, 15], SamplingParams(max_tokens=24))[0]
        assert good1.status_code == good2.status_code == 200
        assert good1.json()["choices"][0]["text"] == good2.json()["choices"][0]["text"] == want
        # a streaming request that fails ends its stream with an error event; the server goes on
        cm, lines = _stream_lines(h, {**bad_body, "stream": True})
        events = list(lines)
        cm.__exit__(None, None, None)
        assert "injected fault" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
        assert h.get("/health").status_code == 200
        assert h.post("/v1/completions", json=good_body).json()["choices"][0]["text"] == want
    assert llm.scheduler.num_running == 0


def test_full_queue_is_503_with_retry_after(llm):
    small = LLM(llm.target, llm.draft, "exact", batch_size=1, max_waiting=1)
    long = {"model": NAME, "prompt": [11, 12, 13], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        with running_server(build_app(small)) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
            a, lines_a = _stream_lines(h, long)
            next(lines_a)
            b, _ = _stream_lines(h, long)  # waits for the row
            assert wait_for(lambda: small.scheduler.num_waiting == 1, TIMEOUT)
            r = h.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "server_busy"
            assert 'simsd_requests_rejected_total{reason="queue_full"} 1.0' in h.get("/metrics").text
            assert r.json()["error"]["message"] == ("the server is busy: 1 request already waiting for a row "
                                                    "(max_waiting=1; 1 row, all taken)")
            a.__exit__(None, None, None)
            b.__exit__(None, None, None)
            assert wait_for(lambda: small.scheduler.num_running == 0 and small.scheduler.num_waiting == 0, TIMEOUT)
            r = h.post("/v1/completions", json={"model": NAME, "prompt": [11, 12, 13, 14, 15], "max_tokens": 10})
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == single_text(llm, [11, 12, 13, 14, 15],
                                                                 SamplingParams(max_tokens=10))[0]
    finally:
        assert small.shutdown(drain=False, timeout=60)


def test_16_concurrent_requests_equal_their_single_runs(llm, url):
    """16 requests of mixed prompt lengths and token limits from 16 threads (4 rows: requests
    wait, rows are reused, forwards are shared); float32 greedy: each answer equals its single run."""
    from simsd.entrypoints.prompts import bundled_prompts
    texts = [p.text for p in bundled_prompts()[:8]]
    prompts = [[{"role": "user", "content": t}] for t in texts] + [list(range(11, 11 + n)) for n in (1, 3, 4, 5, 8, 13,
                                                                                                     17, 30)]
    limits = [4, 9, 16, 20, 24, 5, 12, 18] * 2
    want = [single_text(llm, llm.prompt_ids(p), SamplingParams(max_tokens=m)) for p, m in zip(prompts, limits)]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    before = llm.metrics()
    barrier = threading.Barrier(16)

    def ask(i):
        barrier.wait(TIMEOUT)
        if isinstance(prompts[i][0], dict):
            r = client.chat.completions.create(model=NAME, messages=prompts[i], max_tokens=limits[i])
            return r.choices[0].message.content, r.usage.completion_tokens
        r = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=limits[i])
        return r.choices[0].text, r.usage.completion_tokens
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16), timeout=4 * TIMEOUT))
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1] for g in got] == [len(w[1]) for w in want]
    after = llm.metrics()
    row_forwards = after["target_forwards"] - before["target_forwards"]
    batched = after["batched_forwards"]["target"] - before["batched_forwards"]["target"]
    assert batched < row_forwards  # requests shared forwards


def test_every_sampling_field_of_a_request_is_used():
    """Each field a completion or chat request may give reaches its SamplingParams (nothing a
    client asks for is silently dropped): values unlike the server's defaults."""
    from simsd.config.request import SamplingParams
    from simsd.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    defaults = SamplingParams()
    given = dict(temperature=0.5, top_p=0.75, top_k=9, seed=11, stop=["x"], stop_token_ids=[5], ignore_eos=True,
                 steps=2, strategy="dynamic", threshold=0.7, gamma=2, draft_strategy="entropy", draft_threshold=0.3)
    as_list = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731
    for req in (CompletionRequest(model=NAME, prompt="hi", max_tokens=7, **given),
                ChatCompletionRequest(model=NAME, messages=CHAT, max_completion_tokens=7, **given)):
        p = req.sampling_params(defaults)
        for name, value in dict(given, max_tokens=7).items():
            assert as_list(getattr(p, name)) == value != as_list(getattr(defaults, name)), name


def test_a_request_draft_threshold_and_the_server_default():
    """A request's ``draft_threshold`` overrides the server's ``--draft-threshold``; a request that
    names another strategy or draft strategy without one falls back to the draft strategy's
    default rule (a bound for one strategy is never read as another's)."""
    from simsd.config.request import SamplingParams
    from simsd.entrypoints.openai.protocol import CompletionRequest
    defaults = SamplingParams(strategy="dynamic", threshold=0.8, draft_strategy="entropy", draft_threshold=0.4)
    req = lambda **kw: CompletionRequest(model=NAME, prompt="hi", **kw).sampling_params(defaults)  # noqa: E731
    assert req().draft_threshold == 0.4
    assert req(draft_threshold=0.2).draft_threshold == 0.2
    assert req(draft_strategy="dynamic").draft_threshold is None
    assert req(strategy="entropy").draft_threshold is None and req(strategy="entropy").threshold is None
    assert req(draft_strategy="dynamic", draft_threshold=0.6).draft_threshold == 0.6


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "n": None, "echo": None, "stream": None, "presence_penalty": None,
                         "frequency_penalty": None, "logprobs": None, "max_tokens": None, "temperature": None}),
    ("/v1/chat/completions", {"messages": CHAT, "n": None, "presence_penalty": None, "frequency_penalty": None,
                              "logprobs": None, "stream": None, "top_logprobs": None, "stream_options": None}),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": False, "top_logprobs": 0}),  # both mean off
])
def test_null_fields_and_neutral_logprobs_are_their_defaults(url, path, body):
    """OpenAI types its optional fields nullable and SDK wrappers send null: null is the default."""
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        got = h.post(path, json={"model": NAME, **body, "max_tokens": 4})
        plain = {k: v for k, v in body.items() if v is not None and k not in ("logprobs", "top_logprobs")}
        want = h.post(path, json={"model": NAME, **plain, "max_tokens": 4})
    assert got.status_code == 200, got.text
    key = "message" if "chat" in path else "text"
    assert got.json()["choices"][0][key] == want.json()["choices"][0][key]


def test_an_omitted_max_tokens_fits_the_positions_left(llm, url):
    """OpenAI's and vLLM's rule: without max_tokens a request gets min(server default, positions
    left); an explicit max_tokens that does not fit is the 400 naming it."""
    L = llm.max_model_len
    prompt = [11] * (L - 5)
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        r = h.post("/v1/completions", json={"model": NAME, "prompt": prompt, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
        r = h.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = h.post("/v1/completions", json={"model": NAME, "prompt": [11, 12, 13], "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == llm.default_params.max_tokens  # the default where it fits
        D = llm.default_params.max_tokens
        for left in (D - 1, D):  # at the edge: one position short of the default, and exactly the default
            r = h.post("/v1/completions", json={"model": NAME, "prompt": [11] * (L - left), "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == left, r.text


def test_a_message_name_reaches_the_chat_template(llm, url):
    """``name`` is passed to the chat template as the Python API passes it, never dropped."""
    from simsd.entrypoints.openai.protocol import ChatCompletionRequest
    messages = [{"role": "user", "content": "Hi", "name": "ada"}]
    assert ChatCompletionRequest(model=NAME, messages=messages).chat() == messages
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        r = h.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(llm.prompt_ids(messages))


def test_api_key_cors_and_docs(llm):
    """--api-key: /v1/* needs the Bearer token (401 with OpenAI's body otherwise), /health stays
    open; --allowed-origins: CORS for those origins only; --disable-docs: no /docs, /openapi.json."""
    app = build_app(llm, shutdown_llm=False, api_key="s3cret", allowed_origins=["https://app.example.com"],
                    docs=False)
    body = {"model": NAME, "prompt": [11, 12, 13], "max_tokens": 2}
    with running_server(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer s3cret-and-more"}):
            r = h.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json() == {"error": {"message": "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                          "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
            assert h.get("/v1/models", headers=headers).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert h.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert h.get("/v1/models", headers=ok).status_code == 200
        assert h.get("/health").status_code == 200  # probes need no key
        client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=TIMEOUT)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(**body)
        # CORS: the allowed origin's preflight passes without a key, another origin's does not
        pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        r = h.options("/v1/completions", headers={"Origin": "https://app.example.com", **pre})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
        r = h.options("/v1/completions", headers={"Origin": "https://evil.example.com", **pre})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = h.post("/v1/completions", json=body, headers={"Origin": "https://app.example.com", **ok})
        assert r.headers["access-control-allow-origin"] == "https://app.example.com"
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert h.get(path).status_code == 404
    with running_server(build_app(llm, shutdown_llm=False)) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        # the defaults: no key, no CORS, docs on
        assert h.post("/v1/completions", json=body, headers={"Authorization": "Bearer anything"}).status_code == 200
        r = h.options("/v1/completions", headers={"Origin": "https://app.example.com",
                                                  "Access-Control-Request-Method": "POST"})
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        assert h.get("/openapi.json").status_code == 200


def test_a_body_over_the_limit_is_413(llm):
    """--max-request-bytes: over it a 413 with OpenAI's body, by Content-Length at once or, for a
    chunked body, as soon as the bytes pass the limit; the server answers the next request."""
    limit = 4096
    body = {"model": NAME, "prompt": [11, 12, 13], "max_tokens": 2}
    big = json.dumps({**body, "prompt": "x " * limit}).encode()
    with running_server(build_app(llm, shutdown_llm=False, max_request_bytes=limit)) as url, \
            httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        want = {"error": {"message": f"the request body exceeds the server's limit of {limit} bytes (simsd serve "
                                     f"--max-request-bytes)", "type": "invalid_request_error", "param": None,
                          "code": None}}
        r = h.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json() == want

        def chunks():
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]
        r = h.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert "content-length" not in r.request.headers and r.status_code == 413 and r.json() == want
        assert h.post("/v1/completions", json=body).status_code == 200
        small = json.dumps(body).encode()
        r = h.post("/v1/completions", content=(small[i:i + 7] for i in range(0, len(small), 7)),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text  # a chunked body under the limit is read whole


def test_tokenization_runs_off_the_event_loop(llm, url, monkeypatch):
    """A request's prompt is encoded and checked in a worker thread: while one is held inside
    its encoding (a scripted stall, no timing), /health and another request are answered."""
    real, held, release = llm.requests.encode, threading.Event(), threading.Event()

    def encode(prompt):
        if prompt == "stall here":
            held.set()
            assert release.wait(TIMEOUT)
        return real(prompt)
    monkeypatch.setattr(llm.requests, "encode", encode)
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h, ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(h.post, "/v1/completions", json={"model": NAME, "prompt": "stall here", "max_tokens": 2})
        assert held.wait(TIMEOUT)
        try:
            assert h.get("/health", timeout=30).status_code == 200  # would hang if the encoding held the loop
            r = h.post("/v1/completions", json={"model": NAME, "prompt": [11, 12, 13], "max_tokens": 2}, timeout=60)
            assert r.status_code == 200
        finally:
            release.set()
        assert stalled.result(TIMEOUT).status_code == 200


def test_metrics_report_the_page_pools_and_the_prefix_cache():
    """``GET /metrics`` of a server over page pools with the prefix cache: the pools' pages per
    model, evictions, preemptions and the prefix cache's tokens, as ``LLM.metrics()`` has them
    after three requests that share a 32-token prefix (two whole pages: the later ones find them;
    the server's answer counts them in ``usage.prompt_tokens_details.cached_tokens``)."""
    llm = LLM(mode="exact", dtype="float32", device="cpu", batch_size=2, page_size=16, enable_prefix_caching=True)
    shared = [10 + i for i in range(32)]
    for tail in ([60, 61], [70, 71]):
        llm.generate([shared + tail], SamplingParams(max_tokens=8))
    with running_server(build_app(llm, shutdown_llm=True)) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        answer = h.post("/v1/completions", json={"model": NAME, "prompt": shared + [80], "max_tokens": 4}).json()
        text = h.get("/metrics").text
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}  # OpenAI's and vLLM's field
    got = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}
    m = llm.metrics()
    pages = m["kv_pages"]
    assert pages["prefix_hit_tokens"] == 64 and pages["target"]["pages_cached"] >= 2
    assert got["simsd_prefix_cache_hits_total"] == 64 and got["simsd_prefix_cache_queries_total"] == 96
    assert got["simsd_preemptions_total"] == m["preemptions"] == 0
    for model in ("target", "draft"):
        for key in ("pages_total", "pages_used", "pages_free", "pages_cached"):
            assert got[f'simsd_kv_{key}{{model="{model}"}}'] == pages[model][key], (model, key)
        assert got[f'simsd_kv_page_evictions_total{{model="{model}"}}'] == pages[model]["evictions"] == 0
