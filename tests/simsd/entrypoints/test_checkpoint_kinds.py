"""What a run says about its checkpoints, the same in ``simsd generate``, ``bench``, ``serve`` and
``simsd.LLM``: a plain autoregressive Qwen3 (no block_size, no mask token) is refused in one line
unless the block length and the mask id are given explicitly, and then decodes as its SDAR twin
(the same weights declared as SDAR); a draft larger than the target is said once, not refused."""
import json
import warnings

import pytest

import simsd
from simsd.entrypoints.cli import main, parse
from simsd.models.config import CheckpointError
from tests.helpers import plain_qwen3_twin, random_checkpoint

IDS = [5, 6, 7, 8, 9]
EXPLICIT = ["--block-length", "4", "--mask-token-id", "255"]  # the twin's block_size and mask id


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(SDAR checkpoint, its plain-Qwen3 twin); vocabulary 256, mask 255, stop 254."""
    sdar = random_checkpoint("kinds", tokenizer=False)
    return sdar, plain_qwen3_twin(sdar, tmp_path_factory.mktemp("kinds") / "qwen3")


@pytest.fixture(scope="module")
def big_draft():
    """A draft of the same vocabulary with twice the hidden size (more parameters than the target)."""
    return random_checkpoint("kinds-big", tokenizer=False, hidden_size=128)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", [
    ["generate", "--mode", "vanilla", "--prompt-ids", "5,6,7"],
    ["bench", "--modes", "vanilla", "--prompt-ids", "5,6,7"],
    ["serve", "--mode", "vanilla", "--port", "0"],
])
def test_a_plain_qwen3_is_refused_in_one_line(capsys, pair, command):
    if command[0] == "serve":
        pytest.importorskip("fastapi")
    plain = pair[1]
    code, _, err = run(capsys, *command, "--target", str(plain))
    assert code == 2, err
    assert err == (f"simsd: error: {plain / 'config.json'}: no block_size and no mask token (mask_token_id, or "
                   f"the tokenizer's mask_token): simsd decodes block-diffusion (SDAR) models; to decode this qwen3 "
                   f"checkpoint as one, pass --block-length N and --mask-token-id ID (simsd.LLM: block_length=N, "
                   f"mask_token_id=ID)\n")


def test_the_api_refuses_a_plain_qwen3(pair):
    with pytest.raises(CheckpointError, match="no block_size and no mask token"):
        simsd.LLM(pair[1], mode="vanilla")
    with pytest.raises(CheckpointError, match=r"config.json: no block_size: .*pass --block-length N"):
        simsd.LLM(pair[1], mode="vanilla", mask_token_id=255)
    info = simsd.models.loading.read_checkpoint(pair[1], block_length=4, mask_token_id=255)
    with pytest.raises(CheckpointError, match="no block_size"):  # read with a block length, given without
        simsd.LLM(info, mode="vanilla")
    with pytest.raises(simsd.ParamError, match="mask_token_id 7 differs from the mask token id 255"):
        simsd.LLM(info, mode="vanilla", block_length=4, mask_token_id=7)


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_explicit_options_decode_a_plain_qwen3_as_its_sdar_twin(capsys, pair, mode):
    sdar, plain = pair
    base = ["generate", "--mode", mode, "--prompt-ids", ",".join(map(str, IDS)), "--max-new-tokens", "12", "--json"]
    code, want, err = run(capsys, *base, "--target", str(sdar), *(["--draft", str(sdar)] if mode != "vanilla" else []))
    assert code == 0, err
    code, got, err = run(capsys, *base, "--target", str(plain), *(["--draft", str(plain)] if mode != "vanilla" else []),
                         *EXPLICIT)
    assert code == 0, err
    assert "warning" not in err  # the explicit block length is the run's; no checkpoint block_size to differ from
    assert json.loads(got)["token_ids"] == json.loads(want)["token_ids"] and json.loads(want)["token_ids"]

    kwargs = {"draft": plain} if mode != "vanilla" else {}
    llm = simsd.LLM(plain, mode=mode, block_length=4, mask_token_id=255, batch_size=1, **kwargs)
    try:
        out = llm.generate([IDS], simsd.SamplingParams(max_tokens=12))[0]
    finally:
        llm.shutdown()
    assert out.token_ids == json.loads(want)["token_ids"]


def test_serve_takes_the_explicit_options(pair):
    pytest.importorskip("fastapi")
    from simsd.entrypoints.serve import build_llm
    llm = build_llm(parse(["serve", "--target", str(pair[1]), "--mode", "vanilla",
                                               "--max-batch-size", "1", *EXPLICIT]))
    try:
        assert llm.block_length == 4 and llm.target.mask_token_id == 255
        assert llm.generate([IDS], simsd.SamplingParams(max_tokens=4))[0].token_ids
    finally:
        llm.shutdown()


LARGER = "is larger than the target"


def test_a_larger_draft_is_said_once_on_the_command_line(capsys, pair, big_draft):
    sdar = pair[0]
    line = (f"simsd: warning: the draft {big_draft.name} (0.4M parameters) is larger than the target {sdar.name} "
            f"(0.2M); a draft saves time only when it is cheaper than the target")
    code, _, err = run(capsys, "generate", "--target", str(sdar), "--draft", str(big_draft), "--mode", "exact",
                       "--prompt-ids", "5,6,7", "--max-new-tokens", "4")
    assert code == 0, err
    assert [ln for ln in err.splitlines() if "warning" in ln] == [line]
    code, _, err = run(capsys, "bench", "--target", str(sdar), "--draft", str(big_draft), "--modes",
                       "vanilla,paper,exact", "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--repeats", "1")
    assert code == 0, err
    assert [ln for ln in err.splitlines() if "warning" in ln] == [line]  # three LLMs, one line
    code, _, err = run(capsys, "generate", "--target", str(big_draft), "--draft", str(sdar), "--mode", "exact",
                       "--prompt-ids", "5,6,7", "--max-new-tokens", "4")
    assert code == 0 and "warning" not in err, err  # a smaller draft: nothing to say


def larger_draft_warnings(build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every emission counts
        llm = build()
    llm.shutdown()
    return [str(w.message) for w in caught if issubclass(w.category, simsd.SimsdWarning) and LARGER in str(w.message)]


def test_a_larger_draft_is_said_once_by_the_api_and_serve(pair, big_draft):
    sdar = pair[0]
    said = larger_draft_warnings(lambda: simsd.LLM(sdar, big_draft, "exact", batch_size=1))
    assert said == [f"the draft {big_draft.name} (0.4M parameters) is larger than the target {sdar.name} (0.2M); "
                    f"a draft saves time only when it is cheaper than the target"]
    assert larger_draft_warnings(lambda: simsd.LLM(big_draft, sdar, "exact", batch_size=1)) == []
    pytest.importorskip("fastapi")
    from simsd.entrypoints.serve import build_llm
    args = parse(["serve", "--target", str(sdar), "--draft", str(big_draft),
                                      "--max-batch-size", "1"])
    assert len(larger_draft_warnings(lambda: build_llm(args))) == 1
