"""Log-probabilities in OpenAI's response shapes (vLLM's ``serving_completion`` /
``serving_chat``), from the API's per-token dicts ``{token_id: Logprob}`` (the token first, then
the top k; :attr:`simsd.RequestOutput.logprobs`, :mod:`simsd.decoding.logprobs` for what they are).

* a completion's ``logprobs`` (OpenAI's legacy object): ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (per token ``{text: logprob}`` of the token and the top k) and ``text_offset``
  (each token's first character in the choice's text); with ``echo`` the prompt's tokens come
  first, the first one with ``null`` log-probabilities (:func:`completion_logprobs`);
* a chat choice's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [{token,
  logprob, bytes}, ...]}]}``, the top k in rank order (:func:`chat_logprobs`);
* vLLM's ``prompt_logprobs``: per prompt token ``null`` or ``{token_id: {logprob, rank,
  decoded_token}}`` (:func:`prompt_logprobs_json`).

A log-probability of ``-inf`` (the MASK token, which no step reveals, if it falls among the top k)
is sent as ``-9999.0``, as vLLM does (JSON has no infinity).
"""
from __future__ import annotations

import math


def _finite(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else x


def _text(logprob, token_id: int) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def completion_logprobs(tokens: list, start: int = 0, decode=None) -> dict:
    """OpenAI's legacy ``logprobs`` object of ``tokens``: ``(token_id, {token_id: Logprob} or
    None)`` pairs (None: a prompt's first token, its text ``decode(token_id)``, "" when ``decode``
    is None); ``start``: the text offset of the first token (the characters of the choice's text
    before it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = start
    for token_id, d in tokens:
        if d is None:
            text, lp, top = None if decode is None else decode(token_id), None, None
        else:
            text, lp = _text(d[token_id], token_id), _finite(d[token_id].logprob)
            top = {_text(v, t): _finite(v.logprob) for t, v in d.items()}
        text = text if text is not None else ""
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokens: list, k: int) -> dict:
    """A chat choice's ``logprobs`` of ``tokens`` (``(token_id, {token_id: Logprob})`` pairs): each
    token with its ``k`` most likely alternatives (ranks 1..k)."""
    def item(t, v) -> dict:
        text = _text(v, t)
        return {"token": text, "logprob": _finite(v.logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, d in tokens:
        top = sorted(((v.rank, t, v) for t, v in d.items() if v.rank is not None and v.rank <= k))
        content.append({**item(token_id, d[token_id]), "top_logprobs": [item(t, v) for _, t, v in top]})
    return {"content": content}


def prompt_logprobs_json(prompt_logprobs: list) -> list:
    """vLLM's ``prompt_logprobs`` of a response: per prompt token None or ``{token_id: {logprob,
    rank, decoded_token}}``."""
    return [None if d is None else {str(t): {"logprob": _finite(v.logprob), "rank": v.rank,
                                             "decoded_token": v.decoded_token} for t, v in d.items()}
            for d in prompt_logprobs]
