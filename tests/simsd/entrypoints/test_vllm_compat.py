"""vLLM's (and SGLang's) spellings (issue 38, item 1; simsd.config.vllm_names, docs/vllm.md):
vLLM's offline example runs unchanged against the bundled pair, each mapped name gives the same
engine and tokens as simsd's spelling, each refused name raises a ParamError naming it, two
spellings of one setting are refused naming both, chat() is generate() of the conversations,
RequestOutput.outputs[0] is the output's own completion (the bundled pair, float32, CPU)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from simsd import LLM, CompletionOutput, ParamError, SamplingParams
from simsd.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from simsd.config.vllm_names import CHAT, ENGINE, REQUEST, Lacks, Same, cli_aliases
from simsd.entrypoints.arguments import build_parser
from simsd.models.config import CheckpointError
from tests.helpers import random_checkpoint
from tests.simsd.entrypoints.serving import doc_blocks

ROOT = Path(__file__).resolve().parents[3]
CHAT_MESSAGES = [{"role": "user", "content": "Write a function that reverses a list."}]
#: the path of docs/vllm.md's example, replaced by the bundled target's in the tests
DOC_PATH = '"/ckpt/SDAR-1.7B-Chat"'


@pytest.fixture(scope="module")
def llms():
    """The bundled pair under vLLM's keywords and under simsd's."""
    out = {"vllm": LLM(model=str(DEFAULT_TARGET), speculative_model=str(DEFAULT_DRAFT), tensor_parallel_size=1,
                       max_num_seqs=3, trust_remote_code=True, dtype="auto", seed=None, device="cpu"),
           "simsd": LLM(str(DEFAULT_TARGET), str(DEFAULT_DRAFT), tp=1, batch_size=3, device="cpu")}
    yield out
    for llm in out.values():
        assert llm.shutdown(timeout=60)


def doc_example() -> str:
    (code,) = doc_blocks("docs/vllm.md", "Coming from vLLM or SGLang", "python")
    assert DOC_PATH in code
    return code.replace(DOC_PATH, repr(str(DEFAULT_TARGET)))


def test_vllm_offline_example_runs_unchanged(llms, capsys):
    """docs/vllm.md's example is vLLM's offline example with simsd's import: run as written (the
    bundled target's path for the placeholder), it prints each prompt and its completion, and
    each completion is the output's own fields, with the tokens of simsd's spelling at its seed."""
    space = {}
    exec(doc_example(), space)
    (o,) = space["outputs"]
    assert capsys.readouterr().out == f"{o.prompt} {o.outputs[0].text}\n"
    assert o.prompt == "Hello, my name is" and o.prompt_token_ids == llms["simsd"].prompt_ids(o.prompt)
    (c,) = o.outputs
    assert isinstance(c, CompletionOutput) and c.finished() and o.finished
    assert (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) == (0, o.text, o.token_ids, o.finish_reason,
                                                                              o.stop_reason)
    assert c.text is o.text and c.token_ids is o.token_ids
    assert (c.cumulative_logprob, c.logprobs, c.lora_request) == (None, None, None)
    assert o.token_ids and o.request_id  # (a fresh seed: the text may be empty, a stop token first)
    again = llms["simsd"].generate(o.prompt, SamplingParams(temperature=0.8, top_p=0.95, seed=o.seed))[0]
    assert (again.token_ids, again.text) == (o.token_ids, o.text)


def test_vllm_example_exits_cleanly_without_shutdown(tmp_path):
    """vLLM's example never shuts its LLM down: the process still exits with status 0 (the
    scheduling thread is ended at exit; a daemon thread stopped by the interpreter's
    finalization aborted it, status 134, in about half the runs)."""
    script = tmp_path / "example.py"
    script.write_text(doc_example())
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for _ in range(2):
        res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0 and res.stdout.startswith("Hello, my name is "), res.stderr[-2000:]


def test_vllm_engine_keywords_build_the_same_engine(llms):
    a, b = llms["vllm"], llms["simsd"]
    assert a.config == b.config and a.batch_size == b.batch_size == 3 and a.config.dtype == "float32"
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=10, temperature=1.2, seed=5)]
    prompts = ["def add(a, b):", CHAT_MESSAGES]
    assert [o.token_ids for o in a.generate(prompts, params)] == [o.token_ids for o in b.generate(prompts, params)]


@pytest.mark.parametrize("theirs, ours", [({"top_k": -1}, {"top_k": 0}), ({"max_new_tokens": 9}, {"max_tokens": 9}),
                                          ({"presence_penalty": 0.0, "frequency_penalty": 0, "repetition_penalty": 1.0,
                                            "min_p": 0.0, "logprobs": None, "best_of": 1, "min_tokens": 0,
                                            "skip_special_tokens": False, "include_stop_str_in_output": False,
                                            "detokenize": True}, {})])
def test_vllm_request_names_give_simsd_params_and_tokens(llms, theirs, ours):
    """A mapped name is simsd's setting (the same params, the same tokens); a lacking one at
    the value that asks for what simsd does anyway is a no-op."""
    base = dict(temperature=0.9, top_p=0.9, seed=3, max_tokens=11)
    mine = SamplingParams(**{k: v for k, v in base.items() if k not in ours}, **theirs)
    want = SamplingParams(**{**base, **ours})
    assert mine == want
    llm = llms["simsd"]
    assert llm.generate(CHAT_MESSAGES, mine)[0].token_ids == llm.generate(CHAT_MESSAGES, want)[0].token_ids


REFUSED_REQUEST = [(n, e.noop[0] if e.noop else 0) for n, e in REQUEST.items() if isinstance(e, Lacks)]


@pytest.mark.parametrize("name, noop", REFUSED_REQUEST)
def test_each_lacking_request_name_is_refused_naming_it(name, noop):
    assert SamplingParams(**{name: noop}) == SamplingParams()
    bad = 3 if noop is None else (not noop) if isinstance(noop, bool) else \
        {"type": "json_object"} if isinstance(noop, dict) else noop + 0.5
    with pytest.raises(ParamError, match=rf"^SamplingParams\(\.\.\.\): {re.escape(f'{name}={bad!r}')} "
                                         rf"\((vLLM|SGLang|OpenAI)'s\) has no simsd equivalent: .+ \(only "
                                         rf"{re.escape(f'{name}={noop!r}')}, what simsd does, is accepted\)$"
                       ) as exc:
        SamplingParams(**{name: bad})
    assert exc.value.param == name


@pytest.mark.parametrize("name", ["tensor_parallel_size", "gpu_memory_utilization", "max_num_seqs", "block_length"])
def test_an_engine_name_given_to_sampling_params_says_it_is_an_llm_setting(name):
    with pytest.raises(ParamError, match="LLM") as exc:
        SamplingParams(**{name: 2})
    assert exc.value.param == name


@pytest.mark.parametrize("kwargs, names", [({"model": "a", "target": "b"}, ("target", "model")),
                                           ({"speculative_model": "a", "draft": "b"}, ("draft", "speculative_model")),
                                           ({"tensor_parallel_size": 1, "tp": 1}, ("tp", "tensor_parallel_size")),
                                           ({"batch_size": 2, "max_num_seqs": 2}, ("batch_size", "max_num_seqs")),
                                           ({"model_path": "a", "model": "b"}, ("model_path", "model"))])
def test_two_spellings_of_one_setting_are_refused_naming_both(kwargs, names):
    with pytest.raises(ParamError, match=rf"^LLM\(\.\.\.\): {names[0]} and {names[1]} both give ") as exc:
        LLM(**kwargs)
    assert exc.value.param == names[1]


def test_two_spellings_positional_and_of_a_request_are_refused_naming_both():
    with pytest.raises(ParamError, match=r"^LLM\(\.\.\.\): target and model both give target \(model is vLLM's "
                                         r"spelling of target\): give one of them$"):
        LLM(str(DEFAULT_TARGET), model=str(DEFAULT_TARGET))  # the positional target
    for kwargs in ({"max_tokens": 3, "max_new_tokens": 4}, {"max_new_tokens": 4, "max_tokens": 3}):
        with pytest.raises(ParamError, match="max_tokens and max_new_tokens both give max_tokens") as exc:
            SamplingParams(**kwargs)
        assert exc.value.param == "max_new_tokens"


@pytest.mark.parametrize("name, value, says", [("seed", 0, r"SamplingParams\(seed=\.\.\.\)"),
                                               ("random_seed", 1, "SamplingParams"),
                                               ("enforce_eager", False, "cuda_graphs=True"),
                                               ("num_speculative_tokens", 4, "max_gamma"),
                                               ("quantization", "awq", "unquantized"),
                                               ("enable_chunked_prefill", True, "max_prefill_tokens=N"),
                                               ("max_num_batched_tokens", 8192, "max_prefill_tokens=N")])
def test_lacking_engine_names_are_refused_naming_what_simsd_offers(name, value, says):
    with pytest.raises(ParamError, match=rf"^LLM\(\.\.\.\): {name}={value!r} \((vLLM|SGLang)'s\) has no simsd .*{says}"
                       ) as exc:
        LLM(**{name: value})
    assert exc.value.param == name


def test_a_hub_id_says_simsd_loads_local_directories():
    with pytest.raises(CheckpointError, match=r"^checkpoint directory not found: JetLM/SDAR-1\.7B-Chat \(simsd loads "
                                              r"local checkpoint directories only.*`huggingface-cli download "
                                              r"JetLM/SDAR-1\.7B-Chat --local-dir SDAR-1\.7B-Chat`"):
        LLM(model="JetLM/SDAR-1.7B-Chat", mode="vanilla")
    with pytest.raises(CheckpointError, match=r"^checkpoint directory not found: /nowhere/x$"):
        LLM(model="/nowhere/x", mode="vanilla")


def test_a_target_without_a_draft_runs_exact_mode_drafting_for_itself():
    """vLLM's example names a model and no draft: exact mode (the default) drafts for itself
    (draft="self"; the bundled tiny draft pairs with the bundled target only), loads no draft
    model and gives vanilla decoding's tokens; a draft given explicitly that does not pair is still
    refused naming the tokenizers."""
    other = random_checkpoint("vllm-names", tokenizer=False)
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=2)
    llm = LLM(model=str(other), dtype="float32", device="cpu", invariant=True, batch_size=1, scheduler_thread=False)
    assert llm.config.mode == "exact" and llm.config.draft == "self" and llm.draft is None
    got = llm.generate([prompt], params)[0]
    llm.shutdown()
    vanilla = LLM(model=str(other), mode="vanilla", dtype="float32", device="cpu", invariant=True, batch_size=1,
                  scheduler_thread=False)
    assert got.token_ids == vanilla.generate([prompt], params)[0].token_ids and got.stats["draft_forwards"] == 0
    vanilla.shutdown()
    with pytest.raises(ValueError, match=r"^draft vocab_size \d+ != target vocab_size \d+: they must share"):
        LLM(model=str(other), draft=str(DEFAULT_DRAFT))


def test_chat_is_generate_of_the_conversations(llms):
    llm = llms["simsd"]
    p = SamplingParams(max_tokens=14, temperature=1.1, seed=9)
    other = [{"role": "user", "content": "How many subsets does a set of 5 elements have?"}]
    (one,) = llm.chat(CHAT_MESSAGES, p)  # one conversation: a list of one output, as vLLM
    two = llm.chat([CHAT_MESSAGES, other], sampling_params=p, use_tqdm=False, chat_template=None, tools=None)
    gen = llm.generate([CHAT_MESSAGES, other], p)
    assert [o.token_ids for o in [one] + two] == [o.token_ids for o in gen[:1] + gen]
    assert one.prompt == CHAT_MESSAGES and one.prompt_token_ids == gen[0].prompt_token_ids and one.text == gen[0].text
    assert llm.generate(CHAT_MESSAGES, sampling_params=p)[0].token_ids == one.token_ids  # vLLM's keyword
    prefilled = CHAT_MESSAGES + [{"role": "assistant", "content": "def reverse("}]
    (cont,) = llm.chat(prefilled, p, add_generation_prompt=False, continue_final_message=True)
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(prefilled, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True)
    assert cont.prompt_token_ids == tok(rendered, add_special_tokens=False)["input_ids"]
    with pytest.raises(ParamError, match="chat_template='x'") as exc:
        llm.chat(CHAT_MESSAGES, p, chat_template="x")
    assert exc.value.param == "chat_template"
    for bad in ("Hi", [], [CHAT_MESSAGES, "Hi"]):
        with pytest.raises(ParamError, match="conversation") as exc:
            llm.chat(bad, p)
        assert exc.value.param == "messages"
    with pytest.raises(TypeError, match="nope"):
        llm.chat(CHAT_MESSAGES, p, nope=1)
    with pytest.raises(ParamError, match="sampling_params"):
        llm.generate("Hi", p, sampling_params=p)


def test_get_tokenizer_round_trips(llms):
    llm = llms["vllm"]
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer
    text = "def add(a, b):\n    return a + b"
    ids = tok.encode(text, add_special_tokens=False)
    assert llm.prompt_ids(text) == ids and tok.decode(ids) == text
    (o,) = llm.generate(ids, SamplingParams(max_tokens=8))
    assert o.text == tok.decode(o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids)
    bare = LLM(random_checkpoint("vllm-names", tokenizer=False), mode="vanilla", device="cpu")
    try:
        with pytest.raises(ParamError, match="has no tokenizer: give prompts as token ids") as exc:
            bare.get_tokenizer()
        assert exc.value.param == "target"
    finally:
        bare.shutdown()


def test_cli_takes_vllm_option_spellings():
    assert cli_aliases() == {"target": ("--model",), "draft": ("--speculative-model",),
                             "tp": ("--tensor-parallel-size",), "batch_size": ("--max-num-seqs",)}
    parser = build_parser()
    args = parser.parse_args(["generate", "--model", "/m", "--speculative-model", "/d", "--tensor-parallel-size", "2",
                              "--max-num-seqs", "4"])
    assert (str(args.target), args.draft, args.tp, args.batch_size) == ("/m", "/d", 2, 4)
    args = parser.parse_args(["serve", "--model", "/m", "--max-num-seqs", "5", "--max-batch-size", "6"])
    assert (str(args.target), args.batch_size) == ("/m", 6)  # the last one given wins, as argparse does
    assert parser.parse_args(["serve", "--tensor-parallel-size", "2"]).tp == 2  # vllm serve's spelling


def test_docs_list_every_name_of_the_tables():
    """docs/vllm.md's tables hold every name of simsd.config.vllm_names, each with simsd's
    setting (or "-" for a name simsd lacks)."""
    page = (ROOT / "docs" / "vllm.md").read_text()
    for table in (ENGINE, REQUEST, CHAT):
        for name, entry in table.items():
            ours = f"`{entry.name}`" if isinstance(entry, Same) else "-"
            assert f"| `{name}` | {entry.source} | {ours} |" in page, name
