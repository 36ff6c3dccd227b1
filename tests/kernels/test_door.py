"""The attention door (``simsd_kernels.prepare_attention`` / ``AttentionMetadata.forward``).

* its write + attend equals the single-call ops ``temporal_attention`` + ``append_kv`` of all new
  tokens, on every backend that runs here (torch; Triton under the interpreter; CUDA on a GPU);
* rows without ``Lq`` free slots: the slots past the capacity are skipped, the attention is the same;
* the torch backend takes SDPA's fast paths: one unmasked call per run of equal-length rows in
  ``bidirectional``, one masked call in ``paper``, per-group calls over exactly the visible keys in
  ``exact`` and ``block_causal``; its plan (host read, RoPE tables, mask) is made once per forward;
* inputs are validated and named once per forward; the per-layer call only compares shapes;
* the door's cache write alone (``append_kv``) writes exactly the first ``num_tokens`` tokens, rotated,
  on every backend; bad write arguments are named.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import simsd_kernels as sk
from simsd_kernels import MaskMode, torch_backend
from simsd_kernels.custom_ops import attention_with_kvcache_op
from tests.kernels.helpers import available_backends, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
THETA = 1e6


def _prepare(args, mode, backend, **kw):
    q, k, v, kc, vc, lens, labels, pos = args
    return sk.prepare_attention(lens, labels, pos, num_heads=q.shape[2], num_kv_heads=k.shape[2], head_dim=q.shape[3],
                                dtype=q.dtype, cache_capacity=kc.shape[1], mask_mode=mode, rope_theta=THETA,
                                backend=backend, **kw)


def _nan_caches(args):
    q, k, v, kc, vc, lens = args[:6]
    unread = torch.arange(kc.shape[1], device=kc.device)[None] >= lens[:, None]
    return kc.masked_fill(unread[..., None, None], float("nan")), vc.masked_fill(unread[..., None, None], float("nan"))


def _door_vs_single_calls(backend, mode, dtype, cache_lens, lmax, Lq=7, seed=0):
    args = [a.to(DEVICE) for a in make_inputs(seed, len(cache_lens), Lq, 4, 2, 64, cache_lens, dtype=dtype,
                                              lmax=lmax)]
    q, k, v, _, _, lens, labels, pos = args
    kc, vc = _nan_caches(args)
    want = sk.temporal_attention(q, k, v, kc, vc, lens, labels, pos, mask_mode=mode, rope_theta=THETA, backend=backend)
    want_k, want_v = kc.clone(), vc.clone()
    sk.append_kv(k, v, pos, want_k, want_v, lens, rope_theta=THETA, backend=backend)
    got = _prepare(args, mode, backend).forward(q, k, v, kc, vc)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), (backend, mode, dtype, (got.double() - want.double()).abs().max())
    assert torch.equal(kc.isnan(), want_k.isnan()) and torch.equal(vc.isnan(), want_v.isnan())
    assert torch.equal(kc.nan_to_num(), want_k.nan_to_num()) and torch.equal(vc.nan_to_num(), want_v.nan_to_num())
    assert torch.equal(lens, args[5]), "the door does not advance cache_seqlens"


@pytest.mark.parametrize("backend", available_backends(DEVICE))
@pytest.mark.parametrize("mode", list(MaskMode))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_door_equals_temporal_attention_then_append_kv(backend, mode, dtype):
    """The same output and the same cache, bit for bit (rows of 0, 5 and 40 cached tokens)."""
    _door_vs_single_calls(backend, mode, dtype, [0, 5, 40], 64)


@pytest.mark.parametrize("backend", available_backends(DEVICE))
@pytest.mark.parametrize("mode", [MaskMode.BIDIRECTIONAL, MaskMode.EXACT, MaskMode.PAPER])
def test_rows_without_room_skip_the_slots_past_the_capacity(backend, mode):
    """Capacity 44: the row at 40 has 4 free slots for 7 new tokens, the row at 44 none."""
    _door_vs_single_calls(backend, mode, torch.float32, [3, 40, 44], 44)


@pytest.mark.parametrize("backend", available_backends(DEVICE))
def test_attend_does_not_write(backend):
    args = [a.to(DEVICE) for a in make_inputs(2, 2, 5, 4, 2, 64, [3, 9], lmax=16)]
    q, k, v, kc, vc, lens, labels, pos = args
    before_k, before_v = kc.clone(), vc.clone()
    out = _prepare(args, "exact", backend).attend(q, k, v, kc, vc)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)
    assert torch.equal(out.contiguous(), sk.temporal_attention(*args, mask_mode="exact", rope_theta=THETA,
                                                               backend=backend))


def _recorded_sdpa(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), attn_mask is not None, kw.get("enable_gqa")))
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention", sdpa)
    return calls


def test_torch_bidirectional_is_one_unmasked_call_per_run_of_equal_rows(monkeypatch):
    """Rows 0 and 1 share a cache length (one call over the cache views [0, 12 + 4)), row 2 not."""
    args = make_inputs(3, 3, 4, 4, 2, 64, [12, 12, 30], lmax=40)
    q, k, v, kc, vc = args[:5]
    meta = _prepare(args, "bidirectional", "torch")
    calls = _recorded_sdpa(monkeypatch)
    meta.forward(q, k, v, kc, vc)
    assert calls == [((2, 4, 4, 64), (2, 2, 16, 64), False, True), ((1, 4, 4, 64), (1, 2, 34, 64), False, True)]


def test_torch_paper_is_one_masked_call_and_exact_one_call_per_copy(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    args = make_inputs(4, 1, 10, 4, 2, 64, [20], lmax=40)
    q, k, v, kc, vc, lens, labels, pos = args
    from simsd_kernels.selfcheck import case_labels
    calls = _recorded_sdpa(monkeypatch)
    paper, _ = case_labels(MaskMode.PAPER, 1, 10, gen)
    _prepare([q, k, v, kc, vc, lens, paper, pos], "paper", "torch").forward(q, k, v, kc, vc)
    assert [c[2] for c in calls] == [True]
    calls.clear()
    exact, _ = case_labels(MaskMode.EXACT, 1, 10, gen)  # a shared prefix of 2, then copies of 4 tokens
    _prepare([q, k, v, kc, vc, lens, exact, pos], "exact", "torch").forward(q, k, v, kc, vc)
    # the prefix over the cache and itself; each copy over the cache, the prefix, its ancestor copy 0
    # (a tree's finished block) and itself; no mask
    assert [(c[0][2], c[1][2], c[2]) for c in calls] == [(2, 22, False), (4, 26, False), (4, 30, False)]


def test_torch_plan_is_made_once_per_forward(monkeypatch):
    """RoPE tables and the host read of the cache lengths: once in prepare_attention, none per layer."""
    args = make_inputs(5, 2, 6, 4, 2, 64, [3, 9], lmax=20)
    q, k, v, kc, vc, lens = args[:6]
    tables, reads = [], []
    real_tables = torch_backend.rope_tables
    monkeypatch.setattr(torch_backend, "rope_tables", lambda *a: tables.append(1) or real_tables(*a))
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real_tolist(t))
    meta = _prepare(args, "block_causal", "torch")
    assert len(tables) == 1 and len(reads) >= 1
    n = len(reads)
    for _ in range(4):  # four layers
        meta.forward(q, k, v, kc.clone(), vc.clone())
    assert len(tables) == 1 and len(reads) == n


def test_validated_once_and_refuses_other_shapes(monkeypatch):
    from simsd_kernels import metadata
    args = make_inputs(6, 2, 5, 4, 2, 64, [3, 9], lmax=16)
    q, k, v, kc, vc = args[:5]
    meta = _prepare(args, "exact", "torch")
    seen = []
    real = metadata.validate_attention_args
    monkeypatch.setattr(metadata, "validate_attention_args", lambda *a: seen.append(1) or real(*a))
    for _ in range(3):
        meta.forward(q, k, v, kc, vc)
    assert len(seen) == 1
    with pytest.raises(ValueError, match="prepared for"):
        meta.forward(q[:, :, :2], k, v, kc, vc)  # GQA group 1 instead of 2: valid alone, not this forward's
    with pytest.raises(ValueError, match="k_cache"):
        meta.forward(q, k, v, kc[:, :, :1], vc)


def test_prepare_names_bad_inputs():
    args = make_inputs(7, 2, 5, 4, 2, 64, [3, 9], lmax=16)
    with pytest.raises(ValueError, match="positions"):
        _prepare([*args[:7], args[7][:, :3]], "exact", "torch")
    with pytest.raises(ValueError, match="GQA"):
        sk.prepare_attention(args[5], args[6], args[7], num_heads=3, num_kv_heads=2, head_dim=64,
                             dtype=torch.float32, cache_capacity=16, mask_mode="exact", rope_theta=THETA)
    with pytest.raises(ValueError, match="mask_mode"):
        _prepare(args, "causal", "torch")


@pytest.mark.parametrize("backend", available_backends(DEVICE))
@pytest.mark.parametrize("num_tokens", [0, 1, 4, 9])
def test_append_kv_writes_the_first_num_tokens_rotated(backend, num_tokens):
    """Rows of 0, 5 and 30 cached tokens, capacity 36 (the last row has room for 6 of 9): exactly the
    slots ``cache_seqlens[b] + i`` for ``i < num_tokens`` below the capacity are written, v as it is,
    k rotated within 2x the torch error of a float64 rotation (+ a floor)."""
    from simsd_kernels.rope import apply_rope
    gen = torch.Generator().manual_seed(num_tokens)
    lens, L, cap = [0, 5, 30], 9, 36
    k, v = (torch.randn(3, L, 2, 64, generator=gen).to(DEVICE) for _ in range(2))
    pos = (torch.tensor(lens)[:, None] + torch.arange(L) + 7).to(DEVICE)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kc = torch.full((3, cap, 2, 64), float("nan"), device=DEVICE)
    vc = kc.clone()
    sk.append_kv(k, v, pos, kc, vc, seqlens, rope_theta=THETA, num_tokens=num_tokens, backend=backend)
    written = torch.zeros(3, cap, dtype=torch.bool)
    for b, n in enumerate(lens):
        written[b, n:min(n + num_tokens, cap)] = True
    written = written.to(DEVICE)
    assert torch.equal(kc.isnan().all(-1).all(-1), ~written) and torch.equal(vc.isnan().all(-1).all(-1), ~written)
    rows, cols = written.nonzero(as_tuple=True)
    tok = cols - seqlens.long()[rows]
    assert torch.equal(vc[rows, cols], v[rows, tok])
    if num_tokens:
        exact = apply_rope(k.double(), pos, THETA)[rows, tok]
        err = (kc[rows, cols].double() - exact).abs().max()
        torch_err = (apply_rope(k, pos, THETA)[rows, tok].double() - exact).abs().max()
        assert err <= 2 * torch_err + 1e-6, (backend, err, torch_err)


def test_append_kv_names_bad_inputs():
    _, k, v, kc, vc, lens, _, pos = make_inputs(9, 2, 5, 4, 2, 64, [3, 9], lmax=16)
    bad = {r"num_tokens must be in \[0, 5\], got 6": dict(num_tokens=6),
           r"positions must be \(B=2, L=5\)": dict(positions=pos[:, :4]),
           "v must be shaped as k": dict(v=v[:, :4]),
           "k_cache must have dtype": dict(k_cache=kc.double()),
           "cache_seqlens must have dtype torch.int32": dict(cache_seqlens=lens.long())}
    for needle, change in bad.items():
        args = dict(k=k, v=v, positions=pos, k_cache=kc, v_cache=vc, cache_seqlens=lens, num_tokens=None)
        args.update(change)
        with pytest.raises(ValueError, match=needle):
            sk.append_kv(args["k"], args["v"], args["positions"], args["k_cache"], args["v_cache"],
                         args["cache_seqlens"], rope_theta=THETA, num_tokens=args["num_tokens"], backend="torch")


@pytest.mark.parametrize("backend", available_backends(DEVICE))
def test_opcheck_attention_with_kvcache(backend):
    args = [a.to(DEVICE) for a in make_inputs(8, 2, 5, 4, 2, 64, [6, 0], lmax=16)]
    torch.library.opcheck(attention_with_kvcache_op, (*args, 3, 1e4, 0.125, backend),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotation_with_signed_sine_is_transformers_rotate_half_bit_for_bit(dtype):
    """``x * cos + roll(x, D/2) * [-sin, sin]`` (the door's RoPE, tables once per forward) against
    transformers' Qwen3 ``apply_rotary_pos_emb`` on the same cos/sin tables."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from simsd_kernels.rope import rope_cos_sin, rope_tables, rotate
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 5, 4, 128, generator=gen).to(dtype)
    k = torch.randn(2, 5, 2, 128, generator=gen).to(dtype)
    pos = torch.randint(0, 40000, (2, 5), generator=gen)
    cos, sin = rope_cos_sin(pos, 128, THETA, dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[:, :, 0], sin[:, :, 0], unsqueeze_dim=2)
    tables = rope_tables(pos, 128, THETA, dtype)
    assert torch.equal(rotate(q, *tables), want_q) and torch.equal(rotate(k, *tables), want_k)
