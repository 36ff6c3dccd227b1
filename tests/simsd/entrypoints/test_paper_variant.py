"""``paper_variant`` (paper mode as described, or as the SimSD release runs it) where paper mode
is offered: ``simsd generate`` and ``simsd bench`` (``--paper-variant``), the Python API
(``LLM(paper_variant=...)``) and the server (``simsd serve --paper-variant``); refused where it
does not apply, in one line naming the option."""
import json

import pytest

from simsd import DecodeConfig, load_checkpoint
from simsd.config.request import SamplingParams
from simsd.decoding.config import resolve
from simsd.entrypoints.api import LLM
from simsd.entrypoints.cli import main, parse
from simsd.entrypoints.errors import ParamError
from simsd.speculative import SpecConfig, speculative_generate
from simsd.speculative.verifiers import ReleaseVerifier
from tests.helpers import random_checkpoint
from tests.simsd.speculative.reference_pair import prompt_of, reference_pair_paths

PROMPT = prompt_of(9)


@pytest.fixture(scope="module")
def paths():
    return [str(p) for p in reference_pair_paths()]


@pytest.fixture(scope="module")
def want(paths):
    """The release variant's and the described variant's tokens on the random pair (they differ)."""
    target, draft = (load_checkpoint(p, with_tokenizer=False) for p in paths)
    cfg = DecodeConfig(block_length=4, max_new_tokens=12)
    got = {v: speculative_generate(target, draft, PROMPT, cfg, SpecConfig(mode="paper", paper_variant=v)).token_ids
           for v in ("described", "release")}
    assert got["described"] != got["release"]  # the pair tells the variants apart
    return got


def test_llm_runs_the_variant(paths, want):
    for variant in ("described", "release"):
        llm = LLM(*paths, "paper", paper_variant=variant, batch_size=1, max_model_len=64, scheduler_thread=False)
        try:
            assert llm.config.paper_variant == variant
            out = llm.generate([PROMPT], SamplingParams(max_tokens=12))[0]
            assert out.token_ids == want[variant]
        finally:
            llm.shutdown()


def test_llm_refusals(paths):
    with pytest.raises(ValueError, match="variant of paper mode"):
        LLM(*paths, "exact", paper_variant="release")
    with pytest.raises(ValueError, match="paper_variant must be one of described, release"):
        LLM(*paths, "paper", paper_variant="published")
    with pytest.raises(ValueError, match="no gamma"):
        LLM(*paths, "paper", paper_variant="release", max_gamma=2)
    with pytest.raises(ValueError, match="fallback"):
        LLM(*paths, "paper", paper_variant="release", on_reject="fallback")
    llm = LLM(*paths, "paper", paper_variant="release", batch_size=1, max_model_len=64, scheduler_thread=False)
    try:
        with pytest.raises(ParamError, match="release variant") as err:
            llm.generate([PROMPT], SamplingParams(max_tokens=4, gamma=2))
        assert err.value.param == "gamma"
    finally:
        llm.shutdown()


def test_generate_cli_runs_the_variant(paths, want, capsys):
    ids = ",".join(map(str, PROMPT))
    for variant in ("described", "release"):
        code = main(["generate", "--target", paths[0], "--draft", paths[1], "--mode", "paper", "--paper-variant",
                     variant, "--prompt-ids", ids, "--max-new-tokens", "12", "--block-length", "4", "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert json.loads(out)["token_ids"] == want[variant]


@pytest.mark.parametrize("argv,words", [
    (["--mode", "exact", "--paper-variant", "release"], "--paper-variant is a variant of paper mode"),
    (["--mode", "vanilla", "--paper-variant", "described"], "--paper-variant is a variant of paper mode"),
    (["--mode", "paper", "--paper-variant", "release", "--gamma", "2"], "--gamma: the release variant"),
    (["--mode", "paper", "--paper-variant", "release", "--on-reject", "fallback"], "--on-reject: the release variant"),
])
def test_cli_refusals(argv, words, capsys):
    code = main(["generate", "--prompt-ids", "5,6", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("simsd: error: ") and words in err and err.count("\n") == 1


def test_bench_names_the_release_row(tmp_path, capsys):
    ck = str(random_checkpoint("cli", tokenizer=True))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [4, 5, 6, 7, 8]}))
    out = tmp_path / "b.json"
    code = main(["bench", "--target", ck, "--draft", ck, "--prompts-file", str(prompts), "--max-new-tokens", "8",
                 "--modes", "vanilla,paper", "--paper-variant", "release", "--repeats", "1", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"vanilla", "paper-release"}
    assert "top1_agreement" not in rows["paper-release"]  # the described variant's diagnostics only


def test_serve_passes_the_variant_and_refuses_it_outside_paper_mode(capsys):
    pytest.importorskip("fastapi")
    from simsd.entrypoints.serve import build_llm
    llm = build_llm(parse(["serve", "--mode", "paper", "--paper-variant", "release", "--max-batch-size", "1"]))
    try:
        assert llm.config.paper_variant == "release"
        # what each request's rows run
        _, spec, _ = resolve(SamplingParams(max_tokens=4), llm.config, llm.target.config.vocab_size)
        assert spec.paper_variant == "release"
    finally:
        llm.shutdown()
    code = main(["serve", "--mode", "exact", "--paper-variant", "release"])
    err = capsys.readouterr().err
    assert code == 2 and "--paper-variant is a variant of paper mode" in err and err.count("\n") == 1


def test_release_rows_use_the_release_verifier(paths):
    from simsd.speculative.decoder import SpeculativeDecoder
    target, draft = (load_checkpoint(p, with_tokenizer=False) for p in paths)
    dec = SpeculativeDecoder(target, draft, DecodeConfig(block_length=4), SpecConfig(mode="paper",
                                                                                    paper_variant="release"))
    assert dec.verifier_class is ReleaseVerifier
