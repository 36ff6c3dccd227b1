"""tools/bd_objective.py, the bundled pair's training objective: its forward over ``[x_t | x_0]``
gives the inference path's logits (a block-causal prefill then a bidirectional denoise step), so
what the tools train is what simsd decodes; and every parameter gets a gradient (the q/k norms
included: the model's fused norm weight is a detached copy)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bd_objective

        import train_tiny_sdar
        yield bd_objective, train_tiny_sdar
    finally:
        sys.path.remove(str(ROOT / "tools"))


def test_training_forward_is_the_inference_forward(tools):
    from simsd import load_checkpoint
    _, T = tools
    ck = load_checkpoint(ROOT / "simsd" / "assets" / "tiny-sdar-target", dtype="float32")
    rel = T.check_against_inference(ck.model, ck.config.vocab_size - 1, ck.config.block_size, ck.mask_token_id)
    assert rel < 1e-5


def test_every_parameter_gets_a_gradient(tools):
    from simsd import load_checkpoint
    O, _ = tools
    ck = load_checkpoint(ROOT / "simsd" / "assets" / "tiny-sdar-draft", dtype="float32")
    B = ck.config.block_size
    x0 = torch.randint(0, ck.config.vocab_size - 1, (2, 4 * B), generator=torch.Generator().manual_seed(0))
    model = ck.model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    O.bd_loss(model, x0, B, ck.mask_token_id, O.bd_mask(4 * B, B), torch.Generator().manual_seed(0)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
