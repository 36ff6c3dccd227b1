"""The Python API (simsd.LLM): outputs equal the decoders' single runs in every mode, seeds,
stops, streaming, parameter errors, cancellation (the bundled pair, float32, CPU)."""
import dataclasses

import pytest

import simsd
from simsd import LLM, ParamError, SamplingParams
from simsd.decoding.config import DecodeConfig, check_prompt
from simsd.decoding.sampling import StepSampling
from tests.simsd.entrypoints.serving import doc_blocks, readme_blocks, single, wait_for

PROMPTS = ["def add(a, b):", [{"role": "user", "content": "Write a function that reverses a list."}],
           [{"role": "user", "content": "How many subsets does a set of 5 elements have?"}],
           [11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def llms():
    exact = LLM(mode="exact", dtype="float32", device="cpu", batch_size=3)
    out = {"exact": exact,
           "paper": LLM(exact.target, exact.draft, "paper", batch_size=2),
           "vanilla": LLM(exact.target, mode="vanilla", batch_size=2)}
    yield out
    for llm in out.values():
        assert llm.shutdown(timeout=60)


@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_generate_equals_single_runs_of_the_decoders(llms, mode):
    """Mixed prompt forms and lengths, greedy and seeded sampling, more prompts than rows: each
    output equals the decoders' run of that prompt alone with its seed."""
    llm = llms[mode]
    params = [SamplingParams(max_tokens=n, temperature=t, top_k=k, top_p=p, seed=s)
              for n, t, k, p, s in [(9, 0.0, 0, 1.0, None), (16, 1.5, 50, 1.0, 11), (5, 0.0, 0, 1.0, 3),
                                    (12, 0.9, 0, 1.0, 2**62 + 1), (14, 0.0, 0, 1.0, 7), (7, 1.2, 20, 1.0, 8),
                                    (16, 2.0, 0, 0.6, 12)]]
    prompts = PROMPTS + PROMPTS[:3]
    outs = llm.generate(prompts, params)
    assert len({len(o.token_ids) for o in outs}) > 2
    for p, sp, o in zip(prompts, params, outs):
        ids = llm.prompt_ids(p)
        want = single(llm, ids, sp, o.seed)
        assert o.prompt_token_ids == ids and o.token_ids == want.token_ids
        stop = o.token_ids[-1] in llm.target.stop_ids
        assert o.finish_reason == ("stop" if stop else "length")
        assert o.text == llm.tokenizer.decode(o.token_ids[:-1] if stop else o.token_ids)
        for key in ("new_tokens", "target_forwards", "prefill_forwards", "blocks", "accepted", "proposed"):
            assert o.stats.get(key) == want.stats.get(key), key
        if sp.seed is not None:
            assert o.seed == sp.seed


def test_fresh_seeds_are_reported_and_replay(llms):
    llm = llms["exact"]
    p = SamplingParams(max_tokens=12, temperature=1.5)
    a, b = llm.generate([PROMPTS[1], PROMPTS[1]], p)
    assert a.seed != b.seed and 0 <= a.seed < 2**63
    again = llm.generate(PROMPTS[1], dataclasses.replace(p, seed=a.seed))[0]
    assert again.token_ids == a.token_ids and again.seed == a.seed


def test_stream_yields_the_output_in_increments(llms):
    llm = llms["exact"]
    p = SamplingParams(max_tokens=24, temperature=0.8, seed=5)
    pieces = list(llm.stream(PROMPTS[2], p))
    out = llm.generate(PROMPTS[2], p)[0]
    assert len(pieces) > 2 and "".join(pieces) == out.text


def test_stop_strings_and_stop_token_ids(llms):
    llm = llms["exact"]
    free = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    stop = free.text[6:9]
    cut = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, ignore_eos=True, stop=["\x00never", stop]))[0]
    assert cut.text == free.text[:free.text.index(stop)] and (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == free.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 24
    k = 10
    sid = free.token_ids[k]
    first = free.token_ids.index(sid)
    by_id = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[sid]))[0]
    assert by_id.token_ids == free.token_ids[:first + 1] and (by_id.finish_reason, by_id.stop_reason) == ("stop", sid)


@pytest.mark.parametrize("make,param", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(temperature=-0.5), "temperature"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_k=-2), "top_k"),  # -1 is vLLM's "off", top_k=0 (test_vllm_compat.py)
    (lambda: SamplingParams(seed=-1), "seed"),
    (lambda: SamplingParams(seed=2**63), "seed"),
    (lambda: SamplingParams(stop=[""]), "stop"),
    (lambda: SamplingParams(stop_token_ids=[-3]), "stop_token_ids"),
    (lambda: SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
    (lambda: SamplingParams(strategy="fastest"), "strategy"),
    (lambda: SamplingParams(threshold=0.5), "threshold"),
    (lambda: SamplingParams(strategy="dynamic", threshold=1.5), "threshold"),
    (lambda: SamplingParams(max_tokens=True), "max_tokens"),
    (lambda: SamplingParams(n=17), "n"),  # more than MAX_N completions (test_n.py)
    (lambda: SamplingParams(n=0), "n"),
    (lambda: SamplingParams(block_length=8), "block_length"),
    (lambda: SamplingParams(max_tokens=8, fold_commit=True), "fold_commit"),
])
def test_bad_fields_name_themselves(make, param):
    with pytest.raises(ParamError) as err:
        make()
    assert err.value.param == param and param in str(err.value)


@pytest.mark.parametrize("mode,prompt,params,param", [
    ("vanilla", "hi", SamplingParams(gamma=2), "gamma"),
    ("exact", "hi", SamplingParams(gamma=5), "gamma"),
    ("exact", "hi", SamplingParams(steps=5), "steps"),
    ("exact", "hi", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ("exact", "hi", SamplingParams(stop_token_ids=[6144]), "stop_token_ids"),  # the vocabulary size
    ("exact", [5] * 2048, SamplingParams(max_tokens=1), "prompt"),
    ("exact", [5] * 2000, SamplingParams(max_tokens=100), "max_tokens"),
    ("exact", [5, 6, 3, 7], SamplingParams(), "prompt"),  # 3 is the bundled pair's mask id
    ("exact", [5, 10**6], SamplingParams(), "prompt"),
    ("exact", [5, 6144], SamplingParams(), "prompt"),
    ("exact", [-1, 5], SamplingParams(), "prompt"),
    ("exact", "", SamplingParams(), "prompt"),
    ("exact", 42, SamplingParams(), "prompt"),
    ("exact", [[]], SamplingParams(), "prompt"),  # a batch of one empty prompt
    ("exact", [{"role": "user"}], SamplingParams(), "messages"),
])
def test_bad_requests_name_the_field(llms, mode, prompt, params, param):
    llm = llms[mode]
    before = llm.metrics()["requests"]
    with pytest.raises(ParamError) as err:
        llm.generate(prompt, params)
    assert err.value.param == param
    assert llm.metrics()["requests"] == before and llm.scheduler.num_waiting == 0


@pytest.mark.parametrize("mode", ["vanilla", "exact"])
def test_a_request_that_exactly_fills_max_model_len_is_served(llms, mode):
    """``prompt + max_tokens == max_model_len`` is served (every position used), one token more is
    refused naming ``max_tokens``; a prompt of ``max_model_len - 1`` tokens gets its one token, one
    of ``max_model_len`` tokens is refused naming ``prompt``. The same at the models' own limit
    (:func:`check_prompt`, 2048 positions, the default ``max_model_len``)."""
    base = llms["exact"]
    L = 64
    llm = LLM(base.target, base.draft if mode == "exact" else None, mode, batch_size=1, max_model_len=L)
    try:
        for P in (40, 61, L - 1):
            ids = [10 + i for i in range(P)]
            p = SamplingParams(max_tokens=L - P, ignore_eos=True)
            (out,) = llm.generate(ids, p)
            assert len(out.token_ids) == L - P and out.finish_reason == "length"
            assert out.token_ids == single(llm, ids, p, out.seed).token_ids
            with pytest.raises(ParamError) as err:
                llm.generate(ids, SamplingParams(max_tokens=L - P + 1))
            assert err.value.param == "max_tokens"
        with pytest.raises(ParamError) as err:
            llm.generate([10] * L, SamplingParams(max_tokens=1))
        assert err.value.param == "prompt"
    finally:
        assert llm.shutdown(timeout=60)
    config = base.target.config  # the models' own limit, checked for every model of a request
    limit = config.max_position_embeddings
    assert check_prompt([10] * (limit - 8), config, 8, 4) == limit + 4  # whole blocks, plus one block of room
    assert check_prompt([10] * (limit - 1), config, 1, 4) == limit + 4
    for P, n, words in ((limit - 8, 9, "exceeds the model's maximum length"),
                        (limit, 1, "is longer than the model's maximum length")):
        with pytest.raises(ValueError, match=words):
            check_prompt([10] * P, config, n, 4)


def test_ids_at_the_ends_of_the_vocabulary_are_accepted(llms):
    """Prompt and stop ids 0 and vocab_size - 1 (6143 in the bundled pair) are valid ids."""
    llm = llms["vanilla"]
    p = SamplingParams(max_tokens=3, stop_token_ids=[0, 6143])
    (out,) = llm.generate([0, 6143, 12], p)
    assert out.token_ids == single(llm, [0, 6143, 12], p, out.seed).token_ids[:len(out.token_ids)]


def test_more_prompts_than_rows_and_queue_wait(llms):
    base = llms["exact"]
    llm = LLM(base.target, base.draft, "exact", batch_size=2, max_waiting=0)
    try:
        outs = llm.generate([[11 + i, 12, 13] for i in range(5)], SamplingParams(max_tokens=6))
        assert len(outs) == 5 and llm.metrics()["requests"]["length"] + llm.metrics()["requests"]["stop"] == 5
        with pytest.raises(simsd.entrypoints.api.QueueFull):  # a non-blocking submit beyond free rows + queue
            for _ in range(4):
                llm.submit([11, 12, 13], SamplingParams(max_tokens=40, ignore_eos=True))
    finally:
        assert llm.shutdown(drain=False, timeout=60)
    assert llm.scheduler.num_running == 0


def test_closing_a_stream_cancels_its_request(llms):
    llm = llms["exact"]
    before = llm.metrics()["requests"]["cancelled"]
    it = llm.stream(PROMPTS[1], SamplingParams(max_tokens=1500, ignore_eos=True))
    next(it)
    it.close()
    handle_free = wait_for(lambda: llm.scheduler.num_running == 0)
    assert handle_free and llm.metrics()["requests"]["cancelled"] == before + 1
    # the freed row serves later requests as before
    p = SamplingParams(max_tokens=10)
    assert llm.generate(PROMPTS[0], p)[0].token_ids == single(llm, llm.prompt_ids(PROMPTS[0]), p, 0).token_ids


def test_vllm_habits_get_errors_that_say_what_to_do():
    """vLLM's ``n`` is 1 by default (None too), at most MAX_N; an LLM(...) setting passed
    to SamplingParams is refused when it is built, with where it belongs: every LLM keyword but
    the defaults (the fields of EngineArgs) is such a setting."""
    from simsd.config.engine import EngineArgs
    assert SamplingParams(n=1) == SamplingParams(n=None) == SamplingParams() and SamplingParams(n=None).n == 1
    with pytest.raises(ParamError, match=r"n must be an integer in \[1, 16\], got 17"):
        SamplingParams(n=17)
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    assert {"block_length", "on_reject", "device", "max_gamma", "mask_token_id", "mode"} <= set(names)
    for name in names:
        where = rf"simsd\.LLM\(\.\.\., {name}=\.\.\.\)"
        with pytest.raises(ParamError, match=rf"^{name} is an LLM\(\.\.\.\) setting.*{where}"):
            SamplingParams(**{name: 8})
    with pytest.raises(TypeError, match="batchsize"):  # a mistyped LLM keyword: Python's own error
        LLM(batchsize=2)
    with pytest.raises(ParamError, match="best_of=2 .* returns all n completions"):  # vLLM's, refused by name
        SamplingParams(best_of=2)
    with pytest.raises(TypeError, match="bestof"):  # a mistyped name: Python's own error
        SamplingParams(bestof=2)


def test_requests_after_shutdown_say_the_llm_was_shut_down(llms):
    """After ``shutdown()``, generate, generate_iter, stream and submit raise a RuntimeError
    that says this LLM was shut down (the scheduler's own words were about shutting down)."""
    llm = LLM(llms["exact"].target, mode="vanilla", batch_size=1)
    assert llm.generate("hi", SamplingParams(max_tokens=4))[0].token_ids
    assert llm.shutdown(timeout=60)
    for call in (lambda: llm.generate("hi"), lambda: next(llm.generate_iter(["hi"])),
                 lambda: next(llm.stream("hi")), lambda: llm.submit("hi")):
        with pytest.raises(RuntimeError, match="^this LLM was shut down"):
            call()
    with LLM(llms["exact"].target, mode="vanilla", batch_size=1) as ctx:
        pass
    with pytest.raises(RuntimeError, match="^this LLM was shut down"):
        ctx.generate("hi")


def test_the_readme_api_example_shows_text(llms, capsys):
    """The README's Python API example, run as written with the bundled pair (greedy outputs and
    a seeded stream): every output and the stream have text (issue 21: its chat prompt "Reverse a
    list." answered "", its stop token first; the README says so, checked here too). docs/api.md
    shows the same example."""
    (code,) = readme_blocks("Python API", "python")
    assert doc_blocks("docs/api.md", "Python API", "python") == [code]
    space = {}
    exec(code, space)
    outs = space["outs"]
    assert len(outs) == 3 and all(o.text.strip() for o in outs), [o.text for o in outs]
    printed = capsys.readouterr().out
    first = f"{outs[1].text} {outs[1].finish_reason} {outs[1].stats['acceptance_rate']}\n"
    assert printed.startswith(first) and printed[len(first):].strip(), printed
    (silent,) = llms["exact"].generate([{"role": "user", "content": "Reverse a list."}], SamplingParams(max_tokens=64))
    assert (silent.text, silent.finish_reason, len(silent.token_ids)) == ("", "stop", 1)


def test_exported_names_and_step_sampling_compatibility():
    p = simsd.SamplingParams(temperature=0.5, top_k=3)
    assert isinstance(p, StepSampling) and not p.greedy  # fits DecodeConfig(sampling=...) as before
    assert DecodeConfig(sampling=p).sampling.top_k == 3
    assert simsd.LLM is LLM and simsd.RequestOutput.__name__ == "RequestOutput"


def test_llm_construction_errors(llms):
    base = llms["exact"]
    with pytest.raises(ValueError, match="mode"):
        LLM(base.target, mode="fast")
    with pytest.raises(ValueError, match="draft"):
        LLM(base.target, base.draft, mode="vanilla")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(base.target, mode="vanilla", max_model_len=10**6)
    with pytest.raises(ValueError, match=r"^kv_cache_memory 1000 bytes holds no row of 2048 tokens \(\d+\.\d\d MiB "):
        LLM(base.target, mode="vanilla", kv_cache_memory=1000)  # a small limit in a unit that shows it
    per_row = 4096 * (512 + 8)  # 4 KiB per token, 256 + 4 rounded to 512, plus the query margin of 2 blocks
    for memory, rows in ((3 * per_row + 4095, 3), (3 * per_row, 3), (3 * per_row - 1, 2)):
        small = LLM(base.target, mode="vanilla", batch_size=8, max_model_len=256, kv_cache_memory=memory)
        assert small.batch_size == rows and small.kv_cache_bytes == rows * per_row
        small.shutdown()
