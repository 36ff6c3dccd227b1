"""Request bodies of the OpenAI-compatible endpoints (pydantic) and their translation into
:class:`~simsd.config.request.SamplingParams`.

Fields follow OpenAI's Completions and Chat Completions APIs. Unknown fields are refused
(400 naming the field): nothing a client asks for is silently ignored. OpenAI fields simsd
cannot honour are accepted only at their neutral value (no ``logit_bias``, no tools, text
responses; a JSON ``response_format`` is refused naming it). ``n`` (at most
:data:`~simsd.config.request.MAX_N`), a completion's ``echo`` and log-probabilities (a
completion's ``logprobs: k``, with ``echo`` the prompt's too; chat's ``logprobs: true`` with
``top_logprobs: k``; :meth:`_Common.logprob_fields`) are served
(:mod:`simsd.entrypoints.openai.serving`). Every field of
:class:`SamplingParams` is a request field under its name (generated from it: OpenAI's
``max_tokens``, ``temperature``, ``top_p``, ``n``, ``seed``, ``stop``, ``presence_penalty``,
``frequency_penalty``, vLLM's ``repetition_penalty``, and simsd's ``top_k``,
``stop_token_ids``, ``ignore_eos``, ``steps``, ``strategy``, ``threshold``, ``gamma``,
``draft_strategy``, ``draft_threshold``); the server's defaults fill what a request leaves out.

A body is parsed and validated by :func:`parse_request`, which the server runs in a worker
thread, and the work a bad body costs is bounded: validation reports the first unknown field of
an object only, and stops a list at its first bad item (pydantic's ``fail_fast``), so a body of
400,000 unknown fields or bad messages builds one error, not 400,000.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Annotated, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    FailFast,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from ...config.request import SamplingParams
from ...config.vllm_names import STRUCTURED, TEXT
from ...config.vocabulary import settings_of
from ..encoding import ChatPrompt
from ..errors import ParamError


class _FailFast(FailFast):
    """pydantic's ``FailFast`` (a list's validation stops at its first bad item), hashable so that
    it can sit in a ``Union``."""
    __hash__ = object.__hash__


FAIL_FAST = _FailFast()


def many(kind):
    """A list of ``kind`` whose validation stops at the first bad item."""
    return Annotated[list[kind], FAIL_FAST]


class _Body(BaseModel):
    # strict: no coercion ("5" or true are not a max_tokens); unknown fields are refused
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """An explicit ``null`` means the field's default, as OpenAI types its optional fields
        (SDK wrappers send ``null`` for what they leave unset). Of the unknown fields only the
        first is kept, to be refused by name: one error however many there are."""
        if not isinstance(data, dict):
            return data
        fields, kept, unknown = cls.model_fields, {}, False
        for k, v in data.items():
            if k not in fields:
                if not unknown:
                    kept[k], unknown = v, True
            elif v is not None:
                kept[k] = v
        return kept


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAI(_Body):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict | None = None
    user: str | None = None
    response_format: dict | None = None


def _json_type(setting):
    kind = setting.kind
    return Union[kind, many(kind), None] if setting.many else Union[kind, None]


#: the request fields: OpenAI's, and every field of :class:`SamplingParams` (None: the server's default)
_Fields = create_model("_Fields", __base__=_OpenAI,
                       **{name: (_json_type(s), None) for name, s in settings_of(SamplingParams).items()})


#: the range of a request's top log-probabilities (``SamplingParams.logprobs``'s)
LOGPROBS = settings_of(SamplingParams)["logprobs"]


class _Common(_Fields):
    #: OpenAI features simsd does not have, and the values that ask for none of them
    NEUTRAL: ClassVar[dict] = {"logit_bias": (None, {})}

    def check_unsupported(self) -> None:
        """``ParamError`` for OpenAI features away from their neutral value (``n``: checked by
        :class:`SamplingParams`); a ``response_format`` other than ``{"type": "text"}`` (JSON,
        a JSON schema) in every mode, saying why (:data:`~simsd.config.vllm_names.STRUCTURED`)."""
        if self.response_format not in (None, TEXT):
            raise ParamError("response_format", f"response_format {json.dumps(self.response_format)} is not "
                                                f"supported: {STRUCTURED} (only {json.dumps(TEXT)} is accepted)")
        for name, neutral in self.NEUTRAL.items():
            if getattr(self, name) not in neutral:
                raise ParamError(name, f"{name} is not supported by simsd (got {json.dumps(getattr(self, name))}; "
                                       f"leave it out)")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options needs stream: true")

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None = None) -> SamplingParams:
        """The request's :class:`SamplingParams`: the server's ``defaults`` with the fields the
        request gives (a request that names a ``strategy`` and no ``threshold`` gets that
        strategy's default threshold; one that names a ``strategy`` or ``draft_strategy`` and no
        ``draft_threshold`` gets the draft strategy's default rule).

        Raises:
            ParamError: a field out of range (named).
        """
        self.check_unsupported()
        given = {name: getattr(self, name) for name in settings_of(SamplingParams) if getattr(self, name) is not None}
        given.update(self.logprob_fields())
        if max_tokens is not None:
            given["max_tokens"] = max_tokens
        if "strategy" in given and "threshold" not in given:
            given["threshold"] = None
        if ("strategy" in given or "draft_strategy" in given) and "draft_threshold" not in given:
            given["draft_threshold"] = None
        return dataclasses.replace(defaults, **given)

    def logprob_fields(self) -> dict:
        """The :class:`SamplingParams` log-probability fields the request asks for in OpenAI's
        spelling (``logprobs``, ``prompt_logprobs``; only those it gives)."""
        return {}


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids
    or a list of lists of token ids (``n`` choices per prompt); ``echo``: each choice's text
    starts with its prompt's (a token id prompt's decoded); ``logprobs: k``: each token's
    log-probability and the ``k`` most likely (OpenAI's legacy ``logprobs`` object; with ``echo``
    the prompt's tokens too, the first one's None, as vLLM); ``prompt_logprobs: k`` (vLLM's):
    the prompt's, in each choice's ``prompt_logprobs``."""
    prompt: Union[str, many(str), many(int), many(many(int))]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    NEUTRAL: ClassVar[dict] = {**_Common.NEUTRAL, "best_of": (None, 1), "suffix": (None,)}

    def logprob_fields(self) -> dict:
        if self.echo and self.logprobs is not None and self.prompt_logprobs is None:
            return {"prompt_logprobs": self.logprobs}
        return {}

    def prompts(self) -> list:
        """The prompts, ``n`` choices each (strings or lists of ids; an empty list is one empty prompt)."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, many(TextPart), None] = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("content", mode="after")
    @classmethod
    def _user_needs_text(cls, value, info: ValidationInfo):
        if info.data.get("role") == "user" and (value is None or value == []):
            raise ValueError("a user message needs content: a string, or parts of type 'text' (OpenAI's rule)")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"only text content is supported (a string, or parts of type 'text'), got a "
                                     f"part of type {kind!r}")
        return value

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:  # the chat template sees it, as simsd's API passes it
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: the messages go through the checkpoint's chat template, with
    vLLM's ``add_generation_prompt`` (open a new assistant turn: the default) or
    ``continue_final_message`` (continue the final message, e.g. a prefilled assistant reply;
    :class:`~simsd.entrypoints.encoding.ChatPrompt`)."""
    messages: many(ChatMessage) = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    NEUTRAL: ClassVar[dict] = {**_Common.NEUTRAL, "tools": (None, []), "tool_choice": (None, "none"),
                               "prompt_logprobs": (None,)}

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ParamError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not LOGPROBS.ok(self.top_logprobs):
            raise ParamError("top_logprobs", f"top_logprobs is {LOGPROBS.valid()}, got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true (OpenAI's rule)")

    def logprob_fields(self) -> dict:
        """``logprobs: true`` with ``top_logprobs: k`` (0 when left out) is ``SamplingParams(logprobs=k)``."""
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {"logprobs": None}

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None = None) -> SamplingParams:
        return super().sampling_params(defaults, self.max_completion_tokens)

    def chat(self) -> list:
        return [m.as_dict() for m in self.messages]

    def prompts(self) -> list:
        """The prompts (one), ``n`` choices each: the messages and the template's options.

        Raises:
            ParamError: ``continue_final_message`` with ``add_generation_prompt``.
        """
        return [ChatPrompt(self.chat(), self.add_generation_prompt, self.continue_final_message)]


def parse_request(model, raw: bytes):
    """The request body ``raw`` (JSON bytes) as ``model`` (:class:`CompletionRequest` or
    :class:`ChatCompletionRequest`). Bounded work (see the module doc); the server runs it in a
    worker thread, so a large body's parsing and validation never hold up the event loop.

    Raises:
        ParamError: malformed JSON (``param`` None) or the first validation error (``param``:
            the field's dotted path, e.g. ``messages.0.role``).
    """
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ParamError(None, f"malformed JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise ParamError(None, f"malformed JSON: the body is not UTF-8 (byte {exc.start})") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise first_error(exc) from None


def first_error(exc: ValidationError) -> ParamError:
    """The first error of a validation as a :class:`ParamError` naming the field by its dotted
    path (union members, which pydantic puts in the location as their type, left out)."""
    err = exc.errors(include_url=False)[0]
    loc = [str(x) for x in err.get("loc", ()) if not is_type_tag(str(x))]
    param = ".".join(loc) or None
    msg = err.get("msg", "bad request").removeprefix("Value error, ")
    return ParamError(param, f"{param}: {msg}" if param else msg)


def is_type_tag(part: str) -> bool:
    """Whether a pydantic error location part names a union member's type, not a field."""
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")
