"""Request bodies of the OpenAI-compatible endpoints (pydantic) and their translation into
:class:`~simsd.entrypoints.params.SamplingParams`.

Fields follow OpenAI's Completions and Chat Completions APIs. Unknown fields are refused
(400 naming the field): nothing a client asks for is silently ignored. OpenAI fields simsd
cannot honour are accepted only at their neutral value (``n=1``, ``echo=false``,
``logprobs`` off, penalties 0, no ``logit_bias``, no tools, text responses). simsd's own
per-request fields: ``top_k``, ``stop_token_ids``, ``ignore_eos``, ``steps``, ``strategy``,
``threshold``, ``gamma``, ``draft_strategy``, ``draft_threshold`` (see :class:`SamplingParams`).
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import ParamError
from .params import SamplingParams


class _Body(BaseModel):
    # strict: no coercion ("5" or true are not a max_tokens); unknown fields are refused
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None
    # simsd's per-request fields
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    steps: int | None = None
    strategy: str | None = None
    threshold: float | None = None
    gamma: int | None = None
    draft_strategy: str | None = None
    draft_threshold: float | None = None

    def check_unsupported(self) -> None:
        """``ParamError`` for OpenAI features away from their neutral value (``n``: checked by
        :class:`SamplingParams`)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ParamError(name, f"{name} is not supported by simsd (got {getattr(self, name)})")
        if self.logit_bias:
            raise ParamError("logit_bias", "logit_bias is not supported by simsd")
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
        given = {}
        mt = self.max_tokens if max_tokens is None else max_tokens
        if mt is not None:
            given["max_tokens"] = mt
        for name in ("n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "steps",
                     "strategy", "threshold", "gamma", "draft_strategy", "draft_threshold"):
            value = getattr(self, name)
            if value is not None:
                given[name] = value
        if "strategy" in given and "threshold" not in given:
            given["threshold"] = None
        if ("strategy" in given or "draft_strategy" in given) and "draft_threshold" not in given:
            given["draft_threshold"] = None
        return dataclasses.replace(defaults, **given)


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids
    or a list of lists of token ids (one choice per prompt)."""
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise ParamError("echo", "echo is not supported by simsd")
        if self.logprobs is not None:
            raise ParamError("logprobs", "logprobs are not supported by simsd")
        if self.best_of not in (None, 1):
            raise ParamError("best_of", f"best_of must be 1, got {self.best_of}")
        if self.suffix is not None:
            raise ParamError("suffix", "suffix is not supported by simsd")

    def prompts(self) -> list:
        """The prompts, one per choice (strings or lists of ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ParamError("prompt", "the prompt is empty")
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

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
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: the messages go through the checkpoint's chat template."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs or self.top_logprobs is not None:
            raise ParamError("logprobs", "logprobs are not supported by simsd")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ParamError("response_format", "only text responses are supported by simsd")
        if self.tools:
            raise ParamError("tools", "tools are not supported by simsd")
        if self.tool_choice not in (None, "none"):
            raise ParamError("tool_choice", "tools are not supported by simsd")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ParamError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None = None) -> SamplingParams:
        return super().sampling_params(defaults, self.max_completion_tokens)

    def chat(self) -> list:
        return [m.as_dict() for m in self.messages]
