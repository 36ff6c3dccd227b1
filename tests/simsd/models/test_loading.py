"""Every file the loader reads, malformed or inconsistent, gives one CheckpointError line that
names the file (and the field or tensor); the right checkpoints still load."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from simsd.models.loading import CheckpointError, load_checkpoint, read_checkpoint
from simsd.testing import make_random_checkpoint
from tests.helpers import random_checkpoint


@pytest.fixture()
def ck(tmp_path):
    """A writable copy of a small checkpoint with a tokenizer."""
    dst = tmp_path / "ck"
    shutil.copytree(random_checkpoint("loading", tokenizer=True), dst)
    return dst


@pytest.fixture()
def sharded(tmp_path):
    return make_random_checkpoint(tmp_path / "sharded", tokenizer=False, shards=3)


def refused(path, *needles, with_tokenizer=True, **declared):
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path, with_tokenizer=with_tokenizer, **declared)
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, msg
    return msg


def edit_json(f, fn):
    f.write_text(json.dumps(fn(json.loads(f.read_text()))))


@pytest.mark.parametrize("content,needle", [
    ('{"metadata": {}}', "no 'weight_map'"),
    ("{oops", "invalid JSON in the weight index"),
    ('{"weight_map": []}', "non-empty object"),
    ('{"weight_map": {}}', "non-empty object"),
    ('[]', "no 'weight_map'"),
    ('{"weight_map": {"model.norm.weight": 3}}', "is not a file name"),
    ('{"weight_map": {"model.norm.weight": "../x.safetensors"}}', "points outside the checkpoint"),
])
def test_malformed_index(sharded, content, needle):
    index = sharded / "model.safetensors.index.json"
    index.write_text(content)
    refused(sharded, index, needle, with_tokenizer=False)


def test_index_that_misplaces_or_invents_tensors(sharded):
    index = sharded / "model.safetensors.index.json"
    orig = json.loads(index.read_text())
    wm = orig["weight_map"]
    name = next(n for n in wm if wm[n] != wm["model.norm.weight"])
    edit_json(index, lambda d: {**d, "weight_map": {**wm, name: wm["model.norm.weight"]}})
    refused(sharded, index, name, "but it is in", with_tokenizer=False)
    edit_json(index, lambda d: {**orig, "weight_map": {**wm, "model.extra.weight": wm["model.norm.weight"]}})
    refused(sharded, index, "model.extra.weight", "no shard holds", with_tokenizer=False)


def test_a_tensor_in_two_shards(sharded):
    files = sorted(sharded.glob("*.safetensors"))
    a, b = load_file(str(files[0])), load_file(str(files[1]))
    name = next(iter(a))
    save_file({**b, name: a[name]}, str(files[1]))
    (sharded / "model.safetensors.index.json").unlink()
    refused(sharded, name, "is also in", with_tokenizer=False)


@pytest.mark.parametrize("content,needle", [
    ("{", "invalid JSON in the generation config"),
    ("[2]", "expected a JSON object"),
    ('{"eos_token_id": "2"}', "eos_token_id = '2'"),
    ('{"eos_token_id": [2, null]}', "must be a token id"),
    ('{"eos_token_id": 99999}', "outside the vocabulary"),
])
def test_malformed_generation_config(ck, content, needle):
    gen = ck / "generation_config.json"
    gen.write_text(content)
    refused(ck, gen, needle)


@pytest.mark.parametrize("name,content,needle", [
    ("tokenizer.json", "{", "invalid JSON in the tokenizer file"),
    ("tokenizer_config.json", "{", "invalid JSON in the tokenizer file"),
    ("tokenizer_config.json", "[]", "expected a JSON object"),
    ("special_tokens_map.json", "{", "invalid JSON"),
    ("tokenizer.json", '{"model": {"type": "Nonsense"}}', "cannot load the tokenizer"),
    ("tokenizer.json", b"\xff\xfe{}", "not UTF-8"),
])
def test_malformed_tokenizer_files(ck, name, content, needle):
    f = ck / name
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    msg = refused(ck, needle)
    assert str(ck) in msg


def test_a_missing_tokenizer_json_is_named(ck):
    """Issue 34: without tokenizer.json transformers' message was cut off mid-sentence and named
    no file; now the file, the files there and transformers' whole message are given."""
    (ck / "tokenizer.json").unlink()
    msg = refused(ck, f"{ck}: cannot load the tokenizer: there is no tokenizer.json", "tokenizer_config.json",
                  "config.json")
    assert msg.endswith(".") and "to a )" not in msg, msg


def test_chat_template_that_does_not_compile(ck):
    edit_json(ck / "tokenizer_config.json", lambda d: {**d, "chat_template": "{% for m in messages %}"})
    (ck / "chat_template.jinja").unlink(missing_ok=True)
    refused(ck, ck / "tokenizer_config.json", "chat template does not compile")


def test_untied_config_without_a_head(tmp_path):
    path = make_random_checkpoint(tmp_path / "ck", tokenizer=False, tie_word_embeddings=True)
    edit_json(path / "config.json", lambda d: {**d, "tie_word_embeddings": False})
    refused(path, path / "config.json", "tie_word_embeddings is false", "lm_head.weight", with_tokenizer=False)
    edit_json(path / "config.json", lambda d: {k: v for k, v in d.items() if k != "tie_word_embeddings"})
    refused(path, "tie_word_embeddings is false", with_tokenizer=False)  # transformers' default


def test_tied_config_with_a_different_head(tmp_path):
    path = make_random_checkpoint(tmp_path / "ck", tokenizer=False)
    edit_json(path / "config.json", lambda d: {**d, "tie_word_embeddings": True})
    refused(path, "tie_word_embeddings is true", "differs", with_tokenizer=False)
    sd = load_file(str(path / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(path / "model.safetensors"))
    ck = load_checkpoint(path, with_tokenizer=False)  # the same tensor twice: fine, and tied
    assert ck.model.lm_head.weight is ck.model.model.embed_tokens.weight


def test_integer_tensor_refused(tmp_path):
    path = make_random_checkpoint(tmp_path / "ck", tokenizer=False)
    sd = load_file(str(path / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)
    save_file(sd, str(path / "model.safetensors"))
    refused(path, "model.norm.weight", "dtype I32", with_tokenizer=False)


def test_mask_id_that_is_a_stop_id(ck, tmp_path):
    stop = json.loads((ck / "generation_config.json").read_text())["eos_token_id"][0]
    edit_json(ck / "config.json", lambda d: {**d, "mask_token_id": stop})
    refused(ck, ck / "config.json", f"mask_token_id = {stop}", "is id")  # the tokenizer says otherwise
    refused(ck, ck / "config.json", f"mask_token_id = {stop}", "also a stop id", "generation_config.json",
            with_tokenizer=False)
    # the tokenizer's mask token as the stop id
    edit_json(ck / "config.json", lambda d: {**d, "mask_token_id": None})
    mask = read_checkpoint(ck).mask_token_id
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": [mask]}))
    refused(ck, "the tokenizer's mask token", f"mask_token_id = {mask}", "also a stop id")


def test_mask_id_that_contradicts_the_tokenizer(ck):
    info = read_checkpoint(ck)
    other = (info.mask_token_id + 1) % info.config.vocab_size
    edit_json(ck / "config.json", lambda d: {**d, "mask_token_id": other})
    refused(ck, ck / "config.json", f"mask_token_id = {other}", "'<|MASK|>'", f"id {info.mask_token_id}")


def test_tokenizer_larger_than_the_vocabulary(ck):
    edit_json(ck / "config.json", lambda d: {**d, "vocab_size": d["vocab_size"] - 10})
    refused(ck, "the tokenizer has", "vocab_size")


def test_good_checkpoints_still_load(ck, sharded):
    info = read_checkpoint(ck)
    assert info.stop_ids and info.mask_token_id not in info.stop_ids
    assert load_checkpoint(sharded, with_tokenizer=False).model is not None


@pytest.fixture()
def saved_qwen3(tmp_path):
    """A plain autoregressive Qwen3 as transformers' ``save_pretrained`` writes it: model_type qwen3,
    no block_size, no mask token; stop id 254 of 256."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, eos_token_id=254)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "qwen3")
    return tmp_path / "qwen3"


def test_a_plain_qwen3_is_refused_naming_the_file_and_what_is_missing(saved_qwen3):
    cfg = saved_qwen3 / "config.json"
    msg = refused(saved_qwen3, f"{cfg}: no block_size and no mask token", "simsd decodes block-diffusion (SDAR) "
                  "models", "this qwen3 checkpoint", "--block-length N and --mask-token-id ID",
                  "block_length=N, mask_token_id=ID")
    assert msg.startswith(str(cfg))
    # each option answers for its own field only
    msg = refused(saved_qwen3, f"{cfg}: no mask token (mask_token_id, or the tokenizer's mask_token): ",
                  "pass --mask-token-id ID (simsd.LLM: mask_token_id=ID)", block_length=4)
    assert "block_size" not in msg
    msg = refused(saved_qwen3, f"{cfg}: no block_size: ", "pass --block-length N (simsd.LLM: block_length=N)",
                  mask_token_id=255)
    assert "mask token" not in msg
    edit_json(cfg, lambda d: {**d, "mask_token_id": 255})
    refused(saved_qwen3, f"{cfg}: no block_size: ")


def test_explicit_block_length_and_mask_id_take_a_plain_qwen3(saved_qwen3):
    ck = load_checkpoint(saved_qwen3, block_length=4, mask_token_id=255)
    assert (ck.mask_token_id, ck.stop_ids, ck.config.block_size, ck.config.model_type) == (255, [254], None, "qwen3")


def test_what_declares_block_diffusion(tmp_path):
    """model_type sdar without block_size: SDAR's 4; qwen3 with block_size: block-diffusion."""
    path = make_random_checkpoint(tmp_path / "ck", tokenizer=False, block_size=8)
    edit_json(path / "config.json", lambda d: {k: v for k, v in d.items() if k != "block_size"})
    assert read_checkpoint(path).config.block_size == 4
    edit_json(path / "config.json", lambda d: {**d, "model_type": "qwen3", "block_size": 8})
    assert read_checkpoint(path).config.block_size == 8


def test_an_explicit_mask_id_is_checked(tmp_path):
    path = make_random_checkpoint(tmp_path / "ck", tokenizer=False)  # mask 255, stop 254
    cfg = path / "config.json"
    assert read_checkpoint(path, mask_token_id=255).mask_token_id == 255
    refused(path, f"{cfg}: mask_token_id = 255, but the mask token id given is 7", mask_token_id=7)
    edit_json(cfg, lambda d: {**d, "mask_token_id": None})
    for bad in (256, -1, True, "3"):
        refused(path, f"{cfg}: the mask token id given, {bad!r}, is not a token id of the vocabulary [0, 256)",
                mask_token_id=bad)
    refused(path, f"{path} (the mask token id given): mask_token_id = 254 is also a stop id", mask_token_id=254)
    assert read_checkpoint(path, mask_token_id=7).mask_token_id == 7


def test_stop_ids_are_the_union_of_generation_config_and_config(ck):
    """vLLM's rule: a chat model whose generation config names only <|endoftext|> still stops at
    the <|im_end|> its config names; each id's file is named when it is refused."""
    im_end, eos = 5, 7
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    edit_json(ck / "config.json", lambda d: {**d, "eos_token_id": [im_end, eos]})
    assert read_checkpoint(ck).stop_ids == [im_end, eos]
    edit_json(ck / "config.json", lambda d: {**d, "eos_token_id": None})
    assert read_checkpoint(ck).stop_ids == [eos]
    (ck / "generation_config.json").unlink()
    edit_json(ck / "config.json", lambda d: {**d, "eos_token_id": im_end})
    assert read_checkpoint(ck).stop_ids == [im_end]
    edit_json(ck / "config.json", lambda d: {**d, "eos_token_id": 10 ** 6})
    refused(ck, ck / "config.json", f"eos_token_id {10 ** 6} is outside the vocabulary")


def test_generation_config_sampling_fields_are_reported_and_do_sample_named_as_ignored(ck):
    """generation_config.json's temperature / top_p / top_k are the defaults of requests
    (docs/checkpoints.md "Checkpoints and MoE"; tests/simsd/entrypoints/test_generation_config.py);
    do_sample is not applied, as vLLM: the checkpoint reports the fields and a run names
    do_sample once."""
    import warnings

    from simsd import LLM, SimsdWarning
    edit_json(ck / "generation_config.json", lambda d: {**d, "temperature": 0.6, "top_p": 0.95, "top_k": None,
                                                        "do_sample": False})
    info = read_checkpoint(ck)
    assert info.generation_sampling == {"do_sample": False, "temperature": 0.6, "top_p": 0.95}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        llm = LLM(ck, mode="vanilla", dtype="float32", device="cpu", batch_size=1)
        assert (llm.default_params.temperature, llm.default_params.top_p) == (0.6, 0.95)
        assert llm.shutdown(timeout=60)
    notes = [str(w.message) for w in seen]
    assert len(notes) == 1 and issubclass(seen[0].category, SimsdWarning), notes
    assert "generation_config.json" in notes[0] and "do_sample=False not applied" in notes[0]


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "default"}])
def test_supported_rope_configs_load_without_any_warning(ck, rope_scaling):
    """SDAR checkpoints carry "rope_scaling": null; transformers 5.x warns about the name when it
    is passed on (FutureWarning), which would break simsd's one-line messages."""
    import warnings

    from simsd import LLM
    edit_json(ck / "config.json", lambda d: {**d, "rope_scaling": rope_scaling})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        llm = LLM(ck, mode="vanilla", dtype="float32", device="cpu", batch_size=1)
        assert llm.generate([[11, 12, 13]])[0].token_ids
        assert llm.shutdown(timeout=60)
    assert [str(w.message) for w in seen] == []
