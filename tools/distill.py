"""Distillation stage of ``tools/train_tiny_sdar.py``: pull the draft toward the target.

    python tools/train_tiny_sdar.py train --model draft --init-from simsd/assets/tiny-sdar-draft \\
        --teacher simsd/assets/tiny-sdar-target --kd-weight 1.0 --ce-weight 0.0 ...

The student reads the same block-diffusion input ``[x_t | x_0]`` under the same mask as in
training (:func:`bd_objective.train_forward`); the teacher is run on the identical input in
float32 under ``no_grad``. Loss at the masked positions of ``x_t``::

    kd_weight * mean_masked KL(teacher || student) + ce_weight * (the 1/t-weighted CE of training)

KL is over the whole vocabulary at temperature 1. The noise draw is shared, so the run is
deterministic given ``--seed`` (and the thread count), like the training stage.
"""
from __future__ import annotations

import bd_objective as O
import torch
import torch.nn.functional as F


def load_teacher(path) -> torch.nn.Module:
    """The teacher in float32, frozen, eval mode."""
    from simsd.models.loading import load_checkpoint

    teacher = load_checkpoint(path, dtype="float32").model
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def kd_terms(student, teacher, x0, B, mask_id, mask, g) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean KL(teacher || student), 1/t-weighted CE)`` at the masked positions of one noise draw."""
    xt, masked, w = O.noise(x0, B, mask_id, g)
    with torch.no_grad():
        t_logp = F.log_softmax(O.train_forward(teacher, xt, x0, mask, select=masked).float(), dim=-1)
    s_logp = F.log_softmax(O.train_forward(student, xt, x0, mask, select=masked), dim=-1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
    ce = (F.nll_loss(s_logp, x0[masked], reduction="none") * w[masked]).sum() / x0.numel()
    return kl, ce


def kd_loss(student, teacher, x0, B, mask_id, mask, g, kd_weight: float, ce_weight: float) -> torch.Tensor:
    kl, ce = kd_terms(student, teacher, x0, B, mask_id, mask, g)
    return kd_weight * kl + ce_weight * ce


@torch.no_grad()
def heldout_kl(student, teacher, windows, B, mask_id, seed=1234, bs=16) -> float:
    """Mean masked-position KL(teacher || student) on fixed windows with the held-out noise seed."""
    g = torch.Generator().manual_seed(seed)
    mask = O.bd_mask(windows.shape[1], B)
    tot = 0.0
    for i in range(0, len(windows), bs):
        x0 = windows[i:i + bs]
        tot += float(kd_terms(student, teacher, x0, B, mask_id, mask, g)[0]) * x0.shape[0]
    return tot / len(windows)
