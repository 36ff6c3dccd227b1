"""The ``simsd`` command-line contract (run in-process)."""
import json
import re
import shutil

import pytest

from simsd.entrypoints.cli import main
from simsd.testing import make_random_checkpoint
from tests.helpers import random_checkpoint


@pytest.fixture(scope="module")
def ckdir():
    return random_checkpoint("cli", tokenizer=True)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def api_run(path, prompt_ids, max_new_tokens, mode="vanilla", draft=None, **cfg):
    """The tokens and stats of the Python API for what the CLI is asked (greedy, B = 4)."""
    from simsd import DecodeConfig, load_checkpoint, vanilla_generate
    from simsd.speculative import SpecConfig, speculative_generate
    ck = load_checkpoint(path)
    config = DecodeConfig(block_length=4, max_new_tokens=max_new_tokens, **cfg)
    if mode == "vanilla":
        return vanilla_generate(ck.model, prompt_ids, config, ck.mask_token_id, ck.stop_ids), ck
    return speculative_generate(ck, load_checkpoint(draft), prompt_ids, config, SpecConfig(mode=mode)), ck


def chat_ids(ck, text):
    formatted = ck.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
    return ck.tokenizer(formatted, add_special_tokens=False)["input_ids"]


def test_generate_json(ckdir, capsys):
    code, out, err = run(capsys, "generate", "--mode", "vanilla", "--target", str(ckdir), "--prompt", "def add(a, b):",
                         "--max-new-tokens", "10", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 1
    row = rows[0]
    from simsd import load_checkpoint
    ids = chat_ids(load_checkpoint(ckdir), "def add(a, b):")
    want, ck = api_run(ckdir, ids, 10)
    assert row["token_ids"] == want.token_ids and len(want.token_ids) == 10
    assert row["text"] == ck.tokenizer.decode(want.token_ids, skip_special_tokens=False)
    assert row["prompt"] == "def add(a, b):" and row["id"] == "prompt"
    s = row["stats"]
    assert s["mode"] == "vanilla" and s["new_tokens"] == 10 and s["blocks"] == want.stats["blocks"]
    assert s["target_forwards"] == want.stats["target_forwards"]
    assert s["tokens_per_second"] == pytest.approx(10 / s["decode_seconds"])


def test_a_whitespace_prompt_is_text(ckdir, capsys, tmp_path):
    """A prompt of spaces is text for a language model, as the API and the server take it: the
    command line decodes it (``--prompt`` and a prompt file) into the API's tokens; only an empty
    prompt is refused, in those words (see test_ignored_or_empty_inputs_are_errors)."""
    from simsd import load_checkpoint
    want, _ = api_run(ckdir, chat_ids(load_checkpoint(ckdir), "  "), 6)
    f = tmp_path / "blank.jsonl"
    f.write_text('{"prompt": "  "}\n')
    for source in (["--prompt", "  "], ["--prompts-file", str(f)]):
        code, out, err = run(capsys, "generate", "--target", str(ckdir), *source, "--max-new-tokens", "6", "--json")
        assert code == 0, err
        assert json.loads(out)["token_ids"] == want.token_ids and want.token_ids


def test_generate_text_summary(ckdir, capsys):
    code, out, _ = run(capsys, "generate", "--mode", "vanilla", "--target", str(ckdir), "--prompt-ids", "5,6,7,8,9",
                       "--max-new-tokens", "6")
    assert code == 0
    want, ck = api_run(ckdir, [5, 6, 7, 8, 9], 6)
    lines = out.rstrip("\n").split("\n")
    assert "\n".join(lines[:-1]) == ck.tokenizer.decode(want.token_ids, skip_special_tokens=False)
    fwd = want.stats["target_forwards"] / 6
    assert re.fullmatch(rf"\[vanilla\] 6 tokens in [0-9.]+ s \([0-9.]+ tokens/s\), target forwards/token {fwd:.3f}",
                        lines[-1]), lines[-1]


def test_generate_defaults_to_exact_mode(ckdir, capsys):
    """simsd generate's default mode is exact, as simsd serve's and simsd.LLM()'s (EngineArgs.mode);
    a target other than the bundled one, given without a draft, drafts for itself (draft="self":
    no draft model, no draft forward) and prints vanilla decoding's tokens."""
    from simsd.config.engine import EngineArgs
    from simsd.entrypoints.arguments import build_parser
    assert EngineArgs().mode == "exact"
    for command in ("generate", "serve"):
        assert build_parser().parse_args([command]).mode == "exact"  # EngineArgs' default, one for every command
    code, out, err = run(capsys, "generate", "--target", str(ckdir), "--prompt-ids", "5,6,7,8,9",
                         "--max-new-tokens", "8", "--json")
    assert code == 0, err
    s = json.loads(out)["stats"]
    want, _ = api_run(ckdir, [5, 6, 7, 8, 9], 8)
    assert json.loads(out)["token_ids"] == want.token_ids
    assert s["mode"] == "exact" and s["draft_forwards"] == 0 and "and draft" not in err


@pytest.mark.parametrize("mode", ["paper", "exact"])
def test_generate_speculative_modes(ckdir, capsys, mode):
    code, out, err = run(capsys, "generate", "--target", str(ckdir), "--draft", str(ckdir), "--mode", mode,
                         "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "8", "--json")
    assert code == 0, err
    row = json.loads(out)
    want, _ = api_run(ckdir, [5, 6, 7, 8, 9], 8, mode=mode, draft=ckdir)
    assert row["token_ids"] == want.token_ids and len(want.token_ids) == 8
    if mode == "exact":
        assert want.token_ids == api_run(ckdir, [5, 6, 7, 8, 9], 8)[0].token_ids
    stats = row["stats"]
    assert stats["mode"] == mode and stats["new_tokens"] == 8
    for key in ("target_forwards", "draft_forwards", "rounds", "blocks"):
        assert stats[key] == want.stats[key], key


def test_stop_id_ends_the_output_and_not_the_text(ckdir, capsys, tmp_path):
    """A checkpoint whose generation_config names a token the model generates: the ids end at
    that stop id, the printed text leaves it out."""
    free, ck = api_run(ckdir, [5, 6, 7, 8, 9], 12)
    g = next(i for i in range(2, 12) if free.token_ids.index(free.token_ids[i]) == i)
    stop = free.token_ids[g]
    path = tmp_path / "stopping"
    shutil.copytree(ckdir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop, 1]}))
    for mode in ("vanilla", "exact"):
        extra = [] if mode == "vanilla" else ["--mode", "exact", "--draft", str(ckdir)]
        code, out, err = run(capsys, "generate", "--target", str(path), *extra, "--prompt-ids", "5,6,7,8,9",
                             "--max-new-tokens", "12", "--json")
        assert code == 0, err
        row = json.loads(out)
        assert row["token_ids"] == free.token_ids[:g + 1], mode
        assert row["text"] == ck.tokenizer.decode(free.token_ids[:g], skip_special_tokens=False)
        assert row["stats"]["new_tokens"] == g + 1


def test_exact_mode_cli_equals_vanilla(ckdir, capsys):
    args = ["--target", str(ckdir), "--prompt-ids", "5,6,7,8,9,10", "--max-new-tokens", "12", "--json"]
    _, van, _ = run(capsys, "generate", *args)
    _, ex, _ = run(capsys, "generate", *args, "--draft", str(random_checkpoint("cli-draft", tokenizer=True, seed=4,
                                                                                 num_hidden_layers=1)),
                   "--mode", "exact")
    assert json.loads(van)["token_ids"] == json.loads(ex)["token_ids"]


def test_prompts_file(ckdir, capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Let x be"}) + "\n\n" + json.dumps({"prompt_ids": [4, 5, 6]}) + "\n")
    code, out, err = run(capsys, "generate", "--target", str(ckdir), "--prompts-file", str(f),
                         "--max-new-tokens", "4", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == ["p.jsonl:1", "p.jsonl:3"]
    from simsd import load_checkpoint
    ck = load_checkpoint(ckdir)
    assert rows[0]["token_ids"] == api_run(ckdir, chat_ids(ck, "Let x be"), 4)[0].token_ids
    assert rows[1]["token_ids"] == api_run(ckdir, [4, 5, 6], 4)[0].token_ids


@pytest.mark.parametrize("content,needle", [("{not json", ":1: invalid JSON"), ('{"text": 1}', ':1: need exactly one'),
                                            ("", "no prompts")])
def test_bad_prompts_file(ckdir, capsys, tmp_path, content, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    code, _, err = run(capsys, "generate", "--target", str(ckdir), "--prompts-file", str(f))
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_bad_inputs(ckdir, capsys, tmp_path):
    def err_of(*argv):
        code, _, err = run(capsys, "generate", *argv)
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1
        return err

    assert "not found" in err_of("--target", str(tmp_path / "nope"), "--prompt-ids", "1")
    assert "not found" in err_of("--draft", str(tmp_path / "nope"), "--mode", "exact", "--prompt-ids", "1")
    assert "not found" in err_of("--target", str(ckdir), "--prompts-file", str(tmp_path / "none.jsonl"))
    weights = ckdir / "model.safetensors"  # a file given for a checkpoint directory is named as a file
    assert f"simsd: error: {weights} is a file, not a checkpoint directory" in err_of("--target", str(weights),
                                                                                       "--prompt-ids", "1")
    assert f"{ckdir / 'config.json'} is a file, not a checkpoint directory" in err_of(
        "--draft", str(ckdir / "config.json"), "--mode", "exact", "--prompt-ids", "1")
    assert "outside the vocabulary" in err_of("--target", str(ckdir), "--prompt-ids", "1,999999")
    assert "comma-separated" in err_of("--target", str(ckdir), "--prompt-ids", "1,x")
    assert "unknown strategy" in err_of("--target", str(ckdir), "--prompt-ids", "1", "--strategy", "fancy")
    assert "maximum length" in err_of("--target", str(ckdir), "--prompt-ids", ",".join(["5"] * 3000))

    bad_type = tmp_path / "bad_type"
    shutil.copytree(ckdir, bad_type)
    cfg = json.loads((bad_type / "config.json").read_text())
    (bad_type / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    assert "unknown model_type 'llama'" in err_of("--target", str(bad_type), "--prompt-ids", "1")


def test_weight_shape_mismatch_names_tensor(capsys, tmp_path):
    path = make_random_checkpoint(tmp_path / "ck", tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    code, _, err = run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2")
    assert code == 2 and "model.layers.0.mlp.down_proj.weight" in err and "(64, 128)" in err


def test_missing_mask_token(capsys, tmp_path):
    path = make_random_checkpoint(tmp_path / "ck", tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "mask_token_id": None}))
    code, _, err = run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2")
    assert code == 2 and "mask" in err


def test_sharded_and_tied_checkpoints_load(capsys, tmp_path):
    a = make_random_checkpoint(tmp_path / "single", tokenizer=False, seed=2)
    b = make_random_checkpoint(tmp_path / "sharded", tokenizer=False, seed=2, shards=3)
    outs = []
    for path in (a, b):
        code, out, err = run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2,3,4,5",
                             "--max-new-tokens", "8", "--json")
        assert code == 0, err
        outs.append(json.loads(out)["token_ids"])
    assert outs[0] == outs[1]
    tied = make_random_checkpoint(tmp_path / "tied", tokenizer=False, tie_word_embeddings=True)
    code, _, err = run(capsys, "generate", "--target", str(tied), "--prompt-ids", "1,2,3", "--max-new-tokens", "4")
    assert code == 0, err


def test_bench_command(ckdir, capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_ids": [4 + i, 5, 6, 7, 8]}) for i in range(3)))
    out_json = tmp_path / "rows.json"
    code, out, err = run(capsys, "bench", "--target", str(ckdir), "--draft", str(ckdir), "--prompts-file", str(f),
                         "--max-new-tokens", "8", "--modes", "vanilla,paper,exact", "--json", str(out_json))
    assert code == 0, err
    rows = {r["mode"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"vanilla", "paper", "exact"}
    assert rows["exact"]["identical_to_vanilla"] == 3
    assert rows["exact"]["acceptance_rate"] == 1.0  # the target is its own draft
    assert 0.0 <= rows["paper"]["top1_agreement"] <= 1.0 and rows["paper"]["positions_compared"] > 0
    assert "tok/s" in out
    # batches of 2: the same tokens per prompt, the batch size recorded
    batched = tmp_path / "rows2.json"
    code, out, err = run(capsys, "bench", "--target", str(ckdir), "--draft", str(ckdir), "--prompts-file", str(f),
                         "--max-new-tokens", "8", "--modes", "vanilla,exact", "--batch-size", "2", "--json",
                         str(batched))
    assert code == 0, err
    rows2 = {r["mode"]: r for r in json.loads(batched.read_text())["rows"]}
    assert rows2["exact"]["batch_size"] == 2 and "batch_size=2" in out
    assert rows2["exact"]["identical_to_vanilla"] == 3
    for key in ("new_tokens", "target_forwards_per_token", "accepted_per_round"):
        assert rows2["exact"][key] == rows["exact"][key]


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_batch_size_equals_one_by_one(ckdir, capsys, tmp_path, mode):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_ids": ids}) for ids in ([4, 5, 6], [7, 8, 9, 10, 11], [12] * 9)))
    args = ["generate", "--target", str(ckdir), "--mode", mode, "--prompts-file", str(f),
            "--max-new-tokens", "6", "--temperature", "1.0", "--json"]
    args += ["--draft", str(ckdir)] if mode != "vanilla" else []
    _, one, _ = run(capsys, *args)
    code, two, err = run(capsys, *args, "--batch-size", "2")
    assert code == 0, err
    ids = lambda out: [json.loads(line)["token_ids"] for line in out.splitlines()]  # noqa: E731
    assert ids(one) == ids(two) and len(ids(two)) == 3


@pytest.mark.parametrize("flags,needle", [(["--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs CUDA"),
                                          (["--tp", "0"], "--tp must be"), (["--batch-size", "0"], "batch-size")])
def test_engine_flags_refused(ckdir, capsys, flags, needle):
    code, _, err = run(capsys, "generate", "--target", str(ckdir), "--prompt-ids", "5,6", *flags)
    assert code == 2 and needle in err


def test_separate_draft_and_target_devices(ckdir, capsys):
    common = ["generate", "--target", str(ckdir), "--draft", str(ckdir), "--mode", "paper", "--prompt-ids",
              "5,6,7,8,9", "--max-new-tokens", "8", "--json"]
    _, plain, _ = run(capsys, *common)
    code, out, err = run(capsys, *common, "--target-device", "cpu", "--draft-device", "cpu", "--optimistic", "on")
    assert code == 0, err
    got = json.loads(out)
    assert got["token_ids"] == json.loads(plain)["token_ids"] and got["stats"]["speculations"] > 0


def test_default_prompt_is_a_bundled_heldout_one(capsys):
    """No prompt and no --target: the bundled target continues a held-out prompt."""
    code, out, err = run(capsys, "generate", "--max-new-tokens", "8", "--json")
    assert code == 0, err
    row = json.loads(out)
    from simsd.entrypoints.prompts import bundled_prompts
    first = bundled_prompts()[0]
    assert row["id"] == first.id and row["prompt"] == first.text
    assert 0 < row["stats"]["new_tokens"] <= 8


def test_damaged_weights_and_devices_give_one_line_errors(capsys, tmp_path):
    path = make_random_checkpoint(tmp_path / "ck", tokenizer=False)
    st = path / "model.safetensors"
    st.write_bytes(st.read_bytes()[:5000])
    code, _, err = run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2")
    assert code == 2 and "not a readable safetensors file" in err and str(st) in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "generate", "--prompt-ids", "1,2", "--device", "tpu")
    assert code == 2 and "not a device name" in err
    if not __import__("torch").cuda.is_available():
        code, _, err = run(capsys, "generate", "--prompt-ids", "1,2", "--device", "cuda")
        assert code == 2 and "no CUDA device" in err
        code, _, err = run(capsys, "generate", "--prompt-ids", "1,2", "--mode", "exact", "--draft-device", "cuda")
        assert code == 2 and "--draft-device" in err


def test_option_ranges(ckdir, capsys, tmp_path):
    def err_of(*argv):
        code, _, err = run(capsys, *argv)
        assert code == 2, err
        return err.strip().splitlines()[-1]

    assert "--limit must be an integer >= 1, got 0" in err_of("generate", "--prompt-set", "bundled", "--limit", "0")
    assert "--block-length must be an integer >= 1, got 0" in err_of("generate", "--prompt-ids", "1,2",
                                                                      "--block-length", "0")
    assert "confidence in [0, 1]" in err_of("generate", "--prompt-ids", "1,2", "--strategy", "dynamic",
                                            "--threshold", "5")
    assert "names no mode" in err_of("bench", "--modes", "", "--limit", "1")
    assert "is a directory" in err_of("bench", "--modes", "vanilla", "--limit", "1", "--json", str(tmp_path))
    assert "not a multiple of 3" in err_of("generate", "--prompt-ids", "1,2", "--tp", "3")


def test_long_prompt_refused_before_any_output(ckdir, capsys, tmp_path):
    f = tmp_path / "late.jsonl"
    lines = [{"prompt_ids": [5, 6, 7]}, {"prompt_ids": [8, 9]}, {"prompt_ids": [5] * 2040}]
    f.write_text("\n".join(json.dumps(x) for x in lines))
    code, out, err = run(capsys, "generate", "--target", str(ckdir), "--prompts-file", str(f),
                         "--max-new-tokens", "32", "--json")
    assert code == 2 and out == ""
    assert "late.jsonl:3" in err and "exceeds" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("typed", ["--max-tokens", "--max-new-tokens"])
def test_a_prompt_too_long_for_max_tokens_names_the_option_typed(ckdir, capsys, typed):
    """Issue 34: the refusal named ``max_new_tokens`` whatever the user typed."""
    code, out, err = run(capsys, "generate", "--target", str(ckdir), "--prompt-ids", "5,6,7", typed, "2046")
    assert code == 2 and out == ""
    assert f"prompt (3 tokens) + {typed} (2046) exceeds the model's maximum length 2048" in err, err
    assert "max_new_tokens" not in err.replace("--max-new-tokens", ""), err


@pytest.mark.parametrize("content,needle", [
    (b'{"prompt_ids": [5], "id": "a"}\n{"prompt_ids": [6], "id": "a"}\n', "id 'a' already used on line 1"),
    ('{"prompt": "caf\u00e9"}\n'.encode("latin-1"), "not UTF-8"),
])
def test_prompt_file_problems_are_named(ckdir, capsys, tmp_path, content, needle):
    f = tmp_path / "p.jsonl"
    f.write_bytes(content)
    code, _, err = run(capsys, "generate", "--target", str(ckdir), "--prompts-file", str(f))
    assert code == 2 and needle in err and str(f) in err


def test_prompt_file_with_bom_and_from_stdin(ckdir, capsys, tmp_path, monkeypatch):
    import io
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt_ids": [5, 6, 7]}\n')
    common = ["generate", "--target", str(ckdir), "--max-new-tokens", "4", "--json"]
    code, out, err = run(capsys, *common, "--prompts-file", str(f))
    assert code == 0, err
    monkeypatch.setattr("sys.stdin", io.StringIO('{"prompt_ids": [5, 6, 7]}\n'))
    code, piped, err = run(capsys, *common, "--prompts-file", "-")
    assert code == 0, err
    assert json.loads(piped)["token_ids"] == json.loads(out)["token_ids"]
    assert json.loads(piped)["id"] == "<stdin>:1"


@pytest.mark.parametrize("flags,needle", [
    (["--prompt", "", "--mode", "exact"], "--prompt is empty"),
    (["--prompt", "x", "--limit", "2", "--mode", "exact"], "--limit applies to"),
    (["--prompt-ids", "5,6", "--mode", "exact", "--threshold", "0.5"], "--threshold applies to the dynamic"),
    (["--prompt-ids", "5,6", "--mode", "exact", "--no-rope-copy"], "ablation of paper mode"),
    (["--prompt-ids", "5,6", "--mode", "exact", "--gamma", "99"], "exceeds the block length"),
    (["--prompt-ids", "5,6", "--mode", "vanilla"], "--draft: used by the paper and exact modes only"),
    (["--prompt-ids", "5,6", "--mode", "exact", "--gamma", "0"], "--gamma must be an integer >= 1, got 0"),
    (["--prompt-ids", "5,6", "--mode", "exact", "--block-length", "3000"], "--block-length 3000 leaves no room"),
])
def test_ignored_or_empty_inputs_are_errors(ckdir, capsys, flags, needle):
    code, out, err = run(capsys, "generate", "--target", str(ckdir), "--draft", str(ckdir), *flags)
    assert code == 2 and needle in err and out == ""


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--batch-size", "two"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and "--batch-size" in err


def test_bench_records_what_ran(ckdir, capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_ids": [4 + i, 5, 6]}) for i in range(3)))
    out_json = tmp_path / "rows.json"
    common = ["bench", "--target", str(ckdir), "--draft", str(ckdir), "--prompts-file", str(f), "--max-new-tokens", "4"]
    code, _, err = run(capsys, *common, "--modes", "exact", "--batch-size", "10", "--temperature", "0.5",
                       "--json", str(out_json))
    assert code == 0, err
    data = json.loads(out_json.read_text())  # strict JSON: no NaN without a vanilla row
    row = data["rows"][0]
    assert row["batch_size"] == 3 and row["speedup"] is None
    assert data["meta"]["settings"]["temperature"] == 0.5 and data["meta"]["settings"]["batch_size"] == 3
    assert data["meta"]["prompts"] == ["p.jsonl:1", "p.jsonl:2", "p.jsonl:3"]
    code, _, err = run(capsys, *common, "--mode", "exact")
    assert code == 2 and "--modes" in err


def test_broken_pipe_is_quiet(ckdir, tmp_path):
    import subprocess
    import sys
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_ids": [4 + i, 5, 6]}) for i in range(40)))
    cmd = (f"{sys.executable} -m simsd.entrypoints.cli generate --target {ckdir} --prompts-file {f} "
           f"--max-new-tokens 4 --json | head -1")
    res = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in res.stderr and res.returncode == 0, res.stderr[-2000:]
    assert len(res.stdout.splitlines()) == 1


def test_vanilla_refuses_speculative_options(ckdir, capsys):
    code, out, err = run(capsys, "generate", "--mode", "vanilla", "--target", str(ckdir), "--prompt-ids", "5,6",
                         "--gamma", "2", "--on-reject", "fallback")
    assert code == 2 and out == "" and "--gamma, --on-reject: used by the paper and exact modes only" in err


@pytest.mark.parametrize("text,needle", [
    ('{"prompt_ids": [5]}\n{"prompt_ids": [5, 99999]}\n', "prompt <stdin>:2: token id 99999 is outside"),
    ('\ufeff{"prompt_ids": [5]}\n{"prompt": ""}\n', "<stdin>:2: 'prompt' must be a non-empty string"),
])
def test_stdin_prompt_problems(ckdir, capsys, monkeypatch, text, needle):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    code, out, err = run(capsys, "generate", "--target", str(ckdir), "--prompts-file", "-")
    assert code == 2 and out == "" and needle in err


def test_bench_output_path_and_modes_checked_first(ckdir, capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    common = ["bench", "--target", str(ckdir), "--prompt-ids", "5,6", "--max-new-tokens", "4"]
    code, out, err = run(capsys, *common, "--modes", "vanilla", "--json", str(blocker / "x.json"))
    assert code == 2 and out == "" and "cannot be written" in err
    code, out, err = run(capsys, *common, "--modes", "vanilla,vanilla")
    assert code == 2 and out == "" and "twice" in err


def test_generate_and_bench_are_a_layer_over_the_api(ckdir, capsys, tmp_path, monkeypatch):
    """One code path: with the batch decoders disabled the commands still run; what they run is
    the LLM (scheduler on this thread, --batch-size rows) with prompt i at seed + i."""
    import simsd.decoding.vanilla
    import simsd.speculative.decoder
    from simsd.entrypoints.api import LLM

    def boom(*a, **k):
        raise AssertionError("the command line called a batch decoder")
    monkeypatch.setattr(simsd.decoding.vanilla, "vanilla_generate_batch", boom)
    monkeypatch.setattr(simsd.speculative.decoder.SpeculativeDecoder, "generate_batch", boom)
    calls = []
    real = LLM.generate_iter

    def spy(self, prompts, params=None, use_tqdm=False):
        calls.append((self, list(prompts), params))
        return real(self, prompts, params, use_tqdm)
    monkeypatch.setattr(LLM, "generate_iter", spy)
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_ids": [4 + i, 5, 6, 7]}) for i in range(3)))
    code, out, err = run(capsys, "generate", "--target", str(ckdir), "--draft", str(ckdir), "--mode", "exact",
                         "--prompts-file", str(f), "--max-new-tokens", "6", "--temperature", "1", "--seed", "5",
                         "--batch-size", "2")
    assert code == 0, err
    (llm, prompts, params), = calls
    assert not llm.scheduler_thread and llm.batch_size == 2 and llm.mode == "exact"
    assert prompts == [[4, 5, 6, 7], [5, 5, 6, 7], [6, 5, 6, 7]] and [p.seed for p in params] == [5, 6, 7]
    assert {(p.max_tokens, p.temperature) for p in params} == {(6, 1.0)}
    lines = out.splitlines()
    tokens = sum(int(re.search(r"\] (\d+) tokens", ln).group(1)) for ln in lines if ln.startswith("[exact]"))
    assert re.fullmatch(rf"\[3 prompts, batch size 2\] {tokens} tokens in [0-9.]+ s \([0-9.]+ tokens/s\)", lines[-1])
    calls.clear()
    code, out, err = run(capsys, "bench", "--target", str(ckdir), "--draft", str(ckdir), "--prompts-file", str(f),
                         "--max-new-tokens", "6", "--modes", "vanilla,paper,exact", "--repeats", "1", "--warmup", "0")
    assert code == 0, err
    used = {c[0].mode: c[0] for c in calls}
    assert set(used) == {"vanilla", "paper", "exact"} and len({id(x.target) for x in used.values()}) == 1
    assert used["paper"].draft is used["exact"].draft  # the checkpoints load once


def test_seeds_wrap_at_the_top_of_the_range(ckdir, capsys, tmp_path):
    """Prompt i samples with (--seed + i) mod 2**63: past the largest seed, prompt 1 is seed 0."""
    from simsd.config.request import SEED_MAX
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_ids": [4, 5, 6, 7]}) for _ in range(2)))
    common = ["generate", "--target", str(ckdir), "--prompts-file", str(f), "--max-new-tokens", "8",
              "--temperature", "1.5", "--json"]
    _, top, _ = run(capsys, *common, "--seed", str(SEED_MAX))
    _, zero, _ = run(capsys, *common, "--seed", "0")
    top, zero = ([json.loads(x)["token_ids"] for x in o.splitlines()] for o in (top, zero))
    assert top[1] == zero[0] and top[0] != zero[0]


def test_a_text_prompt_past_the_positions_is_one_line():
    """The tokenizer's own warning about a long sequence is not printed (simsd says it, once); a
    real process, so that the warning would reach stderr as a user sees it."""
    import os
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "simsd", "generate", "--mode", "vanilla", "--prompt", "x " * 3000,
                           "--max-new-tokens", "4"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("simsd: loading")]
    assert proc.returncode == 2 and lines == ["simsd: error: --prompt: prompt of 3010 tokens is longer than the "
                                              "model's maximum length 2048 - 1"], proc.stderr
