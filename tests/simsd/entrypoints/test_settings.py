"""The settings schema: every setting declared once, checked once, spelled one way on every
surface (the Python API, the command line, the server), and every refusal written once."""
import ast
import collections
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from simsd.config.engine import EngineArgs
from simsd.config.request import SamplingParams
from simsd.config.vocabulary import ParamError, Setting
from simsd.entrypoints.arguments import ALIASES, COMMANDS, SETTINGS, build_parser, options_of
from simsd.entrypoints.cli import COMMAND_LINE_RULES, main

ROOT = Path(__file__).resolve().parents[3]


def error_line(capsys, *argv) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("simsd: error: "), (code, err)
    return err[0][len("simsd: error: "):]


def test_every_field_is_a_declared_setting():
    """The engine's and a request's fields each carry a Setting with its help; every option of
    every command is one of them or one of the command line's own, under the field's name."""
    for cls in (EngineArgs, SamplingParams):
        for f in dataclasses.fields(cls):
            s = f.metadata.get("setting")
            assert isinstance(s, Setting) and s.help, (cls.__name__, f.name)
    for command in COMMANDS:
        for name, (flag, _) in options_of(command).items():
            assert name in SETTINGS, (command, name)
            assert flag.lstrip("-").removeprefix("no-").replace("-", "_") in (name, "json"), (command, name, flag)


def test_request_bodies_are_generated_from_the_request_settings():
    pytest.importorskip("pydantic")
    from simsd.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    for body in (CompletionRequest, ChatCompletionRequest):
        assert names <= set(body.model_fields)


def test_help_shows_the_canonical_name_and_keeps_the_old_ones(capsys):
    sub = build_parser()._subparsers._group_actions[0].choices
    for command, parser in sub.items():
        if command == "check":
            continue
        text = parser.format_help()
        for name, (flag, _) in options_of(command).items():
            assert flag in text, (command, flag)
            if name in ALIASES:  # the canonical flag first, then the older and vLLM's spellings
                assert ", ".join(f"{s} {name.upper()}" for s in (flag, *ALIASES[name])) in text, (command, name)
    assert "--max-tokens MAX_TOKENS, --max-new-tokens" in sub["generate"].format_help()
    assert "--batch-size BATCH_SIZE, --max-batch-size" in sub["serve"].format_help()


@pytest.mark.parametrize("typed", [["generate", "--max-tokens"], ["generate", "--max-new-tokens"],
                                   ["serve", "--batch-size"], ["serve", "--max-batch-size"]])
def test_an_error_names_the_option_as_typed(capsys, typed):
    line = error_line(capsys, *typed, "0")
    assert line.startswith(f"{typed[1]} must be an integer >= 1, got 0"), line


def test_one_refusal_reads_the_same_on_every_surface(capsys):
    """One check, one text: the API raises it naming the field, the command line names its
    option, the server's request body refuses it with the field (a 400 with ``param``)."""
    with pytest.raises(ParamError) as api:
        SamplingParams(top_p=0.0)
    assert (api.value.param, str(api.value)) == ("top_p", "top_p must be a number in (0, 1], got 0.0")
    assert error_line(capsys, "generate", "--temperature", "1", "--top-p", "0") == \
        "--top-p must be a number in (0, 1], got 0.0"
    pytest.importorskip("pydantic")
    from simsd.entrypoints.openai.protocol import CompletionRequest
    with pytest.raises(ParamError) as served:
        CompletionRequest(model="m", prompt="hi", top_p=0.0).sampling_params(SamplingParams())
    assert (served.value.param, str(served.value)) == ("top_p", str(api.value))
    # a combination: the API's field names, the command line's flags at their values
    with pytest.raises(ParamError, match=r"^rope_copy=False is an ablation of paper mode$"):
        EngineArgs(mode="exact", rope_copy=False)
    assert error_line(capsys, "generate", "--mode", "exact", "--no-rope-copy") == \
        "--no-rope-copy is an ablation of paper mode"


def test_the_settings_load_without_torch():
    """The command line checks its options before torch loads: the schema is torch-free."""
    probe = ("import sys\nimport simsd.entrypoints.cli, simsd.config, simsd.config.request\n"
             "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0 and json.loads(res.stdout.replace("'", '"')) == [], res.stdout + res.stderr


def _text(node):
    """A string or f-string's text with its fields as ``{}``; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


#: the same words for different things, on purpose
SAME_WORDS = {
    "module {} has no attribute {}",  # the lazy re-exports of simsd and simsd.decoding
    "{}: expected a JSON object, got {}",  # a config file of a checkpoint, a line of a prompt file
}


def test_each_refusal_is_written_once():
    """Every error message of the package (the message of each ``raise``, fields as ``{}``)
    appears in one place: a rule has one check and one text, whatever surface reaches it."""
    seen = collections.defaultdict(list)
    for path in sorted((ROOT / "simsd").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            call = node.exc
            name = getattr(call.func, "id", getattr(call.func, "attr", ""))
            for arg in call.args[1:2] if name in ("ParamError", "ChatTemplateError") else call.args[:1]:
                text = _text(arg)
                if text and len(re.sub(r"\{\}|\W", "", text)) >= 10:
                    seen[" ".join(text.split())].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    twice = {t: w for t, w in seen.items() if len(w) > 1 and t not in SAME_WORDS}
    assert len(seen) > 100 and not twice, twice


def test_a_text_prompt_without_a_tokenizer_is_refused_as_the_api_refuses_it(capsys, tmp_path):
    """One rule, one text: the command line reaches the API's refusal (``encode_prompt``), with the
    prompt named as the command line names it."""
    from tests.helpers import random_checkpoint
    ck = str(random_checkpoint("no-tok", tokenizer=False))
    assert error_line(capsys, "generate", "--target", ck, "--prompt", "hi") == \
        "--prompt: this checkpoint has no tokenizer: give token ids"
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt_ids": [5, 6]}\n{"prompt": "hi"}\n')
    assert error_line(capsys, "generate", "--target", ck, "--prompts-file", str(f)) == \
        "prompt p.jsonl:2: this checkpoint has no tokenizer: give token ids"
    assert error_line(capsys, "generate", "--target", ck, "--prompts-file", str(f), "--raw", "--limit", "1") == \
        "--raw applies to text prompts; these prompts are token ids (they bypass the tokenizer and its chat template)"


#: words of each command-line rule's refusal (the option it names leads the line)
RULE_WORDS = {"limit": ("--limit", "applies to --prompts-file and --prompt-set, not to a single prompt"),
              "batch_size": ("--batch-size", "2 with a single prompt: batches need --prompts-file or --prompt-set"),
              "replicas": ("--replicas", "applies to Ray runs: add --ray"),
              "request_read_timeout": ("--request-read-timeout", "applies to simsd serve without --ray (Ray Serve's "
                                                                "own HTTP proxy reads the requests)"),
              "tp": ("--tp", "2 with --ray: a Ray worker or replica is one process (tensor "
                                "parallelism over torchrun: docs/scaling.md)"),
              "max_replicas": ("--max-replicas", "2 is below --replicas 3")}


@pytest.mark.parametrize("rule", COMMAND_LINE_RULES, ids=lambda r: r.example[-2])
def test_every_command_line_rule_is_reached_by_its_example(capsys, rule):
    """Each rule of the command line's own options refuses its example (a command line) before
    anything loads, in one line that leads with the option."""
    lead, words = RULE_WORDS[rule.example[-2].lstrip("-").replace("-", "_")]
    assert error_line(capsys, *rule.example) == f"{lead} {words}"
    assert len(RULE_WORDS) == len(COMMAND_LINE_RULES)  # one example per rule, each reaching its own
