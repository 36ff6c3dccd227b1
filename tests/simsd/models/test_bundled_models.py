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


def heldout_ids(ck) -> list:
    p = bundled_prompts()[0]
    out = ck.tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                           tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # transformers 5 returns a BatchEncoding


def test_target_continues_a_heldout_prompt_like_the_reference():
    """The bundled target (float64) decodes a held-out prompt token for token like the
    independent reference decoder (tests/reference_decoder.py) on the same files."""
    from tests.reference_decoder import ReferenceModel, reference_generate
    ck = load_checkpoint(PAIR[0], dtype="float64")
    ck.model.attention_backend = "torch"
    ids = heldout_ids(ck)
    res = vanilla_generate(ck.model, ids, DecodeConfig(max_new_tokens=16), ck.mask_token_id, ck.stop_ids)
    want = reference_generate(ReferenceModel(PAIR[0]), ids, block_length=4, strategy="static", max_new_tokens=16)
    assert res.token_ids == want.token_ids and len(res.token_ids) == 16
    assert isinstance(simsd.__version__, str)


def test_exact_mode_with_the_bundled_draft_equals_vanilla():
    """The bundled pair as ``make demo`` runs it (float32): exact mode with the bundled draft
    gives the target's vanilla tokens, and the draft's proposals are not all accepted (a real
    draft, not the target)."""
    from simsd.speculative import SpecConfig, speculative_generate
    target, draft = (load_checkpoint(p, dtype="float32") for p in PAIR)
    ids = heldout_ids(target)
    cfg = DecodeConfig(max_new_tokens=24)
    want = vanilla_generate(target.model, ids, cfg, target.mask_token_id, target.stop_ids)
    got = speculative_generate(target, draft, ids, cfg, SpecConfig(mode="exact"))
    assert got.token_ids == want.token_ids
    assert got.stats["draft_forwards"] > 0 and got.stats["target_forwards"] < want.stats["target_forwards"]
