"""A decoder that makes no progress fails with a clear error instead of spinning.

A denoising step that reveals no position (for example one that "reveals" the MASK token), a
SimSD round that commits no token, or a row program that never finishes raise RuntimeError;
the per-test timeout (pytest-timeout, pyproject.toml) is the last resort.
"""
import dataclasses

import pytest
import torch

from simsd import DecodeConfig, load_checkpoint, vanilla_generate
from simsd.decoding.layouts import RowLayouts
from simsd.engine.batching import BatchEngine
from simsd.engine.scheduler import Request, run_requests
from simsd.speculative import SpecConfig, speculative_generate
from tests.helpers import random_checkpoint

V = 64


class PrefersMask(torch.nn.Module):
    """A model whose MASK logit beats every other token by far (a step must still never
    reveal MASK)."""

    def __init__(self, model, mask_id):
        super().__init__()
        self.inner, self.mask_id = model, mask_id
        self.config = model.config

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if out is not None:
            out = out.clone()
            out[..., self.mask_id] += 1e4
        return out


@pytest.fixture(scope="module")
def ck():
    return load_checkpoint(random_checkpoint("progress", tokenizer=False, vocab_size=V), with_tokenizer=False)


@pytest.mark.parametrize("strategy", ["sequential", "static", "dynamic", "entropy"])
def test_mask_logit_is_never_revealed(ck, strategy):
    model = PrefersMask(ck.model, ck.mask_token_id)
    cfg = DecodeConfig(block_length=4, strategy=strategy, max_new_tokens=8)
    r = vanilla_generate(model, list(range(1, 7)), cfg, ck.mask_token_id, [])
    assert len(r.token_ids) == 8 and ck.mask_token_id not in r.token_ids


@pytest.mark.parametrize("mode", ["exact", "paper"])
def test_speculative_mask_logit_is_never_revealed(ck, mode):
    m = dataclasses.replace(ck, model=PrefersMask(ck.model, ck.mask_token_id))
    cfg = DecodeConfig(block_length=4, max_new_tokens=8)
    r = speculative_generate(m, m, list(range(1, 7)), cfg, SpecConfig(mode=mode))
    assert len(r.token_ids) == 8 and ck.mask_token_id not in r.token_ids


def test_a_step_that_reveals_nothing_raises(ck, monkeypatch):
    """Forgetting to remove the MASK logit: the step 'reveals' MASK and nothing changes."""
    import simsd.decoding.step as step
    monkeypatch.setattr(step, "without_mask_token_", lambda logits, mask_id: logits)
    model = PrefersMask(ck.model, ck.mask_token_id)
    with pytest.raises(RuntimeError, match="revealed no position"):
        vanilla_generate(model, list(range(1, 7)), DecodeConfig(max_new_tokens=8), ck.mask_token_id, [])


@pytest.mark.parametrize("mode", ["exact", "paper"])
def test_a_round_that_commits_nothing_raises(ck, monkeypatch, mode):
    from simsd.speculative.verifiers import VERIFIERS
    verifier = VERIFIERS[mode]
    original = verifier.judge

    def nothing_committed(self, rnd, out):
        return original(self, rnd, out)._replace(block=rnd.block)

    monkeypatch.setattr(verifier, "judge", nothing_committed)
    with pytest.raises(RuntimeError, match="committed no token"):
        speculative_generate(ck, ck, list(range(1, 7)), DecodeConfig(max_new_tokens=8), SpecConfig(mode=mode))


def test_scheduler_stops_a_program_that_never_finishes(ck):
    engine = BatchEngine({"target": ck.model}, 4, 1, capacity=16, margin=8)

    def forever(row, tail):
        block, layouts = torch.full((4,), ck.mask_token_id), RowLayouts(row)
        while True:
            yield layouts.denoise("target", block)

    req = Request([1, 2, 3], forever, capacity=16)
    with pytest.raises(RuntimeError, match="without finishing"):
        run_requests(engine, [req])
    assert req.forward_requests == engine.max_requests() + 1
