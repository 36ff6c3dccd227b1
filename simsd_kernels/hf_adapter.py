"""Drop-in: run a transformers Qwen3/SDAR-architecture model's attention through simsd's op.

    from simsd_kernels.hf_adapter import register
    register()                                    # adds attn_implementation "simsd"
    model = Qwen3ForCausalLM.from_pretrained(path, attn_implementation="simsd")
    model.generate(**tokenizer(texts, padding=True, padding_side="left", return_tensors="pt"))
    logits = model(input_ids, position_ids=pos, simsd_labels=labels, simsd_mask_mode="paper").logits

It computes what transformers' own ``sdpa`` attention computes (``sdpa_attention_forward``),
from the same mask: :func:`register` gives ``"simsd"`` transformers' ``sdpa_mask`` builder, so
the attention function receives exactly the mask SDPA would (None where SDPA relies on
``is_causal``, else a boolean ``(B, 1, Lq, Lk)`` mask: causal or bidirectional, with padding).

* **RoPE.** transformers rotates q and k itself before calling the attention function. The
  adapter calls :func:`simsd_kernels.temporal_attention` with all ``positions = 0``, where the
  rotation is exactly the identity (cos 0 = 1, sin 0 = 0), so HF's rotation is used unchanged
  and the RoPE copy is expressed through HF ``position_ids``. The fused in-kernel RoPE is
  therefore not exercised through this path (simsd's own model calls the op directly).
* **Keys.** HF hands the attention function the keys and values ``(B, Hkv, Lk, D)``; with a
  dynamic cache (or none) they are ``[past | new]``, ``Lk = past + Lq``: the first ``Lk - Lq``
  are passed to the op as the cache, the last ``Lq`` as the new tokens.
* **Mask** (``attention_mask``: None, a boolean mask, or an additive float mask of 0 and
  ``-inf`` / the dtype's minimum; ``(B or 1, 1 or Hq, Lq, Lk)``, the same for every head).
  None: as SDPA, causal when ``is_causal`` (the kwarg, else ``module.is_causal``) and
  ``Lq > 1`` (SDPA's upper-left alignment: query i sees keys ``0..i``), else every key. A mask
  is split per batch row into what the op computes in one call: a set of visible cache entries
  (gathered to the front of the cache, ``cache_seqlens`` = their count) and the valid new
  tokens, causal or bidirectional among themselves (``block_causal`` labels; a masked-out new
  token gets a group no valid query reaches). A query row of another form (a padding token
  that still sees tokens, a static cache's layout, a custom pattern) is computed on its own:
  its visible keys gathered, the last as the new token, the rest as the cache (exact, one
  gather of the row's keys). A row that sees no key is zeros, as in SDPA.
* **simsd labels.** ``simsd_labels (B, Lq, 3) int32`` and ``simsd_mask_mode`` passed as
  model-forward keyword arguments (transformers forwards them to the attention function)
  replace the mask's pattern among the new tokens (the verification masks of
  :mod:`simsd_kernels.mask_rule`); ``attention_mask`` then still decides which cache entries
  exist (padding), and must leave every new token visible to itself.
* ``simsd_backend`` (default ``"auto"``) selects the simsd backend.

Refused with ``ValueError`` naming the problem: dropout (training), sliding-window layers,
``softcap``, a position bias, a float mask with other values (an additive bias), a mask that
differs between heads or does not fit ``(B, Hq, Lq, Lk)``, ``Lk < Lq``; with labels, a mask
that hides a new token or gives query rows different cache entries.
"""
from __future__ import annotations

import torch

from .api import temporal_attention
from .mask_rule import MaskMode

ATTN_IMPLEMENTATION = "simsd"

#: most cache slots (rows x keys) one call of the row-by-row path gathers
_ROW_GATHER_SLOTS = 1 << 16


def _allowed(mask, B, Hq, Lq, Lk):
    """``attention_mask`` as a ``(B, Lq, Lk)`` bool (True: may attend), or None for None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"simsd attention: attention_mask must be a 4-D tensor (B, 1, Lq, Lk) or None, got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    if mask.shape[0] not in (1, B) or mask.shape[1] not in (1, Hq) or tuple(mask.shape[2:]) != (Lq, Lk):
        raise ValueError(f"simsd attention: attention_mask {tuple(mask.shape)} does not fit (B={B}, 1 or Hq={Hq}, "
                         f"Lq={Lq}, Lk={Lk})")
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        hidden = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
        if not bool((allowed | hidden).all()):
            raise ValueError("simsd attention: a float attention_mask must hold only 0 (attend) and -inf or the "
                             "dtype's minimum (masked); other values are an additive bias, which simsd does not "
                             "support")
    else:
        raise ValueError(f"simsd attention: attention_mask must be bool or floating point, got {mask.dtype}")
    if allowed.shape[1] > 1:
        if not bool((allowed == allowed[:, :1]).all()):
            raise ValueError("simsd attention: attention_mask differs between heads; simsd applies one mask to "
                             "every head")
    return allowed[:, 0].expand(B, Lq, Lk)


def _gather_keys(k_all, v_all, visible):
    """Keys/values ``(R, Lk, Hkv, D)`` with each row's visible entries (``visible (R, Lk)``) moved
    to the front in their order; returns ``(k, v, counts (R,) int32)``."""
    order = torch.argsort((~visible).to(torch.int8), dim=1, stable=True)
    idx = order[:, :, None, None].expand(-1, -1, *k_all.shape[2:])
    return k_all.gather(1, idx), v_all.gather(1, idx), visible.sum(1, dtype=torch.int32)


def _group_labels(grp):
    """``block_causal`` labels ``(..., 3)`` int32 with groups ``grp``: a token sees ``grp_j <= grp_i``."""
    labels = torch.zeros(*grp.shape, 3, dtype=torch.int32, device=grp.device)
    labels[..., 2] = grp
    return labels


def _attend(q, k_new, v_new, k_cache, v_cache, seqlens, labels, mode, scaling, backend):
    """The op with HF's rotation kept (all positions 0: RoPE is the identity)."""
    positions = torch.zeros(labels.shape[:2], dtype=torch.int64, device=q.device)
    return temporal_attention(q, k_new, v_new, k_cache, v_cache, seqlens, labels, positions, mask_mode=mode,
                              rope_theta=1.0, softmax_scale=scaling, backend=backend)


def _rows_alone(out, q, k_all, v_all, allowed, rows, scaling, backend):
    """Write into ``out (B, Lq, Hq, D)`` the attention of each query row ``(b, i)`` in ``rows``
    over exactly the keys ``allowed[b, i]`` lets it see (zeros where it sees none)."""
    b, i = rows.unbind(1)
    vis = allowed[b, i]
    counts = vis.sum(1)
    out[b, i] = 0
    keep = counts > 0
    b, i, vis = b[keep], i[keep], vis[keep]
    step = max(1, _ROW_GATHER_SLOTS // max(1, allowed.shape[-1]))
    for s in range(0, b.shape[0], step):
        bs, is_, vs = b[s:s + step], i[s:s + step], vis[s:s + step]
        k, v, n = _gather_keys(k_all[bs], v_all[bs], vs)
        last = (n.long() - 1)[:, None, None, None].expand(-1, 1, *k.shape[2:])
        labels = _group_labels(torch.zeros(bs.shape[0], 1, dtype=torch.int32, device=q.device))
        res = _attend(q[bs, is_][:, None], k.gather(1, last), v.gather(1, last), k, v, n - 1, labels,
                      MaskMode.BLOCK_CAUSAL, scaling, backend)
        out[bs, is_] = res[:, 0]


def _structured(allowed, past, Lq):
    """Fit each batch row to one op call: ``(cache_visible (B, past), valid (B, Lq), causal,
    fits (B, Lq))`` where ``fits[b, i]``: query row ``i`` sees exactly the visible cache and the
    valid new tokens (causal: those up to ``i``)."""
    ar = torch.arange(Lq, device=allowed.device)
    valid = allowed[:, ar, past + ar]  # a new token that sees itself (a padding token does not)
    cache_vis, new_vis = allowed[..., :past], allowed[..., past:]
    cache = (cache_vis | ~valid[..., None]).all(1)  # the cache entries every valid row sees
    same_cache = (cache_vis == cache[:, None]).all(-1) & valid
    full = valid[:, None, :].expand_as(new_vis)
    fits_full = same_cache & (new_vis == full).all(-1)
    fits_causal = same_cache & (new_vis == (full & (ar[None, :] <= ar[:, None]))).all(-1)
    causal = bool(fits_causal.sum() >= fits_full.sum())
    return cache, valid, causal, fits_causal if causal else fits_full


def _checked_labels(labels, allowed, B, Lq, past):
    if labels.shape != (B, Lq, 3):
        raise ValueError(f"simsd_labels must be (B={B}, Lq={Lq}, 3), got {tuple(labels.shape)}")
    if allowed is None:
        return None
    ar = torch.arange(Lq, device=allowed.device)
    if not bool(allowed[:, ar, past + ar].all()):
        raise ValueError("simsd attention: with simsd_labels, attention_mask must leave every new token visible to "
                         "itself (padding among the new tokens is not supported; express it in the labels)")
    cache_vis = allowed[..., :past]
    if not bool((cache_vis == cache_vis[:, :1]).all()):
        raise ValueError("simsd attention: with simsd_labels, attention_mask must give every query row of a batch "
                         "row the same cache entries")
    return cache_vis[:, 0]


def simsd_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                            sliding_window=None, is_causal=None, simsd_labels=None, simsd_mask_mode=None,
                            simsd_backend="auto", **kwargs):
    """transformers attention function (``AttentionInterface`` signature), computing what
    ``sdpa_attention_forward`` computes (module doc).

    ``query (B, Hq, Lq, D)``, ``key, value (B, Hkv, Lk, D)`` (already rotated, ``Lk >= Lq``,
    past first); ``attention_mask`` None or ``(B or 1, 1 or Hq, Lq, Lk)`` bool / additive float;
    returns ``(attn_output (B, Lq, Hq, D), None)``.

    Raises:
        ValueError: dropout in training, a sliding window, ``softcap``, a position bias,
            ``Lk < Lq``, a mask simsd does not apply (an additive bias, one per head, a wrong
            shape), labels of the wrong shape or with a mask that hides new tokens (and every
            error of :func:`simsd_kernels.temporal_attention`).
    """
    if dropout:
        raise ValueError("simsd attention: dropout is not supported")
    if sliding_window is not None:
        raise ValueError("simsd attention: sliding-window layers are not supported")
    for name in ("softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"simsd attention: {name} is not supported")
    B, Hq, Lq, D = query.shape
    Lk = key.shape[2]
    if Lk < Lq:
        raise ValueError(f"simsd attention: key length {Lk} < query length {Lq}")
    allowed = _allowed(attention_mask, B, Hq, Lq, Lk)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if allowed is None and simsd_labels is None and causal and Lq > 1 and Lk > Lq:
        key, value, Lk = key[:, :, :Lq], value[:, :, :Lq], Lq  # SDPA's is_causal: keys 0..i
    past = Lk - Lq
    q = query.transpose(1, 2)
    k_all, v_all = key.transpose(1, 2), value.transpose(1, 2)  # (B, Lk, Hkv, D), last dim contiguous
    dev = query.device
    fits = None
    if simsd_labels is not None:
        cache_vis = _checked_labels(simsd_labels, allowed, B, Lq, past)
        labels, mode = simsd_labels, simsd_mask_mode
    else:
        if allowed is None:
            cache_vis, valid = None, torch.ones(B, Lq, dtype=torch.bool, device=dev)
            causal = causal and Lq > 1
        else:
            cache_vis, valid, causal, fits = _structured(allowed, past, Lq)
        grp = torch.arange(Lq, dtype=torch.int32, device=dev).expand(B, Lq) if causal \
            else torch.zeros(B, Lq, dtype=torch.int32, device=dev)
        labels, mode = _group_labels(torch.where(valid, grp, Lq)), MaskMode.BLOCK_CAUSAL
    k_cache, v_cache = k_all[:, :past], v_all[:, :past]
    seqlens = torch.full((B,), past, dtype=torch.int32, device=dev)
    if cache_vis is not None and not bool(cache_vis.all()):
        k_cache, v_cache, seqlens = _gather_keys(k_cache, v_cache, cache_vis)
    if fits is not None and not bool(fits.any()):  # no row for the one-call form (e.g. a static cache)
        out = q.new_zeros(q.shape)
    else:
        out = _attend(q, k_all[:, past:], v_all[:, past:], k_cache, v_cache, seqlens, labels, mode, scaling,
                      simsd_backend)
    if fits is not None and not bool(fits.all()):
        _rows_alone(out, q, k_all, v_all, allowed, (~fits).nonzero(), scaling, simsd_backend)
    return out, None


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the adapter under ``name`` as an attention implementation, with transformers'
    SDPA mask builder (``sdpa_mask``: the adapter receives the masks SDPA receives); returns
    ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, simsd_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
