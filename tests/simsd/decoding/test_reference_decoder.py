"""Vanilla decoding held to an independent reference (tests/reference_decoder.py).

The reference shares no decoding code with simsd: its own schedule, confidence, strategies and
stop handling, float64, transformers' Qwen3 forward recomputing the whole sequence at every
step. Greedy tokens must be identical across strategies, block lengths, step counts (several
tokens per step), prompt tails, folded commits and stop ids.
"""
import pytest
import torch

from simsd import DecodeConfig, load_checkpoint, vanilla_generate
from simsd.models.model import labels_for
from tests.helpers import random_checkpoint
from tests.reference_decoder import ReferenceModel, choose, reference_generate, schedule

V = 96
#: thresholds that give a mix of one-token and many-token steps on this model
THRESHOLD = {"dynamic": 0.7, "entropy": 1.0}
PROMPT_LENGTHS = (8, 9, 11, 13)  # tails of 0, 1, 3, 5 tokens for B = 8


def prompt_of(n: int) -> list:
    return torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.fixture(scope="module")
def path():
    return random_checkpoint("reference", tokenizer=False, vocab_size=V, num_hidden_layers=2, std=0.5)


@pytest.fixture(scope="module")
def ref(path):
    return ReferenceModel(path)


@pytest.fixture(scope="module")
def ck(path):
    return load_checkpoint(path, dtype="float64", with_tokenizer=False)


def test_reference_reads_the_same_model(ref, ck):
    """The reference's forward (transformers, float64) equals simsd's model on the same files
    (simsd returns float32 logits: agreement to float32 rounding)."""
    assert ref.mask_id == ck.mask_token_id and ref.stop_ids == ck.stop_ids
    ids = prompt_of(13)
    pos = torch.arange(13)[None]
    got = ck.model(torch.tensor([ids]), pos, labels_for(13, "cpu", grp=pos // 4), "block_causal",
                   ck.model.new_cache(1, 0))[0].double()
    want = ref.logits(ids, lambda i, j: j // 4 <= i // 4)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_reference_rules_by_hand():
    assert schedule(8, 3) == [3, 3, 2] and schedule(8, 5) == [2, 2, 2, 1, 1] and schedule(4, 4) == [1] * 4
    masked = [True, True, False, True]
    conf, ent = [0.2, 0.6, 0.99, 0.6], [1.0, 0.5, 0.0, 0.4]
    assert choose("sequential", masked, conf, ent, 2, None) == [0, 1]
    assert choose("static", masked, conf, ent, 1, None) == [1]  # tie 0.6/0.6: the lower position
    assert choose("dynamic", masked, conf, ent, 1, 0.5) == [1, 3]
    assert choose("dynamic", masked, conf, ent, 3, 0.5) == [0, 1, 3]
    assert choose("entropy", masked, conf, ent, 1, 0.9) == [1, 3]
    assert choose("entropy", masked, conf, ent, 1, 0.1) == [3]


@pytest.mark.parametrize("strategy", ["sequential", "static", "dynamic", "entropy"])
@pytest.mark.parametrize("B,steps", [(4, 4), (4, 2), (4, 3), (8, 4), (8, 3), (8, 5)])
def test_vanilla_equals_reference(ck, ref, strategy, B, steps):
    sizes = []
    for n, fold in zip(PROMPT_LENGTHS, (False, True, False, True)):
        prompt = prompt_of(n)
        want = reference_generate(ref, prompt, block_length=B, steps=steps, strategy=strategy,
                                  threshold=THRESHOLD.get(strategy), max_new_tokens=2 * B + 3, stop_ids=[])
        cfg = DecodeConfig(block_length=B, steps=steps, strategy=strategy, threshold=THRESHOLD.get(strategy),
                           max_new_tokens=2 * B + 3, fold_commit=fold)
        got = vanilla_generate(ck.model, prompt, cfg, ck.mask_token_id, [])
        assert got.token_ids == want.token_ids, (n, fold)
        sizes += want.step_sizes()
    if steps < B or strategy in THRESHOLD:
        assert max(sizes) > 1  # the case has steps that reveal several tokens


@pytest.mark.parametrize("strategy", ["dynamic", "entropy"])
def test_default_thresholds_equal_reference(ck, ref, strategy):
    """No threshold given: the documented defaults (0.9 and 0.35 nats, docs/design.md §3.5)."""
    for n in (8, 11):
        prompt = prompt_of(n)
        want = reference_generate(ref, prompt, block_length=8, steps=4, strategy=strategy, max_new_tokens=24,
                                  stop_ids=[])
        cfg = DecodeConfig(block_length=8, steps=4, strategy=strategy, max_new_tokens=24)
        assert vanilla_generate(ck.model, prompt, cfg, ck.mask_token_id, []).token_ids == want.token_ids


def test_stop_ids_equal_reference(ck, ref):
    """Several stop ids; a stop id that is the first token of a block, the last token of a
    block, or in the middle: decoding ends after that block and the ids end at the stop."""
    B, prompt = 4, prompt_of(9)  # a 1-token tail: the first block generates 3 tokens
    free = reference_generate(ref, prompt, block_length=B, strategy="static", max_new_tokens=24, stop_ids=[])
    ids = free.token_ids
    fresh = [g for g in range(len(ids)) if ids.index(ids[g]) == g]  # first occurrences
    where = {"first of a block": lambda g: g >= 3 and (g - 3) % B == 0,
             "last of a block": lambda g: (g - 3) % B == B - 1,
             "middle": lambda g: (g - 3) % B in (1, 2)}
    cases = {name: ids[next(g for g in fresh if at(g))] for name, at in where.items()}
    for name, stop in cases.items():
        for stops in ([stop], [V - 3, stop], [stop, ids[20]]):
            want = reference_generate(ref, prompt, block_length=B, strategy="static", max_new_tokens=24,
                                      stop_ids=stops)
            got = vanilla_generate(ck.model, prompt, DecodeConfig(block_length=B, max_new_tokens=24),
                                   ck.mask_token_id, stops)
            assert got.token_ids == want.token_ids, (name, stops)
            assert got.token_ids[-1] in stops and len(got.token_ids) < 24
            first = min(ids.index(s) for s in stops if s in ids)
            assert got.token_ids == ids[:first + 1]
            assert got.stats["blocks"] == (1 if first < 3 else 2 + (first - 3) // B)  # 3 tokens, then 4 per block
