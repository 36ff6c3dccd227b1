"""Drop-in: run a transformers Qwen3/SDAR-architecture model's attention through simsd's op.

    from simsd_kernels.hf_adapter import register
    register()                                    # adds attn_implementation "simsd"
    model.set_attn_implementation("simsd")
    logits = model(input_ids, position_ids=pos, simsd_labels=labels, simsd_mask_mode="paper").logits

What the adapter does, honestly:

* **RoPE.** transformers rotates q and k itself before calling the attention function. The
  adapter calls :func:`simsd_kernels.temporal_attention` with all ``positions = 0``, where the
  rotation is exactly the identity (cos 0 = 1, sin 0 = 0), so HF's rotation is used unchanged
  and the RoPE copy is expressed through HF ``position_ids``. The fused in-kernel RoPE is
  therefore not exercised through this path (simsd's own model calls the op directly).
* **Cache.** HF hands the attention function the concatenation ``[past | new]`` of keys and
  values (``(B, Hkv, Lk, D)``, ``Lk = past + Lq``); the first ``Lk - Lq`` entries are passed as
  the (fully visible) cache, the last ``Lq`` as the new tokens.
* **Mask.** Visibility is defined only by labels: ``simsd_labels (B, Lq, 3) int32`` and
  ``simsd_mask_mode`` passed as model-forward keyword arguments (transformers forwards them to
  the attention function). Without labels the new tokens are causal among themselves
  (``block_causal`` with ``grp = arange(Lq)``). HF's ``attention_mask`` is **ignored** (the
  registered mask function builds none): padded batches and sliding windows are not supported.
* ``simsd_backend`` (default ``"auto"``) selects the simsd backend.
"""
from __future__ import annotations

import torch

from .api import temporal_attention
from .mask_rule import MaskMode

ATTN_IMPLEMENTATION = "simsd"


def _causal_labels(B, Lq, device):
    labels = torch.zeros(B, Lq, 3, dtype=torch.int32, device=device)
    labels[..., 2] = torch.arange(Lq, dtype=torch.int32, device=device)
    return labels


def simsd_attention_forward(module, query, key, value, attention_mask=None, scaling=None,
                            dropout=0.0, sliding_window=None, simsd_labels=None,
                            simsd_mask_mode=None, simsd_backend="auto", **kwargs):
    """transformers attention function (``AttentionInterface`` signature).

    ``query (B, Hq, Lq, D)``, ``key, value (B, Hkv, Lk, D)`` (already rotated, ``Lk >= Lq``,
    past first); returns ``(attn_output (B, Lq, Hq, D), None)``.

    Raises:
        ValueError: dropout in training, a sliding window, ``Lk < Lq``, or labels of the wrong
            shape (and every error of :func:`simsd_kernels.temporal_attention`).
    """
    if dropout:
        raise ValueError("simsd attention: dropout is not supported")
    if sliding_window is not None:
        raise ValueError("simsd attention: sliding-window layers are not supported")
    B, Hq, Lq, D = query.shape
    Lk = key.shape[2]
    if Lk < Lq:
        raise ValueError(f"simsd attention: key length {Lk} < query length {Lq}")
    past = Lk - Lq
    k_all, v_all = key.transpose(1, 2), value.transpose(1, 2)  # (B, Lk, Hkv, D), last dim contiguous
    if simsd_labels is None:
        labels, mode = _causal_labels(B, Lq, query.device), MaskMode.BLOCK_CAUSAL
    else:
        labels, mode = simsd_labels, simsd_mask_mode
        if labels.shape != (B, Lq, 3):
            raise ValueError(f"simsd_labels must be (B={B}, Lq={Lq}, 3), got {tuple(labels.shape)}")
    out = temporal_attention(
        query.transpose(1, 2), k_all[:, past:], v_all[:, past:], k_all[:, :past], v_all[:, :past],
        torch.full((B,), past, dtype=torch.int32, device=query.device), labels,
        torch.zeros(B, Lq, dtype=torch.int64, device=query.device),
        mask_mode=mode, rope_theta=1.0, softmax_scale=scaling, backend=simsd_backend,
    )
    return out, None


def _no_mask(*args, **kwargs):
    # the adapter takes visibility from labels; building HF's dense mask would be wasted work
    return None


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the adapter (and a no-op mask builder) under ``name``; returns ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, simsd_attention_forward)
    AttentionMaskInterface.register(name, _no_mask)
    return name
