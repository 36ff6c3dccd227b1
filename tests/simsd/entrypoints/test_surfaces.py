"""The refused combinations of settings are data (:class:`simsd.config.vocabulary.Rule`), each
reached by its own example and by nothing else first; and the three surfaces refuse the same
requests: the command line (``simsd generate``), the Python API (``simsd.LLM``) and the server
(``POST /v1/completions``) all reach one check of a request's rules
(:func:`simsd.config.request.check_request`), so the same bad settings are refused by each,
naming the same setting; and a setting that only has no effect (a seed under greedy decoding) is
taken by each (the command line says so)."""
import dataclasses
import re

import pytest

from simsd import LLM, ParamError, SamplingParams
from simsd.config.engine import ENGINE_RULES, EngineArgs
from simsd.config.request import REQUEST_RULES, check_request
from simsd.config.speculative import SPECULATIVE_RULES
from simsd.config.vocabulary import Settings
from simsd.entrypoints.arguments import options_of
from simsd.entrypoints.cli import main

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from simsd.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.simsd.entrypoints.serving import running_server  # noqa: E402

RULES = SPECULATIVE_RULES + ENGINE_RULES + REQUEST_RULES
BLOCK, VOCAB = 4, 6144  # the bundled pair's block length and vocabulary


def expected(rule):
    """``(param, message)`` the rule gives for its own example."""
    engine, request = rule.example
    s = Settings(request, engine, {"block_length": BLOCK, "vocab_size": VOCAB, "apart": None}, SamplingParams(),
                 EngineArgs())
    return rule.name(s), ParamError(None, rule.text(s)).render()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(map(str, r.example[1] or r.example[0])))
def test_every_rule_is_reached_by_its_example(rule):
    """Each rule's example is refused by that rule (its param and its message, no earlier rule or
    range check first): an engine's settings when :class:`EngineArgs` is built (the API's and the
    command line's way in), a request's by :func:`check_request` against its engine."""
    engine, request = rule.example
    param, message = expected(rule)
    with pytest.raises(ParamError) as exc:
        config = EngineArgs(**engine)
        if request:
            check_request(SamplingParams(**request), dataclasses.replace(config, block_length=BLOCK), VOCAB)
    assert (exc.value.param, str(exc.value)) == (param, message)
    assert request or not any(not r.example[1] and r.example == rule.example for r in RULES if r is not rule)


def cli_flags(settings: dict) -> list | None:
    """``simsd generate``'s options for ``settings``, None when one is not an option of it."""
    specs, flags = options_of("generate"), []
    for name, value in settings.items():
        if name not in specs or isinstance(value, list):
            return None
        flag, default = specs[name]
        if isinstance(value, bool):
            flags += [flag, "on" if value else "off"] if default is None else [flag] if value != default else []
        else:
            flags += [flag, str(value)]
    return flags


def words_of(message: str) -> str:
    """The longest run of a message without a setting's name (each surface spells those its way)."""
    return max(re.split(r"\b(?:%s)\b" % "|".join(options_of("generate")) + r"|\x00", message), key=len).strip()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: "-".join(map(str, r.example[1] or r.example[0])))
def test_every_surface_refuses_each_rule(llms, capsys, rule):
    """Each rule's example through the surfaces that take its settings: the command line when
    they are options of ``simsd generate``; the Python API (an engine's settings when the
    :class:`LLM` is built, a request's when it is submitted); the server for a request's."""
    engine, request = rule.example
    param, message = expected(rule)
    words = words_of(rule.text(Settings(request, engine, {"block_length": BLOCK, "vocab_size": VOCAB, "apart": None},
                                        SamplingParams(), EngineArgs())))
    flags = cli_flags({"mode": "exact", **engine, **request})  # (simsd generate's default mode is vanilla)
    if flags is not None:
        code = main(["generate", "--prompt-ids", "5,6", "--max-tokens", "4", *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1].startswith("simsd: error: ") and words in err[-1], (words, err)
    if not request:
        with pytest.raises(ParamError) as exc:
            LLM(batch_size=1, max_model_len=64, dtype="float32", device="cpu", **engine)
        assert (exc.value.param, str(exc.value)) == (param, message)
        return
    llm = llms(engine.get("mode", "exact"), engine)
    with pytest.raises(ParamError) as exc:
        llm.generate([5, 6], SamplingParams(max_tokens=4, **request))
    assert exc.value.param == param and words in str(exc.value), (words, str(exc.value))
    status, body = server_answer(llm, request)
    assert status == 400 and words in body["error"]["message"] and body["error"]["param"] == param, body


#: refusals besides the rules: (mode, engine settings, command-line flags, request fields, the
#: setting named, words of the message)
REFUSED = [
    ("vanilla", {}, ["--gamma", "2"], {"gamma": 2}, "gamma", "used by the paper and exact modes only"),
    ("exact", {}, ["--strategy", "static", "--threshold", "0.5"], {"strategy": "static", "threshold": 0.5},
     "threshold", "applies to the dynamic and entropy strategies"),
    ("exact", {}, ["--draft-strategy", "static", "--draft-threshold", "0.5"],
     {"draft_strategy": "static", "draft_threshold": 0.5}, "draft_threshold", "applies to the dynamic and entropy"),
]


@pytest.fixture(scope="module")
def llms():
    made = {}

    def get(mode, engine):
        key = (mode, tuple(sorted(engine.items())))
        if key not in made:
            made[key] = LLM(**{"mode": mode, **engine}, batch_size=1, max_model_len=64, dtype="float32",
                            device="cpu")
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
