"""A request's prompt as token ids, and the ids that end its generation: the one definition that
the Python API (:class:`~simsd.entrypoints.api.LLM`), the server and the command line use.

Prompt forms: a string (encoded as it is, no chat template), a list of chat messages
(``[{"role": ..., "content": ...}, ...]``, rendered by the checkpoint's chat template with the
generation prompt, then encoded), a :class:`ChatPrompt` (messages with the template's options:
continue the final message instead of opening a new turn) or a list of token ids (used as they
are). A prompt never
changes (docs/cli.md "Prompts never change"): a text that spells the mask token is refused here,
naming the character; ids that hold the mask id are refused by
:func:`simsd.decoding.config.check_prompt`, naming the token.

A prompt that went through the chat template also stops at the template's role markers
(:func:`role_markers`, ``<|im_start|>`` in Qwen's template): a model
that starts a new turn has finished its answer.

A text far longer than the model's positions is refused before it is tokenized (issue 26: a
20 MB prompt took 100 s and 2 GB to tokenize) where the tokenizer bounds the bytes a token
stands for (:func:`bytes_per_token`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .errors import ParamError

#: how many times fewer UTF-8 bytes Unicode NFC can make of a text, at most: a character's
#: canonical decomposition (NFD) has from 1/3 (U+212A KELVIN SIGN, 3 bytes, is ``K``) to 3 times
#: its bytes (checked over every code point by tests/simsd/entrypoints/test_length_bound.py), and NFC
#: and NFD of a text share their decomposition, so ``bytes(NFC(s)) >= bytes(s) / 9``
NFC_SHRINK = 9


def is_messages(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)


def is_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in x)


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages and how the chat template renders them (transformers' and vLLM's names):
    ``add_generation_prompt`` opens a new assistant turn after the messages (a plain list of
    messages is ``ChatPrompt(messages)``); ``continue_final_message`` leaves the final message
    open, without its end-of-turn, so that the answer continues it (a prefilled assistant
    reply). The two exclude each other.

    Raises:
        ParamError: both options true (``param``: ``continue_final_message``).
    """
    messages: list
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def __post_init__(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ParamError("continue_final_message", "continue_final_message continues the final message, "
                                                       "add_generation_prompt opens a new turn after it: set "
                                                       "add_generation_prompt to false")


class ChatTemplateError(ParamError):
    """The checkpoint's chat template raised on the messages (``param``: ``messages``)."""


def check_text(text: str, tokenizer, mask_id: int, param: str = "prompt") -> None:
    """``ParamError`` when ``text`` is not valid Unicode (a lone surrogate, e.g. from bytes that
    were not UTF-8) or spells the mask token (the error names the character)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ParamError(param, f"the text is not valid Unicode: character {exc.start} is a lone surrogate "
                                f"(U+{ord(text[exc.start]):04X}; bytes that are not UTF-8?)") from None
    mask = tokenizer.convert_ids_to_tokens(mask_id) if tokenizer is not None else None
    if mask and mask in text:
        raise ParamError(param, f"the text spells the mask token {mask!r} at character {text.index(mask)}; a prompt "
                                f"cannot contain the mask token (remove it)")


def render_chat(tokenizer, messages, add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """``messages`` through the tokenizer's chat template, with the generation prompt or with the
    final message left open (:class:`ChatPrompt`).

    Raises:
        ChatTemplateError: the template raises (its message, on one line).
    """
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
    except Exception as exc:  # jinja2 errors raised by the checkpoint's template
        what = "a user message" if len(messages) == 1 and messages[0].get("role") == "user" else "these messages"
        raise ChatTemplateError("messages", f"the chat template cannot render {what} "
                                            f"({' '.join(str(exc).split())})") from exc


def bytes_per_token(tokenizer) -> int | None:
    """The most UTF-8 bytes of prompt text one token of ``tokenizer`` stands for, or None when
    no bound is known. Known for byte-level BPE tokenizers (Qwen's, GPT-2's) whose vocabulary
    holds all 256 bytes: every byte of the text, after the normalizer, lands in exactly one token,
    whose vocabulary entry spells it one character per byte, and an added token stands for its
    content; so a text of ``n`` bytes is at least ``ceil(n / bytes_per_token)`` tokens. Without a
    normalizer that is the longest entry; with Unicode NFC (Qwen's) :data:`NFC_SHRINK` times it;
    other normalizers, other models: None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE" or backend.pre_tokenizer is None:
        return None
    from tokenizers.pre_tokenizers import ByteLevel
    pre = json.loads(backend.pre_tokenizer.__getstate__())
    if "ByteLevel" not in [p.get("type") for p in pre.get("pretokenizers", [pre])]:
        return None
    norm = None if backend.normalizer is None else json.loads(backend.normalizer.__getstate__()).get("type")
    if norm not in (None, "NFC"):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    if not all(b in vocab for b in ByteLevel.alphabet()):
        return None
    added = [t.content for t in backend.get_added_tokens_decoder().values()]
    most = max([len(t) for t in vocab] + [len(t.encode("utf-8")) for t in added])
    return most * (NFC_SHRINK if norm == "NFC" else 1)


def check_length(text: str, max_len: int | None, per_token: int | None, param: str = "prompt") -> None:
    """``ParamError`` when ``text`` (already checked to be valid Unicode) is certainly at least
    ``max_len`` tokens, each token standing for at most ``per_token`` bytes of it
    (:func:`bytes_per_token`): refused before the tokenizer runs. No-op without a bound."""
    if max_len is None or per_token is None or len(text) <= (max_len - 1) * per_token // 4:  # a char <= 4 bytes
        return
    n = len(text.encode("utf-8"))
    least = math.ceil(n / per_token)
    if least >= max_len:
        raise ParamError(param, f"prompt of {n} bytes of text is at least {least} tokens (a token of this tokenizer "
                                f"stands for at most {per_token} bytes), longer than max_model_len {max_len} - 1: "
                                f"refused before tokenizing")


def encode_prompt(prompt, tokenizer, mask_id: int, max_len: int | None = None,
                  per_token: int | None = None) -> tuple[list, bool]:
    """``(token ids, templated)`` of ``prompt`` (see the module doc for the forms); ``templated``:
    the chat template was applied. The ids are checked against a model by
    :func:`simsd.decoding.config.check_prompt_ids` (the vocabulary, the mask id). With
    ``max_len`` (positions) and ``per_token`` (:func:`bytes_per_token`), a text certainly too
    long for ``max_len`` is refused before it is tokenized (:func:`check_length`).

    Raises:
        ParamError: no tokenizer (or chat template) for text, bad messages, a text that spells
            the mask token, a text certainly too long (``param``: ``prompt`` or ``messages``).
    """
    if isinstance(prompt, (str, list, tuple)) and not prompt:
        raise ParamError("prompt", f"a prompt must not be empty (got an empty {type(prompt).__name__}: give token "
                                   f"ids, a text or chat messages)")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ParamError("prompt", "this checkpoint has no tokenizer: give token ids")
        check_text(prompt, tokenizer, mask_id)
        check_length(prompt, max_len, per_token)
        # verbose=False: the length against the model's positions is checked by the caller, in one line
        return tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"], False
    if is_messages(prompt):
        prompt = ChatPrompt(prompt)
    if isinstance(prompt, ChatPrompt):
        if not is_messages(prompt.messages):
            raise ParamError("messages", "a chat prompt needs a non-empty list of messages (dicts)")
        for m in prompt.messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ParamError("messages", f"each message needs a string 'role' and 'content', got {m!r}")
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ParamError("messages", "this checkpoint has no chat template: give a text prompt or ids")
        for m in prompt.messages:
            check_text(m["content"], tokenizer, mask_id, "messages")
        text = render_chat(tokenizer, prompt.messages, prompt.add_generation_prompt, prompt.continue_final_message)
        check_length(text, max_len, per_token, "messages")
        return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], True
    if is_ids(prompt):
        return list(prompt), False
    raise ParamError("prompt", f"a prompt is a string, a list of chat messages or a list of token ids, "
                               f"got {type(prompt).__name__}")


def template_stop_ids(tokenizer, mask_id: int) -> list:
    """The role markers of the tokenizer's chat template as stop ids (the mask id excluded);
    empty without a template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return []
    return sorted(set(role_markers(tokenizer)) - {mask_id})


def role_markers(tokenizer) -> list[int]:
    """Ids of the special tokens the tokenizer's chat template puts in front of a role name
    (``<|im_start|>`` in ChatML / Qwen3's template): a model that emits one has started a new
    turn, so the answer ends there, as at a stop id. Found by rendering a small conversation;
    empty without a template or when it cannot render."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return []
    roles = ("system", "user", "assistant")
    rendered = ""
    for msgs in ([{"role": r, "content": "x"} for r in roles], [{"role": r, "content": "x"} for r in roles[1:]]):
        try:
            rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            break
        except Exception:  # a template that refuses a system turn, or any other template error
            continue
    if not isinstance(rendered, str):
        return []
    special = {t: i for t, i in tokenizer.get_added_vocab().items()}
    special.update({t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens})
    return sorted({i for t, i in special.items() if t and any(t + r in rendered for r in roles)})
