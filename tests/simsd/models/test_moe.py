"""The SDAR-MoE (Qwen3-MoE layout) model against transformers' Qwen3MoeForCausalLM, which loads
the same per-expert checkpoint files with its own loader; the MoE config fields and tensors
checked like the dense ones."""
import json

import pytest
import torch

from simsd.models.config import CheckpointError, ModelConfig
from simsd.models.loading import load_model, read_checkpoint
from simsd.models.model import labels_for
from simsd.models.moe import SparseMoeBlock
from simsd.testing import config_dict, moe_config_dict, random_state_dict, save_checkpoint
from simsd_kernels.moe import fused_moe

SDAR_ONLY = ("model_type", "architectures", "block_size", "mask_token_id")
V = 97


def moe_cfg(**moe) -> dict:
    cfg = config_dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, mask_token_id=96, tie_word_embeddings=moe.pop("tie", False))
    return moe_config_dict(cfg, **moe)


def hf_config(cfg: dict):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in SDAR_ONLY})


def hf_model(path, cfg: dict, dtype):
    from transformers import Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM.from_pretrained(str(path), config=hf_config(cfg), dtype=dtype,
                                               attn_implementation="eager",
                                               experts_implementation="eager").eval()


# dtype, tolerance (transformers' RMSNorm and router softmax run in float32 for float64 weights too,
# so float64 logits agree to about 1e-5 of their size ~30)
TOL = {torch.float64: 1e-4, torch.float32: 2e-4}
CASES = {
    "float64 untied 1 file, dense layer 1, no renorm": (torch.float64,
                                                        dict(norm_topk_prob=False, mlp_only_layers=[1]), 1),
    "float64 tied 3 shards, renorm": (torch.float64, dict(tie=True, norm_topk_prob=True), 3),
    "float32 tied 1 file, sparse step 2": (torch.float32,
                                           dict(tie=True, decoder_sparse_step=2, num_experts_per_tok=3), 1),
    "float32 untied 2 shards, dense 0 and 2, no renorm": (torch.float32, dict(norm_topk_prob=False,
                                                                             mlp_only_layers=[0, 2]), 2),
    "float32 untied 3 shards, top-1 of 4": (torch.float32, dict(num_experts=4, num_experts_per_tok=1), 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_qwen3_moe(case, tmp_path):
    dtype, moe, shards = CASES[case]
    cfg = moe_cfg(**moe)
    save_checkpoint(tmp_path, cfg, random_state_dict(cfg, seed=4), shards=shards)
    ours = load_model(tmp_path, dtype)
    hf = hf_model(tmp_path, cfg, dtype)
    mc = ours.config
    kinds = [type(layer.mlp).__name__ for layer in hf.model.layers]
    assert [mc.is_moe_layer(i) for i in range(3)] == [k == "Qwen3MoeSparseMoeBlock" for k in kinds]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == [
        mc.is_moe_layer(i) for i in range(3)]
    L = 21
    ids = torch.randint(0, V, (1, L), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(L)[None]
    with torch.no_grad():
        ref = hf(input_ids=ids).logits.double()
    got = ours(ids, pos, labels_for(L, "cpu", grp=pos), "block_causal", ours.new_cache(1, 0)).double()
    err = (got - ref).abs().max().item()
    print(f"{case}: max abs err {err:.3g} (logits up to {ref.abs().max().item():.3g})")
    assert err <= TOL[dtype], err
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("norm", [False, True])
def test_moe_block_matches_transformers_block(dtype, tol, norm):
    """The block alone (no norms between): transformers' Qwen3MoeSparseMoeBlock with the same
    experts, stacked by hand from the per-expert tensors."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = moe_cfg(norm_topk_prob=norm, num_experts_per_tok=3)
    hc = hf_config(cfg)
    hc._experts_implementation = "eager"
    sd = random_state_dict(cfg, seed=2)
    pre = "model.layers.0.mlp."
    ours = SparseMoeBlock(ModelConfig.from_dict(cfg))
    ours.load_state_dict({k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)})
    hf = Qwen3MoeSparseMoeBlock(hc)
    E = cfg["num_experts"]
    with torch.no_grad():
        hf.gate.weight.copy_(sd[pre + "gate.weight"])
        gate_up = [torch.cat([sd[f"{pre}experts.{e}.gate_proj.weight"], sd[f"{pre}experts.{e}.up_proj.weight"]])
                   for e in range(E)]
        hf.experts.gate_up_proj.copy_(torch.stack(gate_up))
        hf.experts.down_proj.copy_(torch.stack([sd[f"{pre}experts.{e}.down_proj.weight"] for e in range(E)]))
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = torch.randn(2, 19, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    with torch.no_grad():
        ref, got = hf(x), ours(x)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=tol)
    # every expert is used by some token (the test is not blind to a wrong expert's weights)
    assert len(set(ours.gate(x.reshape(-1, 64))[1].flatten().tolist())) == E


def test_state_dict_names_are_the_checkpoint_names():
    cfg = moe_cfg(mlp_only_layers=[1])
    model_sd = {k for k in load_state(cfg).state_dict()}
    assert model_sd == set(random_state_dict(cfg))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in model_sd
    assert "model.layers.1.mlp.gate_proj.weight" in model_sd


def load_state(cfg):
    from simsd.models.model import SDARForCausalLM
    m = SDARForCausalLM(ModelConfig.from_dict(cfg))
    m.load_state_dict(random_state_dict(cfg))
    return m


def test_state_dict_round_trip_is_exact():
    cfg = moe_cfg()
    sd = random_state_dict(cfg, seed=9)
    m = load_state(cfg)
    m.load_state_dict(sd)
    back = m.state_dict()
    assert all(torch.equal(back[k], v) for k, v in sd.items())


@pytest.mark.parametrize("field,value,needle", [
    ("num_experts", -1, "int >= 0"),
    ("num_experts", 2.5, "int >= 0"),
    ("num_experts_per_tok", 9, "[1, num_experts = 8]"),
    ("num_experts_per_tok", 0, "[1, num_experts = 8]"),
    ("moe_intermediate_size", 0, "int >= 1"),
    ("norm_topk_prob", "yes", "true or false"),
    ("decoder_sparse_step", 0, "int >= 1"),
    ("mlp_only_layers", [3], "[0, num_hidden_layers = 3)"),
    ("mlp_only_layers", [1, 1], "distinct"),
    ("mlp_only_layers", "0", "list"),
])
def test_bad_moe_fields_are_refused_naming_file_field_and_value(field, value, needle, tmp_path):
    cfg = {**moe_cfg(), field: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as exc:
        ModelConfig.from_dir(tmp_path)
    msg = str(exc.value)
    assert str(tmp_path / "config.json") in msg and f"{field} = {value!r}" in msg and needle in msg, msg


def test_moe_defaults_are_qwen3_moe_config_defaults():
    from transformers import Qwen3MoeConfig
    cfg = moe_cfg()
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers"):
        cfg.pop(k)
    mc, hc = ModelConfig.from_dict(cfg), Qwen3MoeConfig()
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size, mc.norm_topk_prob,
            mc.decoder_sparse_step, mc.mlp_only_layers) == (hc.num_experts, hc.num_experts_per_tok,
                                                            hc.moe_intermediate_size, hc.norm_topk_prob,
                                                            hc.decoder_sparse_step, tuple(hc.mlp_only_layers))
    assert mc.model_type == "sdar_moe" and mc.block_size == 4


def test_qwen3_moe_without_block_size_is_not_block_diffusion():
    cfg = {**moe_cfg(), "model_type": "qwen3_moe"}
    cfg.pop("block_size")
    assert ModelConfig.from_dict(cfg).block_size is None
    assert ModelConfig.from_dict(cfg).num_experts == 8


def test_dense_configs_ignore_moe_fields():
    cfg = {**moe_cfg(), "model_type": "sdar"}
    assert ModelConfig.from_dict(cfg).num_experts == 0


def test_zero_experts_is_dense_everywhere(tmp_path):
    cfg = moe_cfg(num_experts=0, num_experts_per_tok=5)
    mc = ModelConfig.from_dict(cfg)
    assert not any(mc.is_moe_layer(i) for i in range(3))
    save_checkpoint(tmp_path, cfg, random_state_dict(cfg))
    assert not any(isinstance(layer.mlp, SparseMoeBlock) for layer in load_model(tmp_path).model.layers)


def _moe_checkpoint(tmp_path, edit):
    cfg = moe_cfg()
    sd = random_state_dict(cfg)
    edit(sd)
    return save_checkpoint(tmp_path, cfg, sd, shards=2)


def test_a_missing_expert_tensor_is_named(tmp_path):
    path = _moe_checkpoint(tmp_path, lambda sd: sd.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.2\.mlp\.experts\.5\.up_proj"):
        read_checkpoint(path, with_tokenizer=False)


def test_an_expert_tensor_of_the_wrong_shape_is_named(tmp_path):
    def edit(sd):
        sd["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(64, 31)
    path = _moe_checkpoint(tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight' has shape "
                                              r"\(64, 31\), expected \(64, 32\)"):
        load_model(path)


def test_an_expert_beyond_num_experts_is_unexpected(tmp_path):
    def edit(sd):
        sd["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)
    path = _moe_checkpoint(tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.8\.gate_proj"):
        load_model(path)


def test_fused_moe_names_bad_arguments():
    x, wgu, wd = torch.zeros(5, 8), torch.zeros(4, 6, 8), torch.zeros(4, 8, 3)
    w, ids = torch.ones(5, 2), torch.zeros(5, 2, dtype=torch.long)
    assert fused_moe(x, wgu, wd, w, ids).shape == (5, 8)
    with pytest.raises(ValueError, match="w_down must be"):
        fused_moe(x, wgu, torch.zeros(4, 8, 4), w, ids)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fused_moe(x, wgu, wd, w, ids[:4])
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_moe(x, wgu, wd, w, ids.float())
    with pytest.raises(ValueError, match="dtype of x"):
        fused_moe(x, wgu.double(), wd, w, ids)
