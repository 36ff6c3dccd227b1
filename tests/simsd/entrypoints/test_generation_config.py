"""The target's generation_config.json sampling fields as the defaults of requests (vLLM's
``--generation-config auto``; issue 38 item 3): temperature, top_k (vLLM's -1: off), top_p and
repetition_penalty, in the Python API, the server and ``simsd generate``;
``generation_config="none"`` keeps simsd's own (greedy)."""
import dataclasses
import json
import shutil
import warnings

import pytest

from simsd import LLM, SamplingParams
from simsd.entrypoints.cli import main
from tests.helpers import random_checkpoint

FILE = {"eos_token_id": 1, "do_sample": True, "temperature": 1.5, "top_k": -1, "top_p": 0.9, "repetition_penalty": 1.3}
PROMPT = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """A small checkpoint whose generation_config.json sets sampling fields."""
    dst = tmp_path_factory.mktemp("gencfg") / "ck"
    shutil.copytree(random_checkpoint("gencfg", tokenizer=True), dst)
    (dst / "generation_config.json").write_text(json.dumps(FILE))
    return dst


def llm_of(ck, **kw):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        llm = LLM(ck, mode="vanilla", dtype="float32", device="cpu", batch_size=1, **kw)
    return llm, [str(w.message) for w in seen]


def test_the_file_gives_the_api_defaults_and_a_request_samples_with_them(ck):
    llm, notes = llm_of(ck)
    try:
        d = llm.default_params
        assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty) == (1.5, 0, 0.9, 1.3)
        assert llm.default_params.max_tokens == SamplingParams().max_tokens  # max_new_tokens is not taken
        out = llm.generate([PROMPT])[0]
        explicit = SamplingParams(temperature=1.5, top_p=0.9, repetition_penalty=1.3, seed=out.seed)
        assert llm.generate([PROMPT], explicit)[0].outputs[0].token_ids == out.outputs[0].token_ids
        unpenalized = dataclasses.replace(explicit, repetition_penalty=1.0)  # the file's penalty acts
        assert llm.generate([PROMPT], unpenalized)[0].outputs[0].token_ids != out.outputs[0].token_ids
        greedy = llm.generate([PROMPT], SamplingParams())[0].outputs[0].token_ids
        assert greedy != out.outputs[0].token_ids  # (the file's temperature draws other tokens here)
        # given default_params are the caller's: the file does not change them
        mine = SamplingParams(max_tokens=7)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            other = LLM.from_config(llm.config, default_params=mine)
        assert other.default_params == mine and other.shutdown(timeout=60)
    finally:
        assert llm.shutdown(timeout=60)
    # only do_sample is named as not applied (vLLM reads the temperature, not do_sample)
    assert len(notes) == 1 and "do_sample=True not applied" in notes[0] and "temperature" not in notes[0].split(":")[1]


def test_none_keeps_simsds_greedy_defaults_and_says_nothing(ck):
    llm, notes = llm_of(ck, generation_config="none")
    try:
        assert llm.default_params == SamplingParams() and llm.default_params.greedy
        out = llm.generate([PROMPT])[0]
        assert out.outputs[0].token_ids == llm.generate([PROMPT], SamplingParams())[0].outputs[0].token_ids
    finally:
        assert llm.shutdown(timeout=60)
    assert notes == []


def test_a_bad_value_in_the_file_is_refused_naming_it(tmp_path):
    from simsd.models.config import CheckpointError
    dst = tmp_path / "bad"
    shutil.copytree(random_checkpoint("gencfg", tokenizer=True), dst)
    (dst / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(CheckpointError, match=r"generation_config.json: .*top_p"):
        LLM(dst, mode="vanilla", dtype="float32", device="cpu", batch_size=1)
    LLM(dst, mode="vanilla", dtype="float32", device="cpu", batch_size=1, generation_config="none").shutdown()


def test_the_server_samples_a_request_without_temperature_with_the_files(ck):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from simsd.entrypoints.openai.api_server import build_app
    from tests.simsd.entrypoints.serving import running_server
    llm, _ = llm_of(ck)
    try:
        with running_server(build_app(llm, "m", shutdown_llm=False)) as url:
            r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 16},
                           timeout=120).json()
            seed = r["choices"][0]["simsd"]["seed"]
            same = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 16,
                                                              "temperature": 1.5, "top_p": 0.9, "seed": seed},
                              timeout=120).json()
            greedy = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 16,
                                                                "temperature": 0}, timeout=120).json()
        assert r["choices"][0]["text"] == same["choices"][0]["text"]
        assert r["choices"][0]["text"] != greedy["choices"][0]["text"]
    finally:
        assert llm.shutdown(timeout=60)


def test_simsd_generate_takes_the_file_for_options_not_typed(ck, capsys):
    def tokens(*extra):
        code = main(["generate", "--target", str(ck), "--prompt-ids", ",".join(map(str, PROMPT)),
                     "--max-tokens", "16", "--json", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out)["token_ids"]
    auto = tokens()
    assert auto == tokens("--temperature", "1.5", "--top-p", "0.9")  # (--seed 0 by default)
    assert auto != tokens("--generation-config", "none")
    none = tokens("--generation-config", "none")
    assert tokens("--temperature", "0", "--repetition-penalty", "1") == none  # typed options win
    assert tokens("--temperature", "0") != none  # greedy, with the file's repetition_penalty (as vLLM)


def test_simsd_generate_warns_of_greedy_only_when_the_run_is_greedy(ck, capsys):
    """--top-p and --seed typed without --temperature: the checkpoint's temperature makes the run
    sampled, so they take effect and nothing is said of them; with --temperature 0 (or the
    generation config off) the run is greedy and each is named as ignored."""
    def said(*extra):
        code = main(["generate", "--target", str(ck), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens",
                     "4", "--top-p", "0.8", "--seed", "3", *extra])
        err = capsys.readouterr().err
        assert code == 0, err
        return [line.split("simsd: warning: ")[1].split(":")[0].split(" ")[0] for line in err.splitlines()
                if line.startswith("simsd: warning: --")]
    assert said() == []
    assert said("--temperature", "0") == ["--top-p", "--seed"]
    assert said("--generation-config", "none") == ["--top-p", "--seed"]
