"""One driver (docs/design.md §6): the batch decoders and the Python API run the same row programs
through the scheduler, so they give the same tokens and the same per-row statistics, built in
one place (``RowProgram.stats_for``); the batch decoders keep no engine after a call, and every
model forward of the engine is called from the engine itself (the batched forward, which runs
the prefill chunks too, and the CUDA-graph runner), with no wrapper between."""
import dataclasses
import gc
import inspect
import sys
import weakref
from pathlib import Path

import pytest
import torch

from simsd import LLM, DecodeConfig, SamplingParams, load_checkpoint
from simsd.decoding.sampling import StepSampling
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.engine import batching
from simsd.speculative import SpecConfig, speculative_generate_batch
from tests.helpers import random_checkpoint

V = 96
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 14)]
#: the directories of simsd's own packages ("simsd/" in a path also matches a checkout named simsd)
PACKAGE_DIRS = tuple(str(Path(__file__).resolve().parents[3] / p) + "/" for p in ("simsd", "simsd_kernels"))


def in_packages(filename: str) -> bool:
    """``filename`` (a frame's) is a module of simsd's own packages."""
    return str(Path(filename).resolve()).startswith(PACKAGE_DIRS)

TIMING = {"decode_seconds", "tokens_per_second"}  # the run's clock: not comparable between two runs
API_ONLY = {"queue_seconds", "time_to_first_token"}


def ckpt(name, layers, seed):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2)
    return load_checkpoint(path, dtype="float32", with_tokenizer=False)


@pytest.fixture(scope="module")
def pair():
    target, draft = ckpt("driver-target", 2, 0), ckpt("driver-draft", 1, 11)
    # a stop id from the free output, so that rows stop at different points (and cut tokens)
    free = vanilla_generate_batch(target.model, PROMPTS[1:2], DecodeConfig(max_new_tokens=12), target.mask_token_id,
                                  []).results[0].token_ids
    target = dataclasses.replace(target, stop_ids=[free[6]])
    return target, dataclasses.replace(draft, stop_ids=target.stop_ids)


def batch(mode, target, draft, cfg):
    if mode == "vanilla":
        return vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, target.stop_ids)
    return speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode))


@pytest.mark.parametrize("temperature", [0.0, 1.3])
@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_batch_functions_and_api_give_the_same_tokens_and_stats(pair, mode, temperature):
    target, draft = pair
    sampling = StepSampling(temperature=temperature)
    cfg = DecodeConfig(block_length=4, max_new_tokens=14, seed=21, sampling=sampling)
    want = batch(mode, target, draft, cfg).results
    llm = LLM(target, None if mode == "vanilla" else draft, mode, batch_size=len(PROMPTS), block_length=4,
              max_model_len=64, scheduler_thread=False)
    try:
        params = [SamplingParams(temperature=temperature, max_tokens=14, seed=cfg.seed + i)
                  for i in range(len(PROMPTS))]
        got = llm.generate(PROMPTS, params)
    finally:
        llm.shutdown()
    assert len({len(r.token_ids) for r in want}) > 1 and any(r.stats["cut_tokens"] for r in want)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert set(g.stats) == set(w.stats) | API_ONLY
        assert {k: g.stats[k] for k in set(w.stats) - TIMING} == {k: w.stats[k] for k in set(w.stats) - TIMING}


def test_no_engine_outlives_a_batch_call(pair, monkeypatch):
    """No module-global pool: each batch call makes its own engine and keeps none."""
    target, draft = pair
    made = []
    init = batching.BatchEngine.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))
    monkeypatch.setattr(batching.BatchEngine, "__init__", recording)
    cfg = DecodeConfig(block_length=4, max_new_tokens=6)
    for mode in ("vanilla", "exact", "exact"):
        batch(mode, target, draft, cfg)
    gc.collect()
    assert len(made) == 3 and all(ref() is None for ref in made)
    assert not [name for name, value in vars(batching).items() if isinstance(value, (dict, list)) and value
                and isinstance(next(iter(value.values() if isinstance(value, dict) else value)), batching.BatchEngine)]


@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_every_model_forward_is_called_by_the_engine(pair, mode, monkeypatch):
    """Prefill chunks, batched forwards and graph replays (eager capture on the CPU) all call the
    model straight from the engine's methods: the batched forward (prefill chunks are its
    requests, ``BatchEngine.prefill`` only yields them) and the graph runner (its eager path and
    the forward it captures)."""
    import simsd.engine.graphs as graphs
    monkeypatch.setattr(graphs, "cuda_capture", graphs.eager_capture)
    monkeypatch.setattr(graphs, "check_graphable", lambda model: None)
    target, draft = pair
    callers, modes = [], []

    def hook(module, args):
        frames = inspect.stack()[2:6]
        caller = next((f for f in frames if in_packages(f.filename)), None)
        callers.append("?" if caller is None else (Path(caller.filename).name, caller.function))
        modes.append((args[3], args[6] if len(args) > 6 else "?"))  # mask mode, logits
    handles = [c.model.register_forward_pre_hook(hook) for c in (target, draft)]
    try:
        for graphs_on in (False, True):
            cfg = DecodeConfig(block_length=4, max_new_tokens=8, fold_commit=graphs_on and mode != "paper")
            if mode == "vanilla":
                vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, target.stop_ids,
                                       cuda_graphs=graphs_on)
            else:
                speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode), cuda_graphs=graphs_on)
    finally:
        for h in handles:
            h.remove()
    engine = {("batching.py", "forward"), ("graphs.py", "__call__"), ("graphs.py", "_run")}
    assert len(callers) > 20 and set(callers) <= engine, set(callers)
    assert ("batching.py", "forward") in callers
    # the prefill chunks: block-causal without logits (a folded commit is block-causal with logits)
    prefills = [c for c, m in zip(callers, modes) if m == ("block_causal", None)]
    assert prefills and set(prefills) == {("batching.py", "forward")}


def _project_frames() -> list:
    """The qualified names of the calling stack's frames in simsd's packages, outermost first."""
    names, f = [], sys._getframe(1)
    while f is not None:
        if in_packages(f.f_code.co_filename):
            names.append(f.f_code.co_qualname)
        f = f.f_back
    return names[::-1]


#: the torch backend's calls below ``TorchAttention.forward`` for a prefill chunk (block-causal groups)
PREFILL = ("TorchAttention._grouped", "TorchAttention._sdpa")


def test_the_path_from_a_request_to_the_attention_kernel(pair, monkeypatch):
    """The hops of docs/design.md §6 (no wrapper between): ``LLM.submit`` queues the request
    (``Scheduler.submit``); on the scheduling thread a round (``Scheduler.step``: its inputs taken,
    then ``Scheduler.run_round``) runs the engine's batched forward, which calls the model, whose
    layers call the backend's door, which launches the kernel (here the torch backend's SDPA calls:
    per run of rows when decoding, per group of tokens that see the same keys for the prompt's
    prefill chunk)."""
    import torch.nn.functional as F

    from simsd.engine.scheduler import Scheduler
    target, _ = pair
    sdpa, submit = F.scaled_dot_product_attention, Scheduler.submit
    launches, queued = [], []

    def recording_sdpa(*args, **kwargs):
        launches.append(_project_frames())
        return sdpa(*args, **kwargs)

    def recording_submit(self, *args, **kwargs):
        queued.append(_project_frames())
        return submit(self, *args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    monkeypatch.setattr(Scheduler, "submit", recording_submit)
    llm = LLM(target, None, "vanilla", batch_size=1, block_length=4, max_model_len=64, scheduler_thread=True)
    try:
        llm.submit(PROMPTS[1], SamplingParams(max_tokens=8)).result(timeout=300)
    finally:
        assert llm.shutdown(timeout=60)
    assert queued == [["LLM.submit"]]
    hops = ["Scheduler._loop", "Scheduler.step", "Scheduler.run_round", "BatchEngine.forward",
            "SDARForCausalLM.forward", "DecoderLayer.forward", "TorchAttention.forward"]
    assert launches and all(s[:len(hops)] == hops for s in launches), {tuple(s) for s in launches}
    assert {tuple(s[len(hops):]) for s in launches} == {("TorchAttention._runs", "TorchAttention._sdpa"), PREFILL}


def test_one_speculative_decoder_per_llm(pair, monkeypatch):
    """The LLM builds its speculative decoder once (it used to build a throwaway one to check the
    settings and another per request); each request brings its own plan: a request's gamma
    reaches its rows, not the decoder's."""
    from simsd.speculative import decoder as decoder_module
    made, gammas = [], []
    init, new_row = decoder_module.SpeculativeDecoder.__init__, decoder_module.SpeculativeDecoder.new_row

    def counting(self, *args, **kwargs):
        made.append(1)
        init(self, *args, **kwargs)

    def recording(self, row, seed, stop_ids=None, plan=None, verifier_class=None):
        gammas.append(plan.gamma)
        return new_row(self, row, seed, stop_ids, plan, verifier_class)
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "__init__", counting)
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "new_row", recording)
    target, draft = pair
    llm = LLM(target, draft, "exact", batch_size=2, block_length=4, max_model_len=64, scheduler_thread=False)
    try:
        outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]],
                            [SamplingParams(max_tokens=6, gamma=g) for g in (1, 2, 3)])
    finally:
        llm.shutdown()
    assert len(outs) == 3 and len(made) == 1 and sorted(gammas) == [1, 2, 3], (made, gammas)
    assert [o.stats["gamma"] for o in outs] == [1, 2, 3]  # what the rows ran
    assert llm.decoder.plan.gamma == 4  # the decoder's own plan: the block length
