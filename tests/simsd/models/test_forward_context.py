"""The model's forward context and merged projections.

* one forward resolves the attention backend once and computes the RoPE tables once, whatever
  the number of layers (the layers read ``ctx.attention``);
* the merged q/k/v and gate/up projections keep Qwen3's parameter names in ``state_dict`` and
  ``load_state_dict`` (the checkpoint format), and split back into the rows they were made of;
* q and k normalised in one pass over their heads give the bits of two separate per-head
  RMSNorms (transformers' ``Qwen3RMSNorm`` formula), in float32 and bfloat16, and follow the
  norm weights when they change; the torch door rotates such adjacent q and k in one pass with
  the bits of two rotations;
* bad write counts are refused with the shape named.
"""
from __future__ import annotations

import pytest
import torch

import simsd_kernels
from simsd.models.config import ModelConfig
from simsd.models.model import SDARForCausalLM, labels_for
from simsd.testing import config_dict, random_state_dict
from simsd_kernels import prepare, torch_backend

QWEN3_LAYER_NAMES = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight"}


def _model(layers=3, dtype=torch.float32):
    cfg = config_dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, mask_token_id=96)
    sd = random_state_dict(cfg, seed=5)
    m = SDARForCausalLM(ModelConfig.from_dict(cfg))
    m.load_state_dict(sd)
    m.attention_backend = "torch"
    return m.to(dtype).eval(), sd


def test_backend_resolved_and_rope_tables_made_once_per_forward(monkeypatch):
    m, _ = _model(layers=5)
    resolutions, tables = [], []
    real_resolve, real_tables = prepare.resolve_backend, torch_backend.rope_tables
    monkeypatch.setattr(prepare, "resolve_backend", lambda *a: resolutions.append(a[0]) or real_resolve(*a))
    monkeypatch.setattr(torch_backend, "rope_tables", lambda *a: tables.append(1) or real_tables(*a))
    cache = m.new_cache(2, 32)
    L = 6
    ids = torch.randint(0, 96, (2, L))
    pos = torch.arange(L).expand(2, L).contiguous()
    for mode in ("bidirectional", "block_causal", "exact", "paper"):
        resolutions.clear(), tables.clear()
        m(ids, pos, labels_for(L, "cpu").expand(2, L, 3).contiguous(), mode, cache)
        assert resolutions == ["torch"] and len(tables) == 1, (mode, resolutions, len(tables))


def test_the_model_says_what_its_attention_runs_on(monkeypatch):
    """``attention_backend_class``: the door class a forward of that mask mode opens (resolved as the
    forward resolves it), or by availability alone; an unknown backend is the forward's error."""
    from simsd_kernels.torch_backend import TorchAttention
    m, _ = _model(layers=1)
    monkeypatch.delenv("SIMSD_ATTENTION_BACKEND", raising=False)
    cache = m.new_cache(1, 16)
    ids, pos = torch.randint(0, 96, (1, 4)), torch.arange(4)[None]
    ctx = m.context(pos, labels_for(4, "cpu"), "exact", cache)
    for requested in ("torch", "auto"):  # auto never takes the Triton interpreter on the CPU
        m.attention_backend = requested
        assert m.attention_backend_class("exact") is type(ctx.attention) is TorchAttention
        assert m.attention_backend_class() is TorchAttention and not TorchAttention.fused
    m.attention_backend = "nope"
    with pytest.raises(ValueError, match="backend must be one of"):
        m.attention_backend_class("paper")
    with pytest.raises(ValueError, match="backend must be one of"):
        m(ids, pos, labels_for(4, "cpu"), "paper", cache)


def test_state_dict_keeps_qwen3_names_and_round_trips():
    m, sd = _model(layers=2)
    got = m.state_dict()
    assert set(got) == set(sd)
    for i in range(2):
        assert {k.split(f"layers.{i}.", 1)[1] for k in got if f"layers.{i}." in k} == QWEN3_LAYER_NAMES
    assert not [k for k in got if "qkv_proj" in k or "gate_up_proj" in k]
    for k, v in sd.items():
        assert torch.equal(got[k], v), k
    att, mlp = m.model.layers[1].self_attn, m.model.layers[1].mlp
    q, k, v = att.qkv_proj.weight.split([4 * 64, 2 * 64, 2 * 64])
    assert torch.equal(q, sd["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(v, sd["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(mlp.gate_up_proj.weight[96:], sd["model.layers.1.mlp.up_proj.weight"])
    twin = SDARForCausalLM(m.config)
    twin.load_state_dict(got)
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), m.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_in_one_pass_equals_two_rms_norms(dtype):
    m, _ = _model(layers=1, dtype=dtype)
    att = m.model.layers[0].self_attn
    x = torch.randn(9, 64, dtype=dtype)
    q, k, v = att.qkv(x)
    proj = att.qkv_proj(x)

    def qwen3_rms_norm(h, weight, eps):  # transformers' Qwen3RMSNorm
        f = h.to(torch.float32)
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
        return weight * f.to(h.dtype)
    want_q = qwen3_rms_norm(proj[:, :256].view(9, 4, 64), att.q_norm.weight, att.q_norm.eps)
    want_k = qwen3_rms_norm(proj[:, 256:384].view(9, 2, 64), att.k_norm.weight, att.k_norm.eps)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, proj[:, 384:].view(9, 2, 64))
    # the merged norm weight follows the parameters (loading, in-place changes)
    with torch.no_grad():
        att.k_norm.weight.mul_(2)
    q2, k2, _ = att.qkv(x)
    assert torch.equal(q2, q) and torch.equal(k2, qwen3_rms_norm(proj[:, 256:384].view(9, 2, 64), att.k_norm.weight,
                                                                   att.k_norm.eps))
    att.load_state_dict({**att.state_dict(), "q_norm.weight": att.q_norm.weight * 3})
    assert torch.equal(att.qkv(x)[0], qwen3_rms_norm(proj[:, :256].view(9, 4, 64), att.q_norm.weight, att.q_norm.eps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["bidirectional", "exact"])
def test_the_torch_door_rotates_adjacent_q_and_k_in_one_pass_with_the_same_bits(dtype, mode):
    m, _ = _model(layers=1, dtype=dtype)
    att = m.model.layers[0].self_attn
    q, k, v = att.qkv(torch.randn(2 * 6, 64, dtype=dtype), (2, 6))
    assert k.data_ptr() == q.data_ptr() + q.shape[2] * q.shape[3] * q.element_size()  # one tensor: one rotation
    caches = [(torch.randn(2, 16, 2, 64, dtype=dtype), torch.randn(2, 16, 2, 64, dtype=dtype)) for _ in range(2)]
    caches[1] = tuple(c.clone() for c in caches[0])
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    labels = labels_for(6, "cpu", grp=torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32)).expand(2, 6, 3).contiguous()
    positions = (seqlens.long()[:, None] + torch.arange(6)).contiguous()
    outs = []
    for (kc, vc), (qq, kk) in zip(caches, [(q, k), (q.clone(), k.clone())]):
        door = simsd_kernels.prepare_attention(seqlens, labels, positions, num_heads=4, num_kv_heads=2, head_dim=64,
                                               dtype=dtype, cache_capacity=16, mask_mode=mode, rope_theta=1e6,
                                               backend="torch")
        outs.append(door.forward(qq, kk, v, kc, vc))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_bad_write_counts_are_named():
    m, _ = _model(layers=1)
    cache = m.new_cache(2, 16)
    ids, pos = torch.zeros(2, 4, dtype=torch.int64), torch.arange(4).expand(2, 4).contiguous()
    with pytest.raises(ValueError, match=r"num_write .*\(B=2,\)"):
        m(ids, pos, labels_for(4, "cpu").expand(2, 4, 3).contiguous(), "exact", cache,
          num_write=torch.tensor([1, 2, 3]))
    assert simsd_kernels.prepare_attention is prepare.prepare_attention
