"""The decoding loop reads device data on the host once per round: the accept decision
(docs/design.md §6). On a GPU every such read waits for the stream; here they are counted on the CPU
with :class:`simsd.engine.host_sync.HostReads`, and on a GPU with ``torch.cuda.set_sync_debug_mode``."""
import collections
import dataclasses
import warnings

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint
from simsd.assets import DEFAULT_TARGET
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.engine.host_sync import HostReads, to_device
from simsd.speculative import SpecConfig, speculative_generate_batch
from tests.helpers import random_checkpoint

V = 96
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 8, 13)]


def ckpt(name, layers, seed, device="cpu", dtype="float64"):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=0.2)
    c = load_checkpoint(path, dtype=dtype, device=device, with_tokenizer=False)
    return dataclasses.replace(c, stop_ids=[])


@pytest.fixture(scope="module")
def pair():
    return ckpt("target", 2, 0), ckpt("poor-draft", 1, 11)


def totals(batch, key):
    return sum(r.stats[key] for r in batch.results)


@pytest.mark.parametrize("mode", ["exact", "paper"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("strategy,fold", [("static", False), ("sequential", True)])
def test_one_read_per_round(pair, mode, temperature, strategy, fold):
    target, draft = pair
    cfg = DecodeConfig(block_length=4, strategy=strategy, max_new_tokens=24, fold_commit=fold,
                       sampling=SamplingParams(temperature=temperature))
    with HostReads(trace=True) as reads:
        out = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode))
    rounds = totals(out, "rounds")
    assert rounds > len(PROMPTS) * 6
    assert reads.count == rounds, [w for _, w in reads.where[:3]]


def test_fallback_step_reads_its_block(pair):
    target, draft = pair
    cfg = DecodeConfig(block_length=4, max_new_tokens=24)
    with HostReads() as reads:
        out = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode="paper", on_reject="fallback"))
    assert totals(out, "fallback_steps") > 0
    assert reads.count == totals(out, "rounds") + totals(out, "fallback_steps")


def test_dynamic_draft_reads_its_mask_count_per_step(pair):
    """Data-dependent reveal counts: one more read per draft denoise step."""
    target, draft = pair
    cfg = DecodeConfig(block_length=4, strategy="dynamic", threshold=0.05, max_new_tokens=24)
    with HostReads() as reads:
        out = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode="exact"))
    draft_steps = totals(out, "draft_forwards") - sum(r.stats["blocks"] - 1 for r in out.results)
    assert reads.count == totals(out, "rounds") + draft_steps


def test_vanilla_reads_one_block_per_step(pair):
    target, _ = pair
    cfg = DecodeConfig(block_length=4, max_new_tokens=24, sampling=SamplingParams(temperature=1.0))
    with HostReads() as reads:
        out = vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, [])
    steps = totals(out, "target_forwards") - sum(r.stats["blocks"] - 1 for r in out.results)
    assert reads.count == steps


@pytest.mark.parametrize("mode", ["vanilla", "exact", "paper", "exact-self"])
def test_penalties_add_no_read(pair, mode):
    """A request with penalties counts its output on the device (simsd.decoding.penalties): the
    same reads as without, one per round (vanilla: per step)."""
    target, draft = pair
    sampling = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    cfg = DecodeConfig(block_length=4, max_new_tokens=24, sampling=sampling)
    with HostReads(trace=True) as reads:
        if mode == "vanilla":
            out = vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, [])
        else:
            spec = SpecConfig(mode=mode.split("-")[0], speculation_width=7 if mode == "exact-self" else "auto")
            out = speculative_generate_batch(target, "self" if mode == "exact-self" else draft, PROMPTS, cfg, spec)
    if mode == "vanilla":
        want = totals(out, "target_forwards") - sum(r.stats["blocks"] - 1 for r in out.results)
    else:  # self-speculation reads a grown tree back when the history's predictions may repeat a sibling
        want = totals(out, "rounds") + totals(out, "tree_reads")
    assert reads.count == want, [w for _, w in reads.where[:3]]


@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_self_speculation_reads_a_tree_back_only_when_it_may_repeat_a_sibling(strategy):
    """Self-speculation on the bundled target, whose history predicts much of its output: a round
    whose tree holds the history's predictions (or a data-dependent strategy's counts) reads the
    grown tree once before its forward (``tree_reads``), every other round reads only its
    decision; vanilla's tokens."""
    from simsd.entrypoints.prompts import load_prompts
    target = load_checkpoint(DEFAULT_TARGET, dtype="float32")
    tok = target.tokenizer
    prompts = [tok(p.text, add_special_tokens=False)["input_ids"] for p in load_prompts("bundled")[:3]]
    cfg = DecodeConfig(block_length=4, max_new_tokens=32, strategy=strategy,
                       threshold=0.05 if strategy == "dynamic" else None, fold_commit=True)
    with HostReads() as reads:
        out = speculative_generate_batch(target, "self", prompts, cfg, SpecConfig(mode="exact", speculation_width=16))
    assert 0 < totals(out, "tree_reads") <= totals(out, "rounds")
    if strategy == "static":  # rounds without the history's predictions read nothing more
        assert totals(out, "tree_reads") < totals(out, "rounds")
    assert reads.count == totals(out, "rounds") + totals(out, "tree_reads")
    want = vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id, target.stop_ids).results
    assert [r.token_ids for r in out.results] == [r.token_ids for r in want]


def test_counter_sees_the_usual_reads():
    x = torch.arange(4)
    with HostReads() as reads:
        bool(x.any())
        x.tolist()
        int(x[1])
        torch.nonzero(x)
        to_device([1, 2], "cpu")
    assert reads.count == 4


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "paper"])
def test_gpu_syncs_equal_rounds(mode):
    """On a GPU: the synchronising operations torch reports during decoding (eager, triton or
    cuda attention) are the decisions, one per round."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target, draft = ckpt("target", 2, 0, "cuda", "bfloat16"), ckpt("poor-draft", 1, 11, "cuda", "bfloat16")
    cfg = DecodeConfig(block_length=4, max_new_tokens=24, sampling=SamplingParams(temperature=1.0))
    speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode))  # warm-up (compilation)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the debug mode's own notice ("... is a prototype feature ...") is not a sync
    syncs = [w for w in caught if "synchronizing" in str(w.message)]
    # each round's decision is one device-to-host copy; torch.cuda.synchronize (the timer) is
    # not reported by the debug mode
    rounds = totals(out, "rounds")
    sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in syncs)
    assert rounds <= len(syncs) <= rounds + 2, (rounds, len(syncs), sites.most_common(8))


@pytest.mark.parametrize("mode", ["exact", "paper", "vanilla"])
def test_logprobs_add_one_read_per_block(pair, mode):
    """Log-probabilities, when asked for, are read once per finished block (with none asked for,
    the counts above hold: nothing is computed)."""
    target, draft = pair
    cfg = DecodeConfig(block_length=4, max_new_tokens=24, sampling=SamplingParams(temperature=1.0), logprobs=2)
    with HostReads() as reads:
        if mode == "vanilla":
            out = vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, [])
        else:
            out = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode))
    per_step = totals(out, "target_forwards") - totals(out, "blocks") + len(PROMPTS) if mode == "vanilla" else \
        totals(out, "rounds")
    assert reads.count == per_step + totals(out, "blocks")
    assert all(len(r.logprobs) == len(r.token_ids) for r in out.results)
