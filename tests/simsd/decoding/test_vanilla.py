"""Vanilla SDAR block decoding: cache equivalence, stops, sampling reproducibility."""
import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint, vanilla_generate
from simsd.decoding.noise import NoiseKey, step_noise
from simsd.decoding.step import denoise_step
from simsd.models.model import labels_for
from tests.helpers import random_checkpoint


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(random_checkpoint("vanilla", tokenizer=False, vocab_size=128), with_tokenizer=False)


def uncached_generate(model, prompt, cfg, mask_id, stop_ids):
    """Cache equivalence: every step recomputes the whole sequence with the full block-causal
    mask (token i sees j iff j // B <= i // B) and applies simsd's own step. The step rules
    themselves are held to the independent decoder in test_reference_decoder.py."""
    B = cfg.block_length
    seq = list(prompt)
    aligned = (len(prompt) // B) * B
    tail = seq[aligned:]
    seq = seq[:aligned]
    generated = []
    while True:
        block = torch.tensor(list(tail) + [mask_id] * (B - len(tail)))
        first, tail, step = B - int((block == mask_id).sum()), [], 0
        while bool((block == mask_id).any()):
            ids = torch.tensor(seq + block.tolist())[None]
            pos = torch.arange(ids.shape[1])[None]
            logits = model(ids, pos, labels_for(ids.shape[1], "cpu", grp=pos // B), "block_causal",
                           model.new_cache(1, 0))[0, -B:]
            noise = None
            if not cfg.sampling.greedy:  # the keyed noise of the block at len(seq), this step
                noise = step_noise([NoiseKey(cfg.seed, len(seq))], step, B, logits.shape[-1], "cpu")[0]
            block, _, _ = denoise_step(logits, block, mask_id, cfg, step, noise)
            step += 1
        seq += block.tolist()
        generated += block[first:].tolist()
        if set(stop_ids) & set(block[first:].tolist()) or len(generated) >= cfg.max_new_tokens:
            break
    return generated


@pytest.mark.parametrize("strategy", ["sequential", "static", "dynamic", "entropy"])
@pytest.mark.parametrize("prompt_len", [8, 11])
@pytest.mark.parametrize("fold", [False, True])
def test_cached_equals_uncached(ckpt, strategy, prompt_len, fold):
    torch.manual_seed(prompt_len)
    prompt = torch.randint(0, 120, (prompt_len,)).tolist()
    cfg = DecodeConfig(block_length=4, strategy=strategy, max_new_tokens=24, fold_commit=fold,
                       threshold={"dynamic": 0.02, "entropy": 6.0}.get(strategy))
    got = vanilla_generate(ckpt.model, prompt, cfg, ckpt.mask_token_id, stop_ids=[])
    ref = uncached_generate(ckpt.model, prompt, cfg, ckpt.mask_token_id, [])
    assert got.token_ids == ref[:24]
    assert got.stats["new_tokens"] == 24


@pytest.mark.parametrize("block_length,steps", [(8, 4), (8, 3), (4, 2)])
def test_cached_equals_uncached_multi_token_steps(ckpt, block_length, steps):
    prompt = list(range(3, 16))  # 13 tokens: a prompt tail inside the first block
    cfg = DecodeConfig(block_length=block_length, steps=steps, strategy="static", max_new_tokens=20)
    got = vanilla_generate(ckpt.model, prompt, cfg, ckpt.mask_token_id, stop_ids=[])
    assert got.token_ids == uncached_generate(ckpt.model, prompt, cfg, ckpt.mask_token_id, [])[:20]


def test_forward_counts_static_b4(ckpt):
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=16)
    r = vanilla_generate(ckpt.model, list(range(8)), cfg, ckpt.mask_token_id, stop_ids=[])
    # 4 blocks x 4 denoise forwards + 3 commits (the last block's K/V is never read)
    assert r.stats["target_forwards"] == 19
    assert r.stats["prefill_forwards"] == 1


def test_stop_in_middle_of_block(ckpt):
    prompt = list(range(8))
    cfg = DecodeConfig(block_length=4, strategy="sequential", max_new_tokens=40)
    free = vanilla_generate(ckpt.model, prompt, cfg, ckpt.mask_token_id, stop_ids=[])
    # choose as stop id the token generated at a position in the middle of the 3rd block
    stop = free.token_ids[9]
    first = free.token_ids.index(stop)
    r = vanilla_generate(ckpt.model, prompt, cfg, ckpt.mask_token_id, stop_ids=[stop])
    assert r.token_ids == free.token_ids[: first + 1]
    assert r.token_ids[-1] == stop and r.stats["new_tokens"] == first + 1
    # decoding stopped after the block holding the stop id
    assert r.stats["blocks"] == first // 4 + 1


def test_max_new_tokens_cut(ckpt):
    cfg = DecodeConfig(block_length=4, max_new_tokens=6)
    r = vanilla_generate(ckpt.model, list(range(8)), cfg, ckpt.mask_token_id, stop_ids=[])
    assert len(r.token_ids) == 6 and r.stats["blocks"] == 2


def test_seeded_sampling_reproducible(ckpt):
    prompt = list(range(5, 15))
    cfg = lambda seed: DecodeConfig(block_length=4, max_new_tokens=16, seed=seed,  # noqa: E731
                                    sampling=SamplingParams(temperature=1.0, top_k=50, top_p=0.9))
    a = vanilla_generate(ckpt.model, prompt, cfg(7), ckpt.mask_token_id, [])
    b = vanilla_generate(ckpt.model, prompt, cfg(7), ckpt.mask_token_id, [])
    c = vanilla_generate(ckpt.model, prompt, cfg(8), ckpt.mask_token_id, [])
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_bad_prompts(ckpt):
    cfg = DecodeConfig(max_new_tokens=4)
    V = ckpt.config.vocab_size
    for bad in (500, V, -1):  # far out, the first id past the vocabulary, below it
        with pytest.raises(ValueError, match=r"outside the vocabulary \[0, "):
            vanilla_generate(ckpt.model, [1, bad], cfg, ckpt.mask_token_id, [])
    with pytest.raises(ValueError, match="empty"):
        vanilla_generate(ckpt.model, [], cfg, ckpt.mask_token_id, [])
    with pytest.raises(ValueError, match="maximum length"):
        vanilla_generate(ckpt.model, [1] * 5000, cfg, ckpt.mask_token_id, [])


def test_triton_backend_decodes_like_torch(ckpt):
    """Greedy decoding with the (interpreted on CPU) Triton kernels equals the torch backend."""
    pytest.importorskip("triton")
    from simsd_kernels.backends import resolve_backend
    try:
        resolve_backend("triton", ckpt.model.device)
    except ValueError as exc:
        pytest.skip(str(exc))
    prompt = list(range(3, 14))
    cfg = DecodeConfig(block_length=4, strategy="static", max_new_tokens=8)
    ckpt.model.attention_backend = "torch"
    want = vanilla_generate(ckpt.model, prompt, cfg, ckpt.mask_token_id, [])
    try:
        ckpt.model.attention_backend = "triton"
        got = vanilla_generate(ckpt.model, prompt, cfg, ckpt.mask_token_id, [])
    finally:
        ckpt.model.attention_backend = "auto"
    assert got.token_ids == want.token_ids
