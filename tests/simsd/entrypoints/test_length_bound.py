"""A text certainly longer than the model's positions is refused before it is tokenized (issue
26, item 1): the bound (``bytes_per_token``) holds for the bundled byte-level BPE tokenizer on
texts built to need few tokens, the NFC factor holds over every code point, the branches without
a bound are taken, and the LLM refuses without calling the tokenizer."""
import random
import sys
import unicodedata

import pytest

from simsd.entrypoints.encoding import NFC_SHRINK, bytes_per_token, check_length
from simsd.entrypoints.errors import ParamError


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from simsd.assets import DEFAULT_TARGET
    return AutoTokenizer.from_pretrained(DEFAULT_TARGET)


def test_nfc_shrinks_utf8_at_most_ninefold():
    """A character's NFD has 1/3 to 3 times its UTF-8 bytes, over every code point; so NFC,
    which shares a text's NFD, leaves at least 1/9 of its bytes (NFC_SHRINK)."""
    ratios = [len(unicodedata.normalize("NFD", chr(c)).encode()) / len(chr(c).encode())
              for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF]
    assert min(ratios) == 1 / 3 and max(ratios) == 3 and NFC_SHRINK == 9
    for text in ("\u212a" * 50, "\u1100\u1161\u11a8" * 50, "e\u0301" * 50):
        assert len(unicodedata.normalize("NFC", text).encode()) * NFC_SHRINK >= len(text.encode())


def test_the_bound_holds_for_the_bundled_tokenizer(tokenizer):
    """Every byte lands in one token of at most bytes_per_token bytes: texts made of the longest
    entries (the fewest tokens a text can have), runs, random Unicode, CJK, emoji."""
    per = bytes_per_token(tokenizer)
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    assert per == max(len(t) for t in vocab) == 64
    longest = sorted(vocab, key=len)[-20:]
    texts = [tokenizer.convert_tokens_to_string([t]) for t in longest]
    texts += ["".join(texts), " " * 5000, "a" * 5000, "-" * 5000, "\n" * 5000, "你好世界" * 500, "🙂" * 500,
              "<|im_start|>user\nhi<|im_end|>" * 50]
    rng = random.Random(0)
    for _ in range(50):
        texts.append("".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0xD800),
                                             rng.randrange(0xE000, 0x110000)])) for _ in range(rng.randrange(1, 400))))
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) * per >= len(text.encode("utf-8")), (text[:40], len(ids))
    # the bound is tight: the longest entry's text is one token of 64 bytes
    assert len(tokenizer(texts[19], add_special_tokens=False)["input_ids"]) == 1 and len(texts[19].encode()) == 64


def test_no_bound_where_none_is_known(tokenizer):
    """NFC (Qwen's normalizer) multiplies the bound by NFC_SHRINK; another normalizer, another
    pre-tokenizer or no fast tokenizer: no bound, and check_length lets everything through."""
    import copy

    from tokenizers import normalizers, pre_tokenizers
    nfc = copy.deepcopy(tokenizer)
    nfc.backend_tokenizer.normalizer = normalizers.NFC()
    assert bytes_per_token(nfc) == 64 * NFC_SHRINK
    nfc.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert bytes_per_token(nfc) is None
    ws = copy.deepcopy(tokenizer)
    ws.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert bytes_per_token(ws) is None and bytes_per_token(object()) is None
    check_length("x" * 10 ** 6, 2048, None)
    check_length("x" * 10 ** 6, None, 64)


def test_the_llm_refuses_a_text_certainly_too_long_before_tokenizing(tokenizer, monkeypatch):
    """At max_model_len L and 64 bytes a token: (L - 1) * 64 bytes may still fit and reach the
    tokenizer; one byte more is refused untokenized, as a text and as a chat message."""
    from simsd import LLM
    llm = LLM(mode="vanilla", dtype="float32", device="cpu", batch_size=1, max_model_len=128)
    try:
        called = []

        def tokenize(self, *args, **kwargs):
            called.append(len(args[0]))
            raise RuntimeError("tokenized")
        monkeypatch.setattr(type(llm.tokenizer), "__call__", tokenize)
        with pytest.raises(RuntimeError, match="tokenized"):
            llm.submit("a" * (127 * 64))
        assert called == [127 * 64]
        with pytest.raises(ParamError) as e:
            llm.submit("a" * (127 * 64 + 1))
        assert e.value.param == "prompt" and str(e.value) == (
            "prompt of 8129 bytes of text is at least 128 tokens (a token of this tokenizer stands for at most 64 "
            "bytes), longer than max_model_len 128 - 1: refused before tokenizing")
        with pytest.raises(ParamError) as e:
            llm.submit([{"role": "user", "content": "é" * 5000}])
        assert e.value.param == "messages" and "refused before tokenizing" in str(e.value)
        assert called == [127 * 64]
    finally:
        monkeypatch.undo()
        llm.shutdown()
