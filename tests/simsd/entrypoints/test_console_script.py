"""What the user runs: the installed ``simsd`` console script, end to end in a subprocess,
with the bundled pair (no --target, no --draft), as ``make demo`` and the README run it.

Expected values come from the Python API on the bundled checkpoints found by their path in
the installed package (not through simsd's defaults), so a default that points elsewhere, or
at nothing, fails here.
"""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import simsd
from simsd import DecodeConfig, load_checkpoint, vanilla_generate

ROOT = Path(__file__).resolve().parents[3]
PACKAGE_ASSETS = Path(simsd.__file__).resolve().parent / "assets"


def console_script() -> Path:
    exe = Path(sys.executable).parent / ("simsd.exe" if os.name == "nt" else "simsd")
    assert exe.is_file(), f"the simsd console script is not installed next to {sys.executable}: pip install -e ."
    return exe


def run_simsd(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SIMSD_ATTENTION_BACKEND", None)
    return subprocess.run([str(console_script()), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def api_vanilla(prompt_text: str, max_new_tokens: int):
    """Vanilla decoding of the bundled target with the Python API (chat template applied)."""
    ck = load_checkpoint(PACKAGE_ASSETS / "tiny-sdar-target", dtype="float32")
    text = ck.tokenizer.apply_chat_template([{"role": "user", "content": prompt_text}], tokenize=False,
                                            add_generation_prompt=True)
    ids = ck.tokenizer(text, add_special_tokens=False)["input_ids"]
    res = vanilla_generate(ck.model, ids, DecodeConfig(block_length=4, max_new_tokens=max_new_tokens),
                           ck.mask_token_id, ck.stop_ids)
    shown = res.token_ids[:-1] if res.token_ids and res.token_ids[-1] in ck.stop_ids else res.token_ids
    return res.token_ids, ck.tokenizer.decode(shown, skip_special_tokens=False)


def test_demo_exact_mode_with_the_bundled_pair():
    """``make demo``'s first command (fewer tokens): exact mode with the bundled draft on the
    first held-out prompt prints the bundled target's own vanilla tokens and text."""
    res = run_simsd("generate", "--mode", "exact", "--max-new-tokens", "24", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 1
    row = rows[0]
    from simsd.entrypoints.prompts import bundled_prompts
    first = bundled_prompts()[0]
    assert row["id"] == first.id and row["prompt"] == first.text
    want_ids, want_text = api_vanilla(first.text, 24)
    assert row["token_ids"] == want_ids
    assert row["text"] == want_text
    assert row["stats"]["mode"] == "exact" and row["stats"]["new_tokens"] == len(want_ids)
    assert row["stats"]["draft_forwards"] > 0  # the bundled draft ran


def test_readme_example_runs_as_written():
    """The README's first ``simsd generate`` example (bundled pair) runs as written, plus a
    token limit, and prints the vanilla target's text and a summary line."""
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("simsd generate --mode exact --prompt"))
    args = shlex.split(line.split("#")[0])[1:]
    res = run_simsd(*args, "--max-new-tokens", "16")
    assert res.returncode == 0, res.stderr[-3000:]
    prompt = args[args.index("--prompt") + 1]
    want_ids, want_text = api_vanilla(prompt, 16)
    out = res.stdout.rstrip("\n").split("\n")
    assert "\n".join(out[:-1]) == want_text
    summary = out[-1]
    assert re.match(rf"\[exact\] {len(want_ids)} tokens in [0-9.]+ s \([0-9.]+ tokens/s\), target forwards/token "
                    r"[0-9.]+, acceptance [0-9.]+, draft share [0-9.]+, accepted/round [0-9.]+$", summary), summary


def test_make_demo_is_the_tested_command():
    """The Makefile's demo runs these commands; CI (.ci/run) runs ``make demo``."""
    make = (ROOT / "Makefile").read_text()
    demo = make.split("\ndemo:")[1].split("\n\n")[0]
    assert "$(BIN)/simsd generate --mode exact" in demo and "$(BIN)/simsd generate --mode vanilla" in demo
    assert "make demo" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("which", ["draft", "target"])
def test_bundled_defaults_are_the_shipped_pair(which):
    from simsd.assets import DEFAULT_DRAFT, DEFAULT_TARGET
    path = {"draft": DEFAULT_DRAFT, "target": DEFAULT_TARGET}[which]
    assert Path(path).resolve() == PACKAGE_ASSETS / f"tiny-sdar-{which}"
    assert (Path(path) / "model.safetensors").is_file()


#: one mistyped option per command, and the line it must print
OPTION_ERRORS = [
    (["generate", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["generate", "--strategy", "foo"], "--strategy: unknown strategy 'foo'"),
    (["serve", "--port", "-1"], "--port must be in [0, 65535], got -1"),
    (["bench", "--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
    (["eval", "--timeout", "0"], "--timeout must be a finite number > 0, got 0.0"),
    (["eval", "--modes", "vanilla,release"], "unknown mode(s) in --modes: release"),
]


@pytest.mark.parametrize("argv,line", OPTION_ERRORS, ids=[a[0] + " " + a[1] for a, _ in OPTION_ERRORS])
def test_an_option_error_answers_before_torch_loads(argv, line):
    """A mistyped option costs well under 2 s of CPU (issue 21: it cost torch's and
    transformers' imports, ~2.5 s here and ~25 s on a busy machine): the console script's CPU
    time (user + sys, so load does not count) is bounded with wide slack, and the same error
    through ``main`` leaves torch, transformers, fastapi and the kernels unimported."""
    import resource
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = run_simsd(*argv, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert res.returncode == 2 and res.stderr.startswith("simsd: error: ") and line in res.stderr, res.stderr
    assert cpu < 2.0, f"{' '.join(argv)}: {cpu:.2f} s of CPU for a one-line error"
    heavy = ("torch", "transformers", "fastapi", "uvicorn", "simsd_kernels", "triton", "ray")
    probe = ("import json, sys\nfrom simsd.entrypoints.cli import main\ncode = main(sys.argv[1:])\n"
             f"print(json.dumps([code, [m for m in {heavy!r} if m in sys.modules]]))")
    res = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert json.loads(res.stdout) == [2, []], res.stdout + res.stderr[-2000:]
