"""Every decoding mode with a mixture-of-experts model (SDAR-MoE layout) as the target, the draft
or both: exact SimSD gives vanilla's tokens (greedy and sampling, float32 and bfloat16), the
paper mode's one-layer identity holds, and a batch equals its single runs.

The dense counterparts are tests/simsd/speculative/test_exact_sampling.py,
test_speculative.py and tests/simsd/engine/test_batch.py; the checkpoints here are the same
tiny shapes with 8 experts (top 2, renormalised) in every layer.
"""
import dataclasses

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint, vanilla_generate
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.models.moe import SparseMoeBlock
from simsd.speculative import SpecConfig, speculative_generate, speculative_generate_batch
from tests.helpers import random_checkpoint

V = 96
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 8, 13)]
MOE = (("num_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 32))
#: name -> (layers, seed, std, moe fields); "moe-near" is "moe-target" with weights scaled by 1.1 (agrees often)
CHECKPOINTS = {"target": (2, 0, 0.2, ()), "poor-draft": (1, 11, 0.2, ()), "moe-target": (2, 0, 0.2, MOE),
               "moe-near": (2, 0, 0.22, MOE), "moe-draft": (1, 11, 0.2, MOE), "moe-one-layer": (1, 3, 0.2, MOE)}
PAIRS = {"moe target, dense draft": ("moe-target", "poor-draft"), "moe target, moe draft": ("moe-target", "moe-near"),
         "dense target, moe draft": ("target", "moe-draft")}


def ckpt(name, dtype="float32", invariant=True):
    layers, seed, std, moe = CHECKPOINTS[name]
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=std,
                             moe=moe)
    c = load_checkpoint(path, dtype=dtype, with_tokenizer=False)
    c.model.invariant = invariant
    return dataclasses.replace(c, stop_ids=[])


def test_the_moe_checkpoints_are_moe():
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in ckpt("moe-target").model.model.layers)
    assert not any(isinstance(layer.mlp, SparseMoeBlock) for layer in ckpt("target").model.model.layers)


def sampling(T):
    return SamplingParams(temperature=T, top_k=40, top_p=0.95) if T else SamplingParams()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_exact_equals_vanilla(pair, T, dtype):
    target, draft = (ckpt(n, dtype) for n in PAIRS[pair])
    accepted = proposed = 0
    for i, prompt in enumerate(PROMPTS):
        strategy = ("static", "dynamic", "sequential")[i]
        cfg = DecodeConfig(block_length=4, strategy=strategy, threshold=0.7 if strategy == "dynamic" else None,
                           max_new_tokens=16, seed=i, sampling=sampling(T))
        got = speculative_generate(target, draft, prompt, cfg, SpecConfig(mode="exact"))
        want = vanilla_generate(target.model, prompt, cfg, target.mask_token_id, [])
        assert got.token_ids == want.token_ids, (i, strategy)
        assert len(got.token_ids) == 16
        accepted += got.stats["accepted"]
        proposed += got.stats["proposed"]
    assert proposed > 0
    if pair == "moe target, moe draft":
        assert accepted > 0  # the near draft is accepted somewhere: the accept path ran


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_self_draft_accepts_every_step(dtype):
    target = ckpt("moe-target", dtype)
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=12, seed=3, sampling=sampling(1.0))
    got = speculative_generate(target, target, PROMPTS[1], cfg, SpecConfig(mode="exact"))
    assert got.stats["acceptance_rate"] == 1.0
    assert got.token_ids == vanilla_generate(target.model, PROMPTS[1], cfg, target.mask_token_id, []).token_ids


@pytest.mark.parametrize("on_reject", ["redraft", "fallback"])
def test_paper_one_layer_moe_equals_vanilla(on_reject):
    """With one layer the paper mask is exact: greedy paper SimSD with the sequential strategy
    gives the vanilla target's tokens, for a MoE self-draft and a dense poor draft."""
    target = ckpt("moe-one-layer", "float64", invariant=False)
    cfg = DecodeConfig(block_length=4, strategy="sequential", max_new_tokens=12)
    want = vanilla_generate(target.model, PROMPTS[1], cfg, target.mask_token_id, []).token_ids
    for draft in (target, ckpt("poor-draft", "float64", invariant=False)):
        got = speculative_generate(target, draft, PROMPTS[1], cfg, SpecConfig(mode="paper", on_reject=on_reject))
        assert got.token_ids == want
        if draft is target:
            assert got.stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("mode", ["vanilla", "paper", "exact"])
def test_batch_equals_single_runs(mode, T):
    target, draft = ckpt("moe-target", "float64"), ckpt("moe-draft", "float64")
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=10, seed=5, sampling=sampling(T))
    spec = SpecConfig(mode=mode if mode != "vanilla" else "exact")
    if mode == "vanilla":
        got = vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, [])
    else:
        got = speculative_generate_batch(target, draft, PROMPTS, cfg, spec)
    for i, p in enumerate(PROMPTS):
        one = dataclasses.replace(cfg, seed=cfg.seed + i)
        want = (vanilla_generate(target.model, p, one, target.mask_token_id, []) if mode == "vanilla"
                else speculative_generate(target, draft, p, one, spec))
        assert got.results[i].token_ids == want.token_ids, i
