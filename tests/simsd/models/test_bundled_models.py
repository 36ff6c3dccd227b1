"""The bundled tiny SDAR pair: SDAR-format files that load like a real checkpoint and decode."""
import json
from pathlib import Path

import pytest

import simsd
from simsd import DecodeConfig, load_checkpoint, vanilla_generate
from simsd.entrypoints.prompts import ASSETS, bundled_prompts

PAIR = [ASSETS / "tiny-sdar-target", ASSETS / "tiny-sdar-draft"]


def test_pair_size_under_25mb():
    total = sum(f.stat().st_size for d in PAIR for f in Path(d).iterdir())
    assert total < 25 * 2 ** 20


@pytest.mark.parametrize("path", PAIR, ids=["target", "draft"])
def test_files_are_sdar_format(path):
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "sdar" and cfg["architectures"] == ["SDARForCausalLM"]
    assert cfg["block_size"] == 4 and cfg["head_dim"] in (64, 128)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (path / name).is_file(), name
    ck = load_checkpoint(path, dtype="float32")
    tok = ck.tokenizer
    assert ck.mask_token_id == tok.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>") == cfg["mask_token_id"]
    assert ck.stop_ids == sorted([tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")])
    assert ck.config.vocab_size == len(tok)


def test_pair_shares_the_tokenizer():
    a, b = (json.loads((p / "tokenizer.json").read_text()) for p in PAIR)
    assert a == b


def test_target_continues_a_heldout_prompt():
    ck = load_checkpoint(PAIR[0], dtype="float32")
    ck.model.attention_backend = "torch"
    p = bundled_prompts()[0]
    out = ck.tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                           tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 returns a BatchEncoding
    res = vanilla_generate(ck.model, list(ids), DecodeConfig(max_new_tokens=16), ck.mask_token_id, ck.stop_ids)
    assert 1 <= len(res.token_ids) <= 16
    assert ck.mask_token_id not in res.token_ids
    assert isinstance(simsd.__version__, str)
