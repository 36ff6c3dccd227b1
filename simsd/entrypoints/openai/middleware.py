"""The server's ASGI middleware: the request body limit (:class:`BodyLimit`) and the API key
(:class:`APIKeyAuth`). Both answer with OpenAI's error body
(:func:`~simsd.entrypoints.openai.errors.error_response`)."""
from __future__ import annotations

import hmac

from fastapi import HTTPException
from starlette.datastructures import URL, Headers

from .errors import error_response


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is a 413 with OpenAI's body, at once
    when ``Content-Length`` says so, else as soon as the bytes received pass it (a chunked body
    is never read past the limit)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def message(self) -> str:
        return f"the request body exceeds the server's limit of {self.limit} bytes (simsd serve --max-request-bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await error_response(413, self.message())(scope, receive, send)
        total = 0

        async def limited():
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.limit:
                    raise HTTPException(413, self.message())  # FastAPI passes it on to the handler below
            return message
        return await self.app(scope, limited, send)


class APIKeyAuth:
    """ASGI middleware: every ``/v1/*`` request but a CORS preflight (``OPTIONS``) needs
    ``Authorization: Bearer <api_key>`` (compared in constant time); otherwise a 401 with OpenAI's
    body, code ``invalid_api_key``, and ``WWW-Authenticate: Bearer``. Other paths (``/health``,
    ``/metrics``, the docs) stay open."""

    def __init__(self, app, api_key: str):
        self.app, self.want = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and URL(scope=scope).path.startswith("/v1/") and scope["method"] != "OPTIONS":
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.want):
                response = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                          headers={"WWW-Authenticate": "Bearer"}, code="invalid_api_key")
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
