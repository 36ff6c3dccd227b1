"""The server's limits and grace periods that its options default to (``simsd serve``), and the
check of its API key. Torch-free."""
from __future__ import annotations

from .vocabulary import ParamError, opt

#: the server's default request body limit (``simsd serve --max-request-bytes``): far above any
#: prompt a context holds (a 128k-token prompt as JSON ids is under 1 MiB), far below the memory
#: a body costs
MAX_REQUEST_BYTES = 8 * 2 ** 20
#: the largest request head, request line and headers (``simsd serve --max-header-bytes``): h11's
#: and Node's default; an OpenAI client's head is under 1 KiB
MAX_HEADER_BYTES = 16 * 2 ** 10
#: seconds a client has to send a whole request, head and body (``simsd serve
#: --request-read-timeout``; nginx's client_header_timeout is 60 s)
REQUEST_READ_TIMEOUT = 60.0
#: seconds the requests in flight may take to finish after SIGTERM/SIGINT before the server
#: cancels them (``simsd serve --shutdown-timeout``; Kubernetes' default grace period is 30 s)
SHUTDOWN_TIMEOUT = 30.0
#: seconds a scheduler round may run before ``/health`` reports a stuck engine (``simsd serve
#: --round-timeout``; vLLM's engine iteration timeout is 60 s)
ROUND_TIMEOUT = 60.0
#: seconds between the keep-alive comments of a stream that has nothing to send (a request waiting
#: for a row, a slow round): proxies close connections idle for 60 s (nginx, AWS ALB)
SSE_KEEPALIVE = 15.0


def check_api_key(key: str, where: str | None = None) -> str:
    """``key`` unless a client could never send it as ``Authorization: Bearer <key>``: HTTP header
    values are ASCII and the server strips the spaces around the token, so the key must be
    printable ASCII, not empty and without a space at either end. ``where``: what set it (default:
    the ``api_key`` setting).

    Raises:
        ParamError: naming ``api_key`` and the first character that cannot be sent.
    """
    where = where or opt("api_key")
    if not key.strip():
        raise ParamError("api_key", f"{where} is empty (any 'Bearer' header would match): give a key, or none")
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:
        raise ParamError("api_key", f"{where} must be printable ASCII (a client sends it in an HTTP header, which "
                                    f"carries ASCII: this key could never match), character {bad} is {key[bad]!r}")
    if key != key.strip():
        raise ParamError("api_key", f"{where} must not begin or end with a space (the server strips them from the "
                                    f"header's token: this key could never match)")
    return key
