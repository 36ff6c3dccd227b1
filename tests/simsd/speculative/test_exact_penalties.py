"""Exact mode with vLLM's penalties (simsd.decoding.penalties): each verify copy's logits get the
penalty of that copy's own state (the output of the earlier blocks and the tokens revealed in
the copy), so exact mode stays vanilla decoding's, token for token: with a draft model (its chain,
alternatives beside its steps), with ``draft="self"`` (trees, lookahead rounds into the next
block), every strategy, greedy and sampled, float32 and bfloat16, folded commits, fallback steps,
mid-block rounds, optimistic drafting, and batches whose rows have different penalties or none.
Paper mode applies them at each M slot with the state that slot sees (checked by hand).

The targets run with ``invariant`` numerics (a verify copy's logits are a denoise forward's bits).
"""
import dataclasses

import pytest
import torch

from simsd import DecodeConfig, SamplingParams
from simsd.config.fields import StepSampling
from simsd.decoding.penalties import TokenHistory
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.speculative import SpecConfig, speculative_generate_batch
from tests.simsd.speculative.test_exact_sampling import PATH_VARIANTS, PROMPTS, THRESHOLD, bundled_pair, ckpt

PEN = {"presence": dict(presence_penalty=1.5, frequency_penalty=0.5), "repetition": dict(repetition_penalty=1.8)}


@pytest.fixture(scope="module")
def models():
    return {"target": ckpt("target"), "tiny": ckpt("poor-draft", layers=1, seed=11), "near": ckpt("target", std=0.22)}


def cfg_for(strategy, T, seed, pen, **kw):
    top = dict(top_k=40, top_p=0.95) if T else {}
    return DecodeConfig(block_length=kw.pop("block_length", 4), strategy=strategy, threshold=THRESHOLD.get(strategy),
                        max_new_tokens=kw.pop("max_new_tokens", 20), seed=seed,
                        sampling=SamplingParams(temperature=T, **top, **PEN[pen]), **kw)


def vanilla_batch(target, cfg, prompts=PROMPTS):
    return [r.token_ids for r in vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id, []).results]


@pytest.mark.parametrize("pen", list(PEN))
@pytest.mark.parametrize("T", [0.0, 1.0])
@pytest.mark.parametrize("strategy", ["static", "sequential", "dynamic", "entropy"])
def test_exact_with_penalties_equals_vanilla(models, strategy, T, pen):
    """Both drafts, the chain and the widest alternatives, and self-speculation with a fixed width
    (trees, lookahead rounds): vanilla's tokens with the penalties, which change the tokens."""
    target = models["target"]
    cfg = cfg_for(strategy, T, 5, pen)
    want = vanilla_batch(target, cfg)
    plain = vanilla_batch(target, dataclasses.replace(cfg, sampling=SamplingParams(temperature=T)))
    assert want != plain  # the penalties act
    for draft, width in (("tiny", "auto"), ("near", "auto"), ("near", 25), ("self", 7)):
        d = "self" if draft == "self" else models[draft]
        got = speculative_generate_batch(target, d, PROMPTS, cfg, SpecConfig(mode="exact", speculation_width=width))
        assert [r.token_ids for r in got.results] == want, (draft, width)
        if draft == "near":
            assert sum(r.stats["accepted"] for r in got.results) > 0


def test_lookahead_rounds_with_penalties(models):
    """draft="self"'s lookahead rounds take the next block's first step on a copy whose output so
    far includes the proposed finished block: vanilla's tokens, and such rounds are kept."""
    target, lookaheads = models["target"], 0
    for pen in PEN:
        for T in (0.0, 1.0):
            cfg = cfg_for("static", T, 2, pen, max_new_tokens=40)
            spec = SpecConfig(mode="exact", speculation_width=7)
            got = speculative_generate_batch(target, "self", PROMPTS, cfg, spec)
            assert [r.token_ids for r in got.results] == vanilla_batch(target, cfg), (pen, T)
            lookaheads += sum(r.stats["lookahead_blocks"] for r in got.results)
    assert lookaheads > 0


@pytest.mark.parametrize("variant", ["gamma2", "fallback", "fold", "optimistic", "b8_steps4"])
def test_exact_penalties_paths(models, variant):
    """Mid-block rounds, the target finishing a block, folded commits, optimistic drafting (drafts
    of the next block count the assumed finished block) and multi-token steps."""
    target, draft = models["target"], models["near"]
    kw, spec = PATH_VARIANTS[variant]
    for pen in PEN:
        cfg = cfg_for("static", 1.0, 9, pen, **kw)
        got = speculative_generate_batch(target, draft, PROMPTS, cfg, SpecConfig(mode="exact", **spec))
        assert [r.token_ids for r in got.results] == vanilla_batch(target, cfg), pen
        if variant == "optimistic":
            assert sum(r.stats["speculations_kept"] for r in got.results) > 0
        got = speculative_generate_batch(target, "self", PROMPTS, cfg,
                                         SpecConfig(mode="exact", speculation_width=7,
                                                    **{k: v for k, v in spec.items() if k != "optimistic"}))
        assert [r.token_ids for r in got.results] == vanilla_batch(target, cfg), (pen, "self")


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_bundled_pair_bfloat16_with_penalties(T):
    """The bundled pair in bfloat16, a batch of three prompts, both penalty kinds: vanilla's tokens
    with the draft model and with draft="self"."""
    from simsd.entrypoints.prompts import load_prompts
    target, draft = bundled_pair("bfloat16")
    tok = target.tokenizer
    prompts = [tok(p.text, add_special_tokens=False)["input_ids"] for p in load_prompts("bundled")[:3]]
    for pen in PEN:
        cfg = DecodeConfig(block_length=4, max_new_tokens=24, seed=7,
                           sampling=SamplingParams(temperature=T, top_p=0.9 if T else 1.0, **PEN[pen]))
        want = [r.token_ids for r in vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id,
                                                             target.stop_ids).results]
        for d, spec in ((draft, SpecConfig(mode="exact")), (draft, SpecConfig(mode="exact", speculation_width=25)),
                        ("self", SpecConfig(mode="exact", speculation_width=9))):
            got = speculative_generate_batch(target, d, prompts, cfg, spec)
            assert [r.token_ids for r in got.results] == want, (pen, spec)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_of_rows_with_different_penalties(dtype):
    """simsd.LLM on the bundled pair, one batch whose rows have different penalties and none:
    exact (draft model and draft="self") gives vanilla's tokens row by row, and each row's tokens
    are those it gets alone."""
    from simsd import LLM
    prompts = ["def add(a, b):", "Once upon a time", "The capital of France is", "import numpy as np"]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=3, presence_penalty=1.2),
              SamplingParams(max_tokens=24, temperature=1.0, seed=4),
              SamplingParams(max_tokens=24, seed=5, repetition_penalty=1.6, frequency_penalty=0.4),
              SamplingParams(max_tokens=24, seed=6)]
    kw = dict(dtype=dtype, device="cpu", invariant=True, batch_size=4, scheduler_thread=False)
    vanilla = LLM(mode="vanilla", **kw)
    want = [o.token_ids for o in vanilla.generate(prompts, params)]
    alone = [vanilla.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert want == alone
    for draft in (None, "self"):
        llm = LLM(mode="exact", **kw) if draft is None else LLM(mode="exact", draft="self", speculation_width=9, **kw)
        assert [o.token_ids for o in llm.generate(prompts, params)] == want, draft
        llm.shutdown()
    vanilla.shutdown()


def test_paper_slots_see_their_own_state():
    """Paper mode's M slot of a position revealed at draft step tau is penalised with the output of
    the leftover and the draft tokens revealed before tau (its row of the temporal mask): zero
    logits come back as minus the penalties of each slot's state, worked out by hand."""
    from simsd.speculative.spec_row import Draft
    from simsd.speculative.verifiers import PaperVerifier, Round
    M, V = 9, 10
    cfg = DecodeConfig(block_length=4, sampling=StepSampling(frequency_penalty=1.0))
    verifier = PaperVerifier(cfg, SpecConfig(mode="paper"), M, 0)
    h = TokenHistory.start([5, 5], 0, 4, M, "cpu").after(torch.tensor([3, 3, 4, 1]))  # earlier output 3, 3, 4, 1
    block = torch.tensor([2, M, M, M])  # position 0 known (leftover: output 2)
    final = torch.tensor([2, 4, 6, 4])
    tau = torch.tensor([10 ** 6, 1, 2, 2])  # position 1 at step 1, positions 2 and 3 at step 2
    draft = Draft([block, final], final, tau, None, 0)
    rnd = Round(block, block.tolist(), 0, 8, draft, 0, layout=torch.arange(4), history=h)
    at = verifier.slots(rnd, torch.zeros(4, V))
    base = torch.zeros(V)
    for t in (3, 3, 4, 1, 2):
        base[t] += 1
    step1 = base.clone()
    step1[4] += 1  # slots of step 2 see position 1's token 4
    for i, counts in ((1, base), (2, step1), (3, step1)):
        want = -counts
        want[M] = -float("inf")
        assert torch.equal(at[i], want), i
