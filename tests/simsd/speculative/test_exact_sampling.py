"""Exact mode under sampling (docs/design.md §4.2): with the keyed noise, exact SimSD gives the same
tokens as vanilla decoding with the target and the same seed, for any draft, strategy,
temperature, top-k and top-p; the draft's agreement comes from the shared noise.

The target runs with ``invariant`` numerics, so that a verify copy's logits are a denoise
forward's bits (tests/simsd/models/test_invariant_numerics.py).
"""
import dataclasses
import os

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint, vanilla_generate
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.speculative import SpecConfig, speculative_generate, speculative_generate_batch
from tests.helpers import random_checkpoint

V = 96
THRESHOLD = {"dynamic": 0.7, "entropy": 1.0}  # both multi- and single-token steps at T = 0.3 and 1.0
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 8, 13)]


def ckpt(name, layers=2, seed=0, std=0.2, dtype="float32", moe=()):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=std,
                             moe=moe)
    c = load_checkpoint(path, dtype=dtype, with_tokenizer=False)
    c.model.invariant = True
    return dataclasses.replace(c, stop_ids=[])


@pytest.fixture(scope="module")
def models():
    # "tiny": a random one-layer draft (it almost never agrees); "near": the target's weights
    # projection weights scaled by 1.1 (agrees often: accepted steps, rejections and bonus steps occur)
    return {"target": ckpt("target"), "tiny": ckpt("poor-draft", layers=1, seed=11),
            "near": ckpt("target", std=0.22)}


@pytest.fixture(scope="module", params=["dense", "moe"])
def arch_models(request, models):
    """``models`` (dense), and their mixture-of-experts twins (tests/simsd/speculative/test_moe_modes.py)."""
    if request.param == "dense":
        return models
    from tests.simsd.speculative.test_moe_modes import MOE
    return {"target": ckpt("moe-target", moe=MOE), "near": ckpt("moe-target", std=0.22, moe=MOE)}


def cfg_for(strategy, T, seed=0, **kw):
    return DecodeConfig(block_length=kw.pop("block_length", 4), strategy=strategy, threshold=THRESHOLD.get(strategy),
                        max_new_tokens=kw.pop("max_new_tokens", 16), seed=seed,
                        sampling=SamplingParams(temperature=T, top_k=40, top_p=0.95), **kw)


def vanilla_ids(target, prompt, cfg):
    return vanilla_generate(target.model, prompt, cfg, target.mask_token_id, []).token_ids


@pytest.mark.parametrize("T", [0.3, 1.0])
@pytest.mark.parametrize("strategy", ["static", "sequential", "dynamic", "entropy"])
def test_exact_equals_vanilla_under_sampling(models, strategy, T):
    target = models["target"]
    accepted = proposed = 0
    for draft in ("tiny", "near"):
        for i, prompt in enumerate(PROMPTS):
            cfg = cfg_for(strategy, T, seed=i)
            got = speculative_generate(target, models[draft], prompt, cfg, SpecConfig(mode="exact"))
            assert got.token_ids == vanilla_ids(target, prompt, cfg), (draft, i)
            if draft == "near":
                accepted += got.stats["accepted"]
                proposed += got.stats["proposed"]
    assert 0 < accepted < proposed  # the coupled draft is accepted, and rejected, somewhere


@pytest.mark.parametrize("strategy", ["static", "sequential", "dynamic", "entropy"])
def test_self_draft_accepts_every_step_under_sampling(models, strategy):
    """The target as its own draft sees the same noise and the same logits: every draft step is
    the target's step, in bfloat16 too; with gamma 2 rounds start mid-block, and the draft's
    steps still draw the noise of their step in the block (round start + draft step)."""
    for dtype, gamma in (("float32", None), ("bfloat16", None), ("float32", 2)):
        target = ckpt("target", dtype=dtype)
        cfg = cfg_for(strategy, 1.0, seed=3)
        got = speculative_generate(target, target, PROMPTS[1], cfg, SpecConfig(mode="exact", gamma=gamma))
        assert got.stats["acceptance_rate"] == 1.0, (dtype, gamma)
        assert got.token_ids == vanilla_ids(target, PROMPTS[1], cfg), (dtype, gamma)
        if gamma is not None and strategy in ("static", "sequential"):  # one token per step: 2 rounds a block
            assert got.stats["rounds"] > got.stats["blocks"]  # rounds that start mid-block ran


#: a decoding path of the speculative loop: ``(DecodeConfig fields, SpecConfig fields)``
PATH_VARIANTS = {
    "gamma1": ({}, {"gamma": 1}),  # one proposal a round
    "gamma2": ({}, {"gamma": 2}),  # rounds that start mid-block
    "fallback": ({}, {"gamma": 3, "on_reject": "fallback"}),  # the target finishing a block
    "fold": ({"fold_commit": True}, {}),
    "optimistic": ({}, {"optimistic": True}),
    "b8_steps4": ({"block_length": 8, "steps": 4, "max_new_tokens": 24}, {}),  # multi-token steps
    "draft_strategy": ({}, {"draft_strategy": "sequential"}),
    "moe": ({}, {}),  # the path of a mixture-of-experts target (the test loads it)
}


@pytest.mark.parametrize("variant", ["gamma2", "fallback", "fold", "optimistic", "b8_steps4", "draft_strategy"])
def test_exact_sampling_paths(arch_models, variant):
    """Rounds that start mid-block (gamma 2), the target finishing a block (fallback), folded
    commits, optimistic drafting, multi-token steps (B = 8 in 4 steps) and a draft with its own
    strategy: still vanilla's tokens (dense and MoE models)."""
    target, draft = arch_models["target"], arch_models["near"]
    kw, spec = PATH_VARIANTS[variant]
    for i, prompt in enumerate(PROMPTS):
        cfg = cfg_for("static", 1.0, seed=10 + i, **kw)
        got = speculative_generate(target, draft, prompt, cfg, SpecConfig(mode="exact", **spec))
        assert got.token_ids == vanilla_ids(target, prompt, cfg), i
        if variant == "fallback":
            assert got.stats["fallback_steps"] > 0
        if variant == "optimistic":
            assert got.stats["speculations_kept"] > 0


def test_exact_batch_equals_vanilla_batch_under_sampling(models):
    """Rows with independent progress: each row's noise is keyed by its own seed, so the batch
    equals vanilla's batch (and single runs with seed + i)."""
    target, draft = models["target"], models["near"]
    cfg = cfg_for("static", 1.0, seed=4)
    want = vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id, [])
    got = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode="exact"))
    assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    for i, p in enumerate(PROMPTS):
        assert got.results[i].token_ids == vanilla_ids(target, p, dataclasses.replace(cfg, seed=cfg.seed + i))


@pytest.mark.parametrize("mode", ["paper", "exact"])
def test_optimistic_sampling_equals_plain(models, mode):
    """A kept speculation is exactly the draft the round would compute (keyed noise), so
    speculation changes no token under sampling either."""
    target, draft = models["target"], models["near"]
    cfg = cfg_for("static", 1.0, seed=2, max_new_tokens=20)
    plain = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode, optimistic=False))
    opt = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode=mode, optimistic=True))
    assert [r.token_ids for r in opt.results] == [r.token_ids for r in plain.results]
    assert sum(r.stats["speculations_kept"] for r in opt.results) > 0


def bundled_pair(dtype):
    import simsd.assets
    root = os.path.dirname(simsd.assets.__file__)
    t = load_checkpoint(os.path.join(root, "tiny-sdar-target"), dtype=dtype)
    d = load_checkpoint(os.path.join(root, "tiny-sdar-draft"), dtype=dtype)
    t.model.invariant = True
    return t, d


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_bundled_pair_bfloat16_identity(T):
    """The bundled pair in bfloat16 (the GPU default), greedy and sampling, two strategies."""
    from simsd.entrypoints.prompts import load_prompts
    target, draft = bundled_pair("bfloat16")
    tok = target.tokenizer
    prompts = [tok(p.text, add_special_tokens=False)["input_ids"] for p in load_prompts("bundled")[:3]]
    for strategy in ("static", "sequential"):
        cfg = DecodeConfig(block_length=4, strategy=strategy, max_new_tokens=24, seed=7,
                           sampling=SamplingParams(temperature=T, top_p=0.9 if T else 1.0))
        want = vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id, target.stop_ids)
        got = speculative_generate_batch(target, draft, prompts, cfg, SpecConfig(mode="exact"))
        assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results], strategy
        assert sum(r.stats["accepted"] for r in got.results) > 0


def test_cli_invariant_flag(capsys):
    """``simsd generate --invariant``: bfloat16 exact output equals vanilla under sampling; the
    flag cannot be combined with CUDA graphs (whose runner does not run the per-unit path)."""
    import json

    from simsd.entrypoints.cli import main
    args = ["generate", "--dtype", "bfloat16", "--invariant", "--prompt-set", "bundled", "--limit", "2",
            "--max-new-tokens", "16", "--temperature", "1.0", "--top-p", "0.9", "--seed", "5", "--json"]
    outs = {}
    for mode in ("vanilla", "exact"):
        assert main(args + ["--mode", mode]) == 0
        outs[mode] = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert outs["exact"] == outs["vanilla"] and len(outs["exact"]) == 2
    assert main(["generate", "--invariant", "--cuda-graphs", "--prompt-ids", "5,6,7"]) == 2
    assert "--invariant is not available with --cuda-graphs" in capsys.readouterr().err
