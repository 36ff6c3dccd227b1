"""Streamed text: increments never split a character; stop ids, stop strings and max_tokens cut
the output as the API documents."""
import pytest

from simsd.assets import DEFAULT_TARGET
from simsd.entrypoints.detokenize import REPLACEMENT, IncrementalDetokenizer, TextStream
from simsd.models.loading import load_tokenizer

TEXTS = ["héllo wörld 日本語 🙂 ok", "naïve café — “quotes” and 🙂🙂 end", "plain ascii text, no surprises"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_TARGET)  # byte-level BPE, as Qwen's and SDAR's


def pieces(ids, size):
    return [ids[i:i + size] for i in range(0, len(ids), size)]


@pytest.mark.parametrize("size", [1, 3, 4])
@pytest.mark.parametrize("text", TEXTS)
def test_increments_never_split_a_character(tok, text, size):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if text != TEXTS[2]:  # the premise: some prefix of the ids ends inside a character
        assert any(tok.decode(ids[:i]).endswith(REPLACEMENT) for i in range(1, len(ids)))
    detok = IncrementalDetokenizer(tok)
    out = [detok.push(p) for p in pieces(ids, size)]
    assert all(REPLACEMENT not in piece for piece in out)
    assert "".join(out) + detok.rest() == text == tok.decode(ids)


def test_rest_returns_an_incomplete_character_at_the_end(tok):
    ids = tok("ok 🙂", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    shown = detok.push(ids[:-1])
    assert REPLACEMENT not in shown
    assert shown + detok.rest() == tok.decode(ids[:-1])  # the cut character as U+FFFD, nothing lost


def run(stream, ids, size=4):
    out = [stream.push(p) for p in pieces(ids, size)]
    out.append(stream.finish())
    return "".join(out), out


def test_stop_string_cuts_the_text_and_is_never_streamed(tok):
    text = "alpha beta STOP gamma delta"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, stop_ids=[], stop=("STOP", "zzz"))
    shown, out = run(stream, ids, size=1)
    assert shown == stream.text == "alpha beta "
    assert stream.finish_reason == "stop" and stream.stop_reason == "STOP"
    assert all("S" not in piece for piece in out)  # not even the start of the stop string left the stream
    # the ids end with the token that completed the stop string
    assert "STOP" in tok.decode(stream.token_ids) and "STOP" not in tok.decode(stream.token_ids[:-1])


@pytest.mark.parametrize("size", [1, 3])
def test_a_stop_string_completed_by_the_first_character_of_a_token_is_found(tok, size):
    """The edge of the search: only the stop string's last character is new, the first
    character of the token just pushed. For every token boundary of the text, stop strings of
    2 and 5 characters ending there cut the text before them."""
    text = "alpha beta gamma delta epsilon"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    cases = 0
    for i in range(1, len(ids)):
        s0 = len(tok.decode(ids[:i]))  # where token i's text begins
        for n in (2, 5):
            begin = s0 - n + 1
            stop = text[begin:s0 + 1]
            if begin < 0 or text.index(stop) != begin:
                continue
            stream = TextStream(tok, stop_ids=[], stop=(stop,))
            shown, _ = run(stream, ids, size)
            assert shown == stream.text == text[:begin], (stop, size)
            assert (stream.finish_reason, stream.stop_reason) == ("stop", stop)
            assert stream.token_ids == ids[:i + 1]  # the ids end with the token that completed it
            cases += 1
    assert cases >= len(ids)  # most boundaries, both lengths (13 of 16 here: the rest start before the text or repeat)


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tok):
    ids = tok("a STx b ST", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, stop_ids=[], stop=("STOP",))
    shown, _ = run(stream, ids, size=1)
    assert shown == "a STx b ST" and stream.finish_reason == "length" and stream.stop_reason is None


def test_stop_id_is_kept_in_the_ids_not_in_the_text(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok("some text", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, stop_ids=[eos])
    shown, _ = run(stream, ids + [eos] + ids)
    assert stream.token_ids == ids + [eos] and shown == "some text"
    assert (stream.finish_reason, stream.stop_reason) == ("stop", eos)


def test_max_tokens_and_no_tokenizer(tok):
    ids = tok("one two three four five six", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, stop_ids=[], max_tokens=3)
    shown, _ = run(stream, ids)
    assert stream.token_ids == ids[:3] and shown == tok.decode(ids[:3]) and stream.finish_reason == "length"
    bare = TextStream(None, stop_ids=[ids[4]])
    assert run(bare, ids)[0] == "" and bare.text is None and bare.token_ids == ids[:5]
