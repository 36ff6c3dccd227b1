"""The decoding engine over paged caches: every model's cache in pages of one block, the rows' pages
interleaved over a shared pool (row b owns pages b, B + b, 2B + b, ...: no row's pages are
consecutive), gives the tokens of the contiguous caches (one page per row) -- vanilla and exact
SimSD, greedy and seeded sampling, float32 and bfloat16 -- and exact SimSD over pages gives
vanilla's tokens. The engine itself still builds one region per row (its caches are patched here
through ``SDARForCausalLM.new_cache``): this holds the paged door to the engine's guarantees.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from simsd import DecodeConfig, SamplingParams, load_checkpoint
from simsd.decoding.vanilla import vanilla_generate_batch
from simsd.models.model import SDARForCausalLM
from simsd.speculative import SpecConfig, speculative_generate_batch
from tests.helpers import random_checkpoint

V = 96
BLOCK = 4
PROMPTS = [torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 6)]


def ckpt(name, dtype, layers=2, seed=0, std=0.2):
    path = random_checkpoint(name, tokenizer=False, vocab_size=V, num_hidden_layers=layers, seed=seed, std=std)
    c = load_checkpoint(path, dtype=dtype, with_tokenizer=False)
    c.model.invariant = True
    return dataclasses.replace(c, stop_ids=[])


@pytest.fixture
def interleaved_pages(monkeypatch):
    """Patch the models' caches to pages of one block, taken row by row in turn from a shared pool."""
    made = []
    contiguous = SDARForCausalLM.new_cache

    def paged(self, batch_size, max_len):
        cache = contiguous(self, batch_size, max_len, page_size=BLOCK, num_pages=batch_size * max_len // BLOCK,
                           block_size=BLOCK)
        for j in range(max_len // BLOCK):
            for b in range(batch_size):
                cache.grow(b, (j + 1) * BLOCK)
        made.append(cache)
        return cache
    monkeypatch.setattr(SDARForCausalLM, "new_cache", paged)
    return made


def decode(mode, target, draft, cfg):
    if mode == "vanilla":
        return [r.token_ids for r in vanilla_generate_batch(target.model, PROMPTS, cfg, target.mask_token_id,
                                                            target.stop_ids).results]
    spec = SpecConfig(mode="exact")
    return [r.token_ids for r in speculative_generate_batch(target, draft, PROMPTS, cfg, spec).results]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_caches_give_the_contiguous_tokens_and_exact_equals_vanilla(dtype, temperature, monkeypatch,
                                                                          request):
    target, draft = ckpt("target", dtype), ckpt("target", dtype, std=0.22)
    sampling = SamplingParams(temperature=temperature) if temperature else SamplingParams()
    cfg = DecodeConfig(block_length=BLOCK, strategy="static", max_new_tokens=12, seed=3, sampling=sampling)
    want = {m: decode(m, target, draft, cfg) for m in ("vanilla", "exact")}
    made = request.getfixturevalue("interleaved_pages")
    got = {m: decode(m, target, draft, cfg) for m in ("vanilla", "exact")}
    assert made and all(c.page_size == BLOCK and c.block_table.shape[1] > 1 for c in made)
    table = made[0].block_table
    assert int(table[0, 1] - table[0, 0]) == table.shape[0]  # interleaved: a row's pages are not consecutive
    assert got == want
    assert got["exact"] == got["vanilla"]
