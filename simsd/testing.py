"""Helpers that build small SDAR-format checkpoints on disk (tests, examples, benchmarks).

The files are exactly what a real SDAR checkpoint holds: ``config.json`` (model_type
``sdar``, or ``sdar_moe`` with :func:`moe_config_dict`: per-expert weight names as the SDAR-MoE
checkpoints store them), safetensors weights (single file or sharded with an index), tokenizer files that
transformers' ``AutoTokenizer`` loads, ``generation_config.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]

#: Qwen-style ChatML template (system/user/assistant turns, generation prompt)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(texts, vocab_size: int = 512):
    """Train a small byte-level BPE on ``texts`` with SDAR's special tokens; returns a
    ``PreTrainedTokenizerFast`` (``mask_token = <|MASK|>``, ``eos_token = <|endoftext|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   mask_token="<|MASK|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def config_dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, block_size=4,
                mask_token_id=None, tie_word_embeddings=False, max_position_embeddings=2048,
                rope_theta=1e6, eos_token_id=None) -> dict:
    """An SDAR ``config.json`` dict with Qwen3 field names."""
    return {
        "architectures": ["SDARForCausalLM"],
        "model_type": "sdar",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def moe_config_dict(cfg: dict, num_experts: int = 8, num_experts_per_tok: int = 2, moe_intermediate_size: int = 32,
                    norm_topk_prob: bool = True, decoder_sparse_step: int = 1, mlp_only_layers=()) -> dict:
    """``cfg`` (a :func:`config_dict`) as an SDAR-MoE ``config.json`` (model_type ``sdar_moe``,
    ``SDARMoeForCausalLM``, Qwen3-MoE field names)."""
    return {**cfg, "architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe", "num_experts": num_experts,
            "num_experts_per_tok": num_experts_per_tok, "moe_intermediate_size": moe_intermediate_size,
            "norm_topk_prob": norm_topk_prob, "decoder_sparse_step": decoder_sparse_step,
            "mlp_only_layers": list(mlp_only_layers)}


def random_state_dict(cfg: dict, seed: int = 0, std: float = 0.2) -> dict:
    """Random weights with Qwen3 (Qwen3-MoE: per-expert) names for ``cfg``; norms near 1 (not
    exactly, to test them)."""
    from simsd.models.config import ModelConfig

    is_moe = ModelConfig.from_dict(cfg).is_moe_layer
    g = torch.Generator().manual_seed(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    Hq, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def w(*shape, scale=std):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": w(V, H, scale=1.0), "model.norm.weight": norm(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = w(Hq * D, H)
        sd[p + "self_attn.k_proj.weight"] = w(Hkv * D, H)
        sd[p + "self_attn.v_proj.weight"] = w(Hkv * D, H)
        sd[p + "self_attn.o_proj.weight"] = w(H, Hq * D)
        sd[p + "self_attn.q_norm.weight"] = norm(D)
        sd[p + "self_attn.k_norm.weight"] = norm(D)
        sd[p + "input_layernorm.weight"] = norm(H)
        sd[p + "post_attention_layernorm.weight"] = norm(H)
        if not is_moe(i):
            sd[p + "mlp.gate_proj.weight"] = w(I, H)
            sd[p + "mlp.up_proj.weight"] = w(I, H)
            sd[p + "mlp.down_proj.weight"] = w(H, I)
            continue
        E, Ie = cfg["num_experts"], cfg["moe_intermediate_size"]
        sd[p + "mlp.gate.weight"] = w(E, H, scale=1.0)  # routers with clear preferences
        for e in range(E):
            sd[p + f"mlp.experts.{e}.gate_proj.weight"] = w(Ie, H)
            sd[p + f"mlp.experts.{e}.up_proj.weight"] = w(Ie, H)
            sd[p + f"mlp.experts.{e}.down_proj.weight"] = w(H, Ie)
    if not cfg.get("tie_word_embeddings"):
        sd["lm_head.weight"] = w(V, H, scale=1.0)
    return sd


def save_checkpoint(path, cfg: dict, state_dict: dict, tokenizer=None, shards: int = 1,
                    dtype: torch.dtype = torch.float32, stop_ids=None) -> Path:
    """Write an SDAR-format directory; ``shards > 1`` writes an index and several files."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    sd = {k: v.to(dtype).contiguous() for k, v in state_dict.items()}
    if shards <= 1:
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(sd)
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: sd[n] for n in part}, str(path / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in sd.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    if stop_ids is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(stop_ids)}, indent=2))
    return path


SAMPLE_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The sum of the first n odd numbers is n squared.",
    "Let x be a real number such that x^2 = 4. Then x = 2 or x = -2.",
    "for i in range(10):\n    print(i * i)\n",
    "A prime number has exactly two divisors: one and itself.",
]


def make_random_checkpoint(path, *, vocab_size=None, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, block_size=4, seed=0,
                           tokenizer=True, tie_word_embeddings=False, shards=1, dtype=torch.float32,
                           max_position_embeddings=2048, std=0.5, moe: tuple = ()) -> Path:
    """A random-weight SDAR checkpoint with a small trained BPE tokenizer (or none).

    ``moe``: ``(name, value)`` pairs of :func:`moe_config_dict` for an SDAR-MoE checkpoint
    (``(("num_experts", 8),)``; a tuple, so that the argument is hashable), empty for a dense one.

    Without a tokenizer, ``vocab_size`` defaults to 256 and ``mask_token_id`` to
    ``vocab_size - 1``, stop id ``vocab_size - 2``.
    """
    tok = None
    if tokenizer:
        tok = build_tokenizer(SAMPLE_TEXT * 4, vocab_size=vocab_size or 300)
        vocab = len(tok)
        mask_id, stops = None, [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    else:
        vocab = vocab_size or 256
        mask_id, stops = vocab - 1, [vocab - 2]
    cfg = config_dict(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                      num_key_value_heads=num_key_value_heads, head_dim=head_dim, block_size=block_size,
                      mask_token_id=mask_id, tie_word_embeddings=tie_word_embeddings,
                      max_position_embeddings=max_position_embeddings, eos_token_id=stops)
    if moe:
        cfg = moe_config_dict(cfg, **dict(moe))
    return save_checkpoint(path, cfg, random_state_dict(cfg, seed, std), tok, shards=shards, dtype=dtype,
                           stop_ids=stops)
