"""Log-probabilities (:mod:`simsd.decoding.logprobs`, :mod:`simsd.decoding.prompt_logprobs`) against
independent float64 computations: a generated token's is the log-softmax (MASK excluded) of the
target's logits at its position in the vanilla step that revealed it, recomputed here by an
uncached decoder whose every step re-runs the whole sequence, scored by a float64 copy of the
model; a prompt token's is the chain rule over its block's left-to-right states, recomputed here
with one uncached block-causal forward of the float64 model per token."""
import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint, vanilla_generate
from simsd.decoding.noise import NoiseKey, step_noise
from simsd.decoding.prompt_logprobs import prompt_logprobs
from simsd.decoding.step import denoise_step
from simsd.models.model import labels_for
from tests.helpers import random_checkpoint

V = 128
K = 3


@pytest.fixture(scope="module")
def models():
    path = random_checkpoint("vanilla", tokenizer=False, vocab_size=V)
    return (load_checkpoint(path, with_tokenizer=False),
            load_checkpoint(path, dtype="float64", with_tokenizer=False))


def uncached_logits(model, seq: list, L: int) -> torch.Tensor:
    """Logits ``(len(seq), V)`` of ``seq`` in one uncached block-causal forward (blocks of ``L``)."""
    ids = torch.tensor(seq)[None]
    pos = torch.arange(ids.shape[1])[None]
    return model(ids, pos, labels_for(ids.shape[1], "cpu", grp=pos // L), "block_causal", model.new_cache(1, 0))[0]


def float64_entry(logits64: torch.Tensor, token: int, mask_id: int, k: int) -> tuple:
    lp = logits64.double().clone()
    lp[mask_id] = float("-inf")
    lp = torch.log_softmax(lp, -1)
    top = lp.topk(k)
    return float(lp[token]), int((lp >= lp[token]).sum()), top.indices.tolist(), top.values.tolist()


def reference(m32, m64, prompt, cfg, mask_id):
    """Uncached vanilla decoding (steps decided on the float32 model's logits by simsd's own step,
    as tests/simsd/decoding/test_vanilla.py's cache check), each revealed token scored by the
    float64 model at the state its step saw."""
    L = cfg.block_length
    aligned = len(prompt) // L * L
    seq, tail = list(prompt[:aligned]), list(prompt[aligned:])
    tokens, entries = [], []
    while len(tokens) < cfg.max_new_tokens:
        block = torch.tensor(tail + [mask_id] * (L - len(tail)))
        first, tail, step = L - int((block == mask_id).sum()), [], 0
        scored = [None] * L
        while bool((block == mask_id).any()):
            logits = uncached_logits(m32, seq + block.tolist(), L)[-L:]
            logits64 = uncached_logits(m64, seq + block.tolist(), L)[-L:]
            noise = None
            if not cfg.sampling.greedy:
                noise = step_noise([NoiseKey(cfg.seed, len(seq))], step, L, V, "cpu")[0]
            new, revealed, _ = denoise_step(logits, block, mask_id, cfg, step, noise)
            for i in revealed.nonzero()[:, 0].tolist():
                scored[i] = float64_entry(logits64[i], int(new[i]), mask_id, K)
            block, step = new, step + 1
        seq += block.tolist()
        tokens += block[first:].tolist()
        entries += scored[first:]
    return tokens[:cfg.max_new_tokens], entries[:cfg.max_new_tokens]


def assert_close(got: list, want: list, tokens: list):
    """``got`` (simsd's entries) against ``want`` (float64 entries): log-probabilities within
    float32's error, ranks and the top ids equal (no near-ties at these sizes)."""
    assert len(got) == len(want) == len(tokens)
    for (lp, rank, top), (lp64, rank64, ids64, top64) in zip(got, want):
        assert abs(lp - lp64) < 2e-5 * max(1.0, abs(lp64))
        assert rank == rank64
        assert [t for t, _ in top] == ids64
        assert max(abs(v - w) for (_, v), w in zip(top, top64)) < 2e-5 * max(1.0, abs(top64[-1]))


@pytest.mark.parametrize("strategy", ["sequential", "static", "dynamic", "entropy"])
@pytest.mark.parametrize("T", [0.0, 0.9])
def test_vanilla_logprobs_are_the_revealing_steps(models, strategy, T):
    m32, m64 = (c.model for c in models)
    mask_id = models[0].mask_token_id
    prompt = torch.randint(0, V - 2, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = DecodeConfig(block_length=4, strategy=strategy, max_new_tokens=12, seed=5, logprobs=K,
                       threshold={"dynamic": 0.02, "entropy": 6.0}.get(strategy),
                       sampling=SamplingParams(temperature=T, top_k=50, top_p=0.9))
    got = vanilla_generate(m32, prompt, cfg, mask_id, stop_ids=[])
    tokens, want = reference(m32, m64, prompt, cfg, mask_id)
    assert got.token_ids == tokens
    assert_close(got.logprobs, want, tokens)
    assert all(rank >= 1 for _, rank, _ in got.logprobs)


def test_logprobs_zero_and_off(models):
    m32 = models[0].model
    cfg = DecodeConfig(block_length=4, max_new_tokens=8)
    assert vanilla_generate(m32, [5, 6, 7], cfg, models[0].mask_token_id, []).logprobs is None
    got = vanilla_generate(m32, [5, 6, 7], DecodeConfig(block_length=4, max_new_tokens=8, logprobs=0),
                           models[0].mask_token_id, [])
    assert len(got.logprobs) == 8 and all(top == [] for _, _, top in got.logprobs)
    assert all(rank == 1 for _, rank, _ in got.logprobs)  # greedy: the argmax


@pytest.mark.parametrize("L,n", [(4, 1), (4, 2), (4, 11), (4, 12), (8, 13), (2, 7)])
def test_prompt_logprobs_are_the_chain_rule_over_block_states(models, L, n):
    m32, m64 = (c.model for c in models)
    mask_id = models[0].mask_token_id
    ids = torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n + L)).tolist()
    got = prompt_logprobs(m32, ids, L, mask_id, K)
    assert len(got) == n and got[0] is None
    want = []
    for i in range(1, n):
        b, j = i // L * L, i % L
        state = ids[:i] + [mask_id] * (L - j)  # blocks before committed, the block revealed up to i
        logits64 = uncached_logits(m64, state, L)[b + j]
        want.append(float64_entry(logits64, ids[i], mask_id, K))
    assert_close(got[1:], want, ids[1:])


def test_sequential_decoding_scores_what_the_prompt_chain_rule_scores(models):
    """One reveal order, two paths: greedy ``sequential`` decoding reveals a block left to right,
    so its tokens' log-probabilities are the chain rule's of prompt + output (up to float32
    rounding of different forwards)."""
    m32 = models[0].model
    mask_id = models[0].mask_token_id
    prompt = list(range(3, 14))
    cfg = DecodeConfig(block_length=4, strategy="sequential", max_new_tokens=9, logprobs=2)
    got = vanilla_generate(m32, prompt, cfg, mask_id, [])
    chain = prompt_logprobs(m32, prompt + got.token_ids, 4, mask_id, 2)[len(prompt):]
    for (lp, rank, top), (lp2, rank2, top2) in zip(got.logprobs, chain):
        assert abs(lp - lp2) < 1e-5 and rank == rank2 and [t for t, _ in top] == [t for t, _ in top2]
