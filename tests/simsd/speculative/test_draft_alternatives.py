"""Alternatives beside a draft model's steps (exact mode with ``speculation_width`` past the
draft's chain, :mod:`simsd.speculative.spec_row`): each drafted step's other outcomes on the same
draft logits and noise (:func:`simsd.speculative.tree.step_candidates` around the step taken)
are leaves of the round's tree. The tokens stay vanilla decoding's (greedy and sampled, every
strategy, float32 and bfloat16, batches) and, with a draft that agrees often, the alternatives
take steps the chain misses: fewer target forwards."""
import pytest
import torch

from simsd import DecodeConfig, SamplingParams
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.speculative import SpecConfig, speculative_generate, speculative_generate_batch
from simsd.speculative.spec_row import Draft
from tests.simsd.speculative.test_exact_sampling import PROMPTS, THRESHOLD, bundled_pair, ckpt, vanilla_ids

WIDE = 25  # gamma 4: a chain of 4 copies and the bonus, 5 alternatives beside each step


@pytest.fixture(scope="module")
def models():
    return {"target": ckpt("target"), "tiny": ckpt("poor-draft", layers=1, seed=11), "near": ckpt("target", std=0.22)}


def cfg_for(strategy, T, seed):
    top = dict(top_k=40, top_p=0.95) if T else {}
    return DecodeConfig(block_length=4, strategy=strategy, threshold=THRESHOLD.get(strategy), max_new_tokens=20,
                        seed=seed, sampling=SamplingParams(temperature=T, **top))


@pytest.mark.parametrize("T", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("strategy", ["static", "sequential", "dynamic", "entropy"])
def test_alternatives_keep_vanillas_tokens(models, strategy, T):
    """Every width (one alternative, all five) and both drafts give vanilla's tokens; with the
    draft that agrees often the alternatives save target forwards over the chain (static and
    sequential, where they apply; the other strategies keep the chain)."""
    target = models["target"]
    forwards = {}
    for draft in ("tiny", "near"):
        for width in ("auto", 9, WIDE):
            for i, prompt in enumerate(PROMPTS):
                cfg = cfg_for(strategy, T, i)
                got = speculative_generate(target, models[draft], prompt, cfg,
                                           SpecConfig(mode="exact", speculation_width=width))
                assert got.token_ids == vanilla_ids(target, prompt, cfg), (draft, width, i)
                key = (draft, width)
                forwards[key] = forwards.get(key, 0) + got.stats["target_forwards"]
    if strategy in ("static", "sequential"):
        assert forwards[("near", WIDE)] < forwards[("near", "auto")], forwards
    else:
        assert forwards[("near", WIDE)] == forwards[("near", "auto")], forwards


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_alternatives_on_the_bundled_pair_in_bfloat16(T):
    """The bundled pair in bfloat16 (the GPU default), a batch of three prompts: vanilla's tokens,
    fewer target forwards than the chain."""
    from simsd.entrypoints.prompts import load_prompts
    target, draft = bundled_pair("bfloat16")
    tok = target.tokenizer
    prompts = [tok(p.text, add_special_tokens=False)["input_ids"] for p in load_prompts("bundled")[:3]]
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=24, seed=7,
                       sampling=SamplingParams(temperature=T, top_p=0.9 if T else 1.0))
    want = vanilla_generate_batch(target.model, prompts, cfg, target.mask_token_id, target.stop_ids)
    runs = {w: speculative_generate_batch(target, draft, prompts, cfg, SpecConfig(mode="exact", speculation_width=w))
            for w in ("auto", WIDE)}
    for got in runs.values():
        assert [r.token_ids for r in got.results] == [r.token_ids for r in want.results]
    spent = {w: sum(r.stats["target_forwards"] for r in got.results) for w, got in runs.items()}
    assert spent[WIDE] < spent["auto"], spent


def test_a_drafts_tree_by_hand():
    """A chain of two steps with alternatives: the chain's nodes first (root, step 1, the final
    state), then each step's alternatives as leaves of the state before it, with their kinds;
    a step beside which none applied adds nothing; a leaf has a copy when its chain sibling does."""
    s = [torch.tensor([9, 9, 9, 9]), torch.tensor([1, 9, 9, 9])]
    final = torch.tensor([1, 2, 9, 9])
    alts = [([torch.tensor([9, 3, 9, 9]), torch.tensor([4, 9, 9, 9])], [1, 2]), ([], [])]
    draft = Draft(s, final, torch.tensor([1, 2, 99, 99]), None, 2, final, alts)
    tree = draft.tree()
    assert tree.parent == [-1, 0, 1, 0, 0] and tree.depth == [0, 1, 2, 1, 1]
    assert tree.copies == [True, True, True, True, True] and tree.kind == [0, 0, 0, 1, 2]
    assert tree.states[3].tolist() == [9, 3, 9, 9] and tree.states[4].tolist() == [4, 9, 9, 9]
    last = Draft(s, torch.tensor([1, 2, 5, 6]), torch.tensor([1, 2, 3, 4]), None, 0, None,
                 [([], []), ([torch.tensor([1, 7, 9, 9])], [2])]).tree()
    assert last.parent == [-1, 0, 1, 1] and last.copies == [True, True, False, False]  # both fill the block
    assert Draft(s, final, torch.tensor([1, 2, 99, 99]), None, 2).tree().kind is None  # a plain chain
