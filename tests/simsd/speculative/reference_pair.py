"""The random pair the reference-decoder tests share (tests/reference_decoder.py holds them to
an independent implementation): a 2-layer target and a 1-layer draft of another seed, so most
draft steps fail and every verdict path runs; vocabulary V with no tokenizer."""
from __future__ import annotations

import torch

from tests.helpers import random_checkpoint

V = 96
#: thresholds that give both multi- and single-token steps on this pair
THRESHOLD = {"dynamic": 0.7, "entropy": 1.0}


def prompt_of(n: int) -> list:
    """A prompt of ``n`` ids (below the mask id), the same for the same ``n``."""
    return torch.randint(0, V - 2, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def reference_pair_paths() -> tuple:
    """``(target_dir, draft_dir)`` of the shared random pair (built once per session)."""
    target = random_checkpoint("reference", tokenizer=False, vocab_size=V, num_hidden_layers=2, std=0.5)
    draft = random_checkpoint("reference-draft", tokenizer=False, vocab_size=V, num_hidden_layers=1, std=0.5,
                              seed=7)
    return target, draft
