"""The server's last open doors (issue 34, items 8-12), in-process on 127.0.0.1 (bundled pair,
float32, CPU): a body is parsed and validated off the event loop with bounded work; CORS lets
the OpenAI browser SDK's headers through; a queued stream gets keep-alive comments; a stuck
engine turns /health 503; chat requests may continue the final message; a request that failed
inside the engine is not retried. The HTTP connection's own bounds (header size, half-sent
requests) are tested on a real ``simsd serve``: tests/simsd/entrypoints/test_serve_connection.py."""
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from simsd import LLM, SamplingParams  # noqa: E402
from simsd.entrypoints.openai import protocol, serving  # noqa: E402
from simsd.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.simsd.entrypoints.serving import running_server, single_text, wait_for  # noqa: E402

NAME = "tiny-sdar-target"
TIMEOUT = 120


@pytest.fixture(scope="module")
def llm():  # this module's: two rows (the conftest's has four)
    llm = LLM(mode="exact", dtype="float32", device="cpu", batch_size=2)
    yield llm
    assert llm.shutdown(timeout=60)


def test_a_body_is_parsed_and_validated_off_the_event_loop(url, monkeypatch):
    """While one body is held inside its parsing (a scripted stall, no timing), /health and
    another request are answered: the parsing and validation run in a worker thread."""
    real, held, release = serving.parse_request, threading.Event(), threading.Event()

    def parse(model, raw):
        if b"stall here" in raw:
            held.set()
            assert release.wait(TIMEOUT)
        return real(model, raw)
    monkeypatch.setattr(serving, "parse_request", parse)
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h, ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(h.post, "/v1/completions", json={"model": NAME, "prompt": "stall here", "max_tokens": 2})
        assert held.wait(TIMEOUT)
        try:
            assert h.get("/health", timeout=30).status_code == 200  # would hang if the parsing held the loop
            r = h.post("/v1/completions", json={"model": NAME, "prompt": [11, 12, 13], "max_tokens": 2}, timeout=60)
            assert r.status_code == 200
        finally:
            release.set()
        assert stalled.result(TIMEOUT).status_code == 200


@pytest.mark.parametrize("model,body,param", [
    # issue 34's 5.5 MB body: 400,000 unknown fields
    (protocol.CompletionRequest, {"model": NAME, "prompt": "hi", **{f"f{i}": 1 for i in range(400_000)}}, "f0"),
    (protocol.CompletionRequest, {"model": NAME, "prompt": [[1]] + ["x"] * 1_000_000}, "prompt"),
    (protocol.CompletionRequest, {"model": NAME, "prompt": "hi", "stop": [5] * 100_000}, "stop"),
    (protocol.ChatCompletionRequest, {"model": NAME, "messages": [{"role": "robot", "content": "a"}] * 250_000},
     "messages.0.role"),
    (protocol.ChatCompletionRequest, {"model": NAME, "messages": [{"role": "user", "content": "a",
                                                                    **{f"x{i}": 0 for i in range(100_000)}}]},
     "messages.0.x0"),
    (protocol.ChatCompletionRequest, {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "y": 1}] * 100_000}]}, "messages.0.content"),
])
def test_a_bad_body_builds_a_bounded_number_of_errors(model, body, param):
    """Validation reports the first unknown field of an object and stops a list at its first
    bad item, so a body of 100,000s of bad parts builds one error (one per union member at
    most), not one per part (issue 34: building 400,000 errors to report the first took
    seconds); the refusal names the first bad field."""
    from pydantic import ValidationError
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    assert info.value.error_count() <= 4, info.value.error_count()
    with pytest.raises(protocol.ParamError) as info:
        protocol.parse_request(model, json.dumps(body).encode())
    assert info.value.param == param, str(info.value)


def test_a_body_of_400k_unknown_fields_is_a_400_naming_the_first(url):
    body = {"model": NAME, "prompt": "hi", **{f"field{i}": i for i in range(400_000)}}
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": "field0: Extra inputs are not permitted", "type":
                                     "invalid_request_error", "param": "field0", "code": None}
        r = h.post("/v1/completions", content=b'{"model": "x", "prompt": ',
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"] == ("malformed JSON: Expecting value (line 1, "
                                                                         "column 26)")


def test_the_openapi_schema_describes_the_request_bodies(url):
    """/openapi.json documents both request bodies (read by the handlers themselves), and every
    reference in it resolves."""
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        doc = h.get("/openapi.json").json()

    def resolve(ref: str) -> dict:
        node = doc
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
        return node

    def refs(node):
        if isinstance(node, dict):
            if "$ref" in node:
                yield node["$ref"]
            for v in node.values():
                yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)
    for path, field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        body = doc["paths"][path]["post"]["requestBody"]
        schema = resolve(body["content"]["application/json"]["schema"]["$ref"])
        assert body["required"] and field in schema["properties"]
    for ref in refs(doc):
        assert isinstance(resolve(ref), dict), ref
    assert set(resolve("#/components/schemas/ChatMessage")["properties"]) >= {"role", "content", "name"}


def sdk_headers() -> list:
    """The request headers the OpenAI SDK sends besides the CORS-safelisted ones (its own
    ``x-stainless-*`` and ``openai-*`` among them; the browser sets ``User-Agent`` itself)."""
    client = openai.OpenAI(api_key="k", organization="org", project="p", base_url="http://127.0.0.1:1/v1")
    names = {k.lower() for k in client.default_headers} - {"user-agent"}
    return sorted(names | {"authorization", "x-stainless-retry-count", "x-stainless-timeout"})


def test_cors_lets_the_openai_browser_sdk_through(llm):
    """An allowed origin's preflight with the OpenAI SDK's headers is 200 and allows each of them
    (``allowed_headers`` ``*``, vLLM's default); with the headers restricted, the same preflight
    is refused and one with only the listed headers passes; another origin is refused either way."""
    names = sdk_headers()
    assert "x-stainless-os" in names and "openai-organization" in names  # the premise
    origin = "https://app.example.com"
    pre = {"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": ",".join(names)}
    with running_server(build_app(llm, shutdown_llm=False, api_key="k", allowed_origins=[origin])) as url, \
            httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        r = h.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == origin
        assert set(names) <= {x.strip().lower() for x in r.headers["access-control-allow-headers"].split(",")}
        assert h.options("/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"}).status_code == 400
    app = build_app(llm, shutdown_llm=False, allowed_origins=[origin],
                    allowed_headers=["Authorization", "Content-Type"], allowed_methods=["POST"])
    with running_server(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        assert h.options("/v1/chat/completions", headers=pre).status_code == 400
        plain = {**pre, "Access-Control-Request-Headers": "authorization,content-type"}
        assert h.options("/v1/chat/completions", headers=plain).status_code == 200
        assert h.options("/v1/chat/completions", headers={**plain, "Access-Control-Request-Method": "GET"}
                         ).status_code == 400


@pytest.mark.parametrize("key,words", [
    ("clé", "character 2 is 'é'"),
    ("s3cret\n", "character 6 is '\\n'"),
    (" s3cret", "must not begin or end with a space"),
    ("", "is empty (any 'Bearer' header would match)"),
])
def test_a_key_a_client_could_never_send_is_refused(llm, key, words):
    """An API key must be printable ASCII without a space at either end: an HTTP header carries
    ASCII (a client's UTF-8 bytes reach the server as Latin-1) and the token is stripped, so such
    a key could never match (issue 34 item 11); ``simsd serve`` refuses it at start
    (tests/simsd/entrypoints/test_serve_cli.py)."""
    with pytest.raises(protocol.ParamError, match="^api_key ") as info:
        build_app(llm, shutdown_llm=False, api_key=key)
    assert info.value.param == "api_key" and words in str(info.value)


@pytest.fixture
def one_row(llm):
    """An LLM of one row over the module's models (a second request waits for the row)."""
    small = LLM(llm.target, llm.draft, "exact", batch_size=1)
    yield small
    assert small.shutdown(drain=False, timeout=60)


LONG = {"model": NAME, "prompt": [11, 12, 13], "max_tokens": 1500, "ignore_eos": True, "stream": True}


def test_a_queued_stream_gets_keep_alive_comments(llm, one_row):
    """A stream that waits for a row gets ``: keep-alive`` comments (SSE clients skip them) instead
    of silence after its headers; once it has the row its chunks follow and equal its single run."""
    body = {"model": NAME, "prompt": [11, 12, 13, 14, 15], "max_tokens": 10, "stream": True}
    with running_server(build_app(one_row, shutdown_llm=False, sse_keepalive=0.1)) as url, \
            httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        with h.stream("POST", "/v1/completions", json=LONG) as long:
            held = long.iter_lines()  # (kept: a dropped line iterator closes the connection)
            assert next(line for line in held if line).startswith("data: ")  # it holds the row
            with h.stream("POST", "/v1/completions", json=body) as queued:
                lines = queued.iter_lines()
                assert wait_for(lambda: one_row.scheduler.num_waiting == 1, TIMEOUT)
                assert next(line for line in lines if line) == ": keep-alive"
                long.close()  # the long stream's client goes: the queued request gets the row
                rest = [line for line in lines if line]
    data = [line[6:] for line in rest if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and all(line.startswith(("data: ", ": keep-alive")) for line in rest)
    text = "".join(c["text"] for d in data[:-1] for c in json.loads(d)["choices"])
    assert text == single_text(llm, [11, 12, 13, 14, 15], SamplingParams(max_tokens=10))[0]


def test_a_stuck_engine_turns_health_503(one_row, monkeypatch):
    """A round that runs past ``round_timeout`` (a forward held by a scripted stall) turns /health
    503, naming the option; when the round ends /health is 200 again and the request is answered."""
    engine, hang, release = one_row.scheduler.engine, threading.Event(), threading.Event()
    real = engine.forward

    def forward(*args, **kwargs):
        if hang.is_set():
            assert release.wait(TIMEOUT)
        return real(*args, **kwargs)
    monkeypatch.setattr(engine, "forward", forward)
    with running_server(build_app(one_row, shutdown_llm=False, round_timeout=1.0)) as url, \
            httpx.Client(base_url=url, timeout=TIMEOUT) as h, ThreadPoolExecutor(1) as pool:
        assert h.get("/health").status_code == 200
        hang.set()
        answer = pool.submit(h.post, "/v1/completions", json={"model": NAME, "prompt": [11, 12], "max_tokens": 4})
        try:
            assert wait_for(lambda: h.get("/health").status_code == 503, TIMEOUT)
            err = h.get("/health").json()["error"]
            assert "has not finished a round" in err["message"] and "--round-timeout 1)" in err["message"], err
        finally:
            hang.clear()
            release.set()
        assert answer.result(TIMEOUT).status_code == 200
        assert wait_for(lambda: h.get("/health").status_code == 200, TIMEOUT)


CHAT = [{"role": "user", "content": "Write a function that reverses a list."},
        {"role": "assistant", "content": "def reverse(xs):"}]


def test_a_chat_request_may_continue_the_final_message(llm, url):
    """``continue_final_message`` (vLLM's, through transformers' chat template) leaves a trailing
    assistant message open and the answer continues it: the prompt is the template's rendering
    with that option, token for token, and the answer is the Python API's for the same
    :class:`ChatPrompt`; by default a trailing message is a finished turn and a new one opens;
    both options at once are a 400 naming ``continue_final_message``."""
    from simsd.entrypoints.encoding import ChatPrompt
    tok = llm.tokenizer
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("def reverse(xs):")  # the premise: the final turn is left open
    ids = tok(text, add_special_tokens=False)["input_ids"]
    (want,) = llm.generate(ChatPrompt(CHAT, add_generation_prompt=False, continue_final_message=True),
                           SamplingParams(max_tokens=12))
    assert want.prompt_token_ids == ids
    closed = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    with httpx.Client(base_url=url, timeout=TIMEOUT) as h:
        r = h.post("/v1/chat/completions", json={"model": NAME, "messages": CHAT, "max_tokens": 12,
                                                 "continue_final_message": True, "add_generation_prompt": False})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert r.json()["choices"][0]["message"]["content"] == want.text
        r = h.post("/v1/chat/completions", json={"model": NAME, "messages": CHAT, "max_tokens": 2})
        assert r.json()["usage"]["prompt_tokens"] == len(llm.prompt_ids(CHAT)) > len(ids)  # a new turn opens
        r = h.post("/v1/chat/completions", json={"model": NAME, "messages": CHAT, "max_tokens": 2,
                                                 "add_generation_prompt": False})
        assert r.json()["usage"]["prompt_tokens"] == len(tok(closed, add_special_tokens=False)["input_ids"])
        r = h.post("/v1/chat/completions", json={"model": NAME, "messages": CHAT, "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
        assert "set add_generation_prompt to false" in r.json()["error"]["message"]
