"""The server's penalties and ``response_format`` (in-process, bundled pair, exact mode, float32):
``presence_penalty``, ``frequency_penalty`` and ``repetition_penalty`` give the Python API's tokens
for the same request (and other tokens than without them), out of vLLM's ranges a 400 naming the
field; a JSON ``response_format`` (``json_object``, ``json_schema``) a 400 naming it, on both
endpoints; ``{"type": "text"}`` is plain text."""
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from simsd import SamplingParams  # noqa: E402
from tests.simsd.entrypoints.serving import CHAT, IDS, NAME, post  # noqa: E402

PEN = [{"presence_penalty": 1.5}, {"frequency_penalty": 1.0, "temperature": 1.0, "seed": 3},
       {"repetition_penalty": 2.0, "presence_penalty": -0.5}]


@pytest.mark.parametrize("pen", PEN)
def test_penalties_give_the_apis_tokens(url, llm, pen):
    r = post(url, "/v1/completions", prompt=IDS, max_tokens=24, ignore_eos=True, **pen)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["text"]
    out = llm.generate([IDS], SamplingParams(max_tokens=24, ignore_eos=True, **pen))[0]
    assert got == out.text
    plain = llm.generate([IDS], SamplingParams(max_tokens=24, ignore_eos=True,
                                               **{k: v for k, v in pen.items() if "penalty" not in k}))[0]
    assert plain.token_ids != out.token_ids  # the penalties act


@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": IDS}), ("/v1/chat/completions",
                                                                              {"messages": CHAT})])
@pytest.mark.parametrize("field,bad", [("presence_penalty", 2.5), ("frequency_penalty", -2.5),
                                       ("repetition_penalty", 0.0), ("repetition_penalty", -1.0)])
def test_penalties_out_of_range_are_400_naming_them(url, path, prompt, field, bad):
    r = post(url, path, **prompt, max_tokens=4, **{field: bad})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": IDS}), ("/v1/chat/completions",
                                                                              {"messages": CHAT})])
@pytest.mark.parametrize("fmt", [{"type": "json_object"},
                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}])
def test_json_response_format_is_400_naming_it(url, path, prompt, fmt):
    r = post(url, path, **prompt, max_tokens=4, response_format=fmt)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "no structured output" in err["message"]


def test_text_response_format_is_plain_text(url):
    want = post(url, "/v1/chat/completions", messages=CHAT, max_tokens=8).json()["choices"][0]["message"]
    r = post(url, "/v1/chat/completions", messages=CHAT, max_tokens=8, response_format={"type": "text"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"] == want


def test_openai_client_with_penalties(url, llm):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=16, presence_penalty=1.0,
                                       frequency_penalty=0.5)
    out = llm.chat(CHAT, SamplingParams(max_tokens=16, presence_penalty=1.0, frequency_penalty=0.5))[0]
    assert r.choices[0].message.content == out.text
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, response_format={"type": "json_object"})
