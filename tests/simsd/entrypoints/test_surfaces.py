"""The three surfaces refuse the same requests: the command line (``simsd generate``), the Python
API (``simsd.LLM``) and the server (``POST /v1/completions``) all reach one check of a request's
rules (:func:`simsd.config.request.check_request`), so the same bad settings are refused by each,
naming the same setting; and a setting that only has no effect (a seed under greedy decoding) is
taken by each (the command line says so)."""
import pytest

from simsd import LLM, ParamError, SamplingParams
from simsd.entrypoints.cli import main

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from simsd.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.simsd.entrypoints.serving import running_server  # noqa: E402

#: (mode, engine settings, command-line flags, request fields, the setting named, words of the message)
REFUSED = [
    ("exact", {}, ["--gamma", "9"], {"gamma": 9}, "gamma", "exceeds the block length 4"),
    ("vanilla", {}, ["--gamma", "2"], {"gamma": 2}, "gamma", "used by the paper and exact modes only"),
    ("exact", {}, ["--strategy", "entropy", "--steps", "2"], {"strategy": "entropy", "steps": 2}, "steps",
     "the entropy strategy picks how many tokens a step reveals"),
    ("exact", {"on_reject": "fallback"}, ["--on-reject", "fallback", "--gamma", "1"], {"gamma": 1}, "on_reject",
     "never falls back"),
    ("exact", {}, ["--strategy", "static", "--threshold", "0.5"], {"strategy": "static", "threshold": 0.5},
     "threshold", "applies to the dynamic and entropy strategies"),
    ("exact", {}, ["--draft-strategy", "static", "--draft-threshold", "0.5"],
     {"draft_strategy": "static", "draft_threshold": 0.5}, "draft_threshold", "applies to the dynamic and entropy"),
]
ENGINE_FLAGS = {"on_reject": "--on-reject"}


@pytest.fixture(scope="module")
def llms():
    made = {}

    def get(mode, engine):
        key = (mode, tuple(sorted(engine.items())))
        if key not in made:
            made[key] = LLM(mode=mode, batch_size=1, max_model_len=64, dtype="float32", device="cpu", **engine)
        return made[key]
    yield get
    for llm in made.values():
        llm.shutdown()


def server_answer(llm, fields):
    with running_server(build_app(llm, shutdown_llm=False)) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-sdar-target", "prompt": [5, 6], "max_tokens": 4,
                                                      **fields}, timeout=120)
    return r.status_code, r.json()


@pytest.mark.parametrize("mode,engine,flags,fields,param,words", REFUSED, ids=[c[4] + "-" + c[0] for c in REFUSED])
def test_every_surface_refuses_the_same(llms, capsys, mode, engine, flags, fields, param, words):
    code = main(["generate", "--mode", mode, "--prompt-ids", "5,6", "--max-tokens", "4", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("simsd: error: ") and words in err[-1], err
    llm = llms(mode, engine)
    with pytest.raises(ParamError, match=words) as exc:
        llm.generate([5, 6], SamplingParams(max_tokens=4, **fields))
    assert exc.value.param == param
    status, body = server_answer(llm, fields)
    assert status == 400 and words in body["error"]["message"] and body["error"]["param"] == param, body


def test_a_setting_without_effect_is_taken_by_every_surface(llms, capsys):
    """A seed under greedy decoding: the command line warns and decodes; the API and the server
    decode (OpenAI's clients send a seed by habit)."""
    code = main(["generate", "--mode", "exact", "--prompt-ids", "5,6", "--max-tokens", "4", "--seed", "3"])
    out, err = capsys.readouterr()
    assert code == 0 and out.strip() and "simsd: warning: --seed: greedy decoding" in err, err
    llm = llms("exact", {})
    (o,) = llm.generate([5, 6], SamplingParams(max_tokens=4, seed=3))
    assert o.token_ids
    status, body = server_answer(llm, {"seed": 3})
    assert status == 200 and body["choices"][0]["text"] == o.text, body


@pytest.mark.parametrize("stop,words", [
    (["s"] * 17, "stop: at most 16 stop strings, got 17"),
    (["x" * 1000, "y" * 25], "stop: the stop strings hold 1025 characters, at most 1024 in all"),
    ([f"s{i}" for i in range(20000)], "stop: at most 16 stop strings, got 20000"),  # issue 34's 560 KB of them
])
def test_the_api_and_the_server_refuse_the_same_stop_lists(llms, stop, words):
    """Stop strings are bounded (16, 1024 characters in all) by the request's check, so the API
    and the server refuse the same lists, naming ``stop`` (the command line takes no stop
    strings); the bound itself is taken."""
    llm = llms("exact", {})
    with pytest.raises(ParamError, match=words) as exc:
        llm.generate([5, 6], SamplingParams(max_tokens=4, stop=stop))
    assert exc.value.param == "stop"
    status, body = server_answer(llm, {"stop": stop})
    assert status == 400 and body["error"]["param"] == "stop" and words in body["error"]["message"], body
    edge = ["x" * 64] * 15 + ["y" * 64]  # 16 strings, 1024 characters
    (o,) = llm.generate([5, 6], SamplingParams(max_tokens=4, stop=edge))
    status, body = server_answer(llm, {"stop": edge})
    assert status == 200 and body["choices"][0]["text"] == o.text, body
