"""The HTTP/1.1 connection of ``simsd serve``: uvicorn's h11 protocol, whatever other parser is
installed (with the ``[ray]`` extra uvicorn would pick httptools, which reads header lines
without bound), with two bounds a server facing a network needs:

* the request head (request line and headers) is at most ``--max-header-bytes``, counted up to
  the blank line that ends it as the bytes arrive (h11's own bound, ``max_incomplete_event_size``,
  holds only while a head is incomplete: a longer head that arrives in one read would pass it); a
  longer one, an endless header line included, is answered with a 431 and the connection closed,
  having held at most that many bytes and one read;
* a request must arrive whole, head and body, within ``--request-read-timeout`` seconds of the
  connection's opening or of its first byte after a keep-alive pause (slowloris: a client that
  sends a request a byte at a time holds a connection forever otherwise): a request whose head
  is incomplete then is answered with a 408, one whose body is incomplete has its connection
  closed (the app sees the client leave).

Both answers carry OpenAI's error body (:func:`~simsd.entrypoints.openai.errors.error_body`).
"""
from __future__ import annotations

import json
import re

import h11
from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

#: the blank line that ends a request head (h11 takes a bare ``\n`` for ``\r\n`` too)
HEAD_END = re.compile(b"\n\r?\n")


def raw_response(status: int, reason: str, message: str) -> bytes:
    """An HTTP/1.1 response with OpenAI's error body for ``message`` that closes the connection
    (written as bytes: h11 sends no response before it has read a request)."""
    body = json.dumps(error_body(message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode() + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a bounded head (431, see the module doc) and a deadline of
    :attr:`read_timeout` seconds for each request to arrive whole (408 or closed). A subclass
    of :func:`connection_class` sets the deadline."""

    read_timeout: float = 60.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.read_deadline = None  # the timer of the request being read (None: none is)
        self.head = b""  # the bytes of the request head received so far (not ended yet)
        self.arm_read_deadline()

    def arm_read_deadline(self) -> None:
        if self.read_deadline is None:
            self.read_deadline = self.loop.call_later(self.read_timeout, self.on_read_timeout)

    def disarm_read_deadline(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # a request head is arriving
            self.arm_read_deadline()  # (from its first byte after a keep-alive pause)
            if self.head_too_long(data):
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self.head = b""
            if self.conn.their_state is not h11.SEND_BODY:
                self.disarm_read_deadline()  # the request has arrived whole (or the connection is done)

    def head_too_long(self, data: bytes) -> bool:
        """Whether the head, with ``data``, passes the limit before its end (then answered with
        a 431 and the connection closed)."""
        limit = self.config.h11_max_incomplete_event_size or h11_impl.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        head = self.head + data
        end = HEAD_END.search(head)
        if (end.end() if end else len(head)) <= limit:
            self.head = b"" if end else head
            return False
        self.transport.write(raw_response(431, "Request Header Fields Too Large", f"the request head (request line "
                                          f"and headers) exceeds the server's limit of {limit} bytes (simsd serve "
                                          f"--max-header-bytes)"))
        self.transport.close()
        return True

    def connection_lost(self, exc) -> None:
        self.disarm_read_deadline()
        super().connection_lost(exc)

    def on_read_timeout(self) -> None:
        self.read_deadline = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:  # the head has not arrived: nothing answered it yet
            self.transport.write(raw_response(408, "Request Timeout", f"the request did not arrive whole within "
                                              f"{self.read_timeout:g} s (simsd serve --request-read-timeout)"))
        self.transport.close()  # a body still being sent: the app is told the client has gone


def connection_class(read_timeout: float) -> type:
    """:class:`BoundedH11Protocol` with a read deadline of ``read_timeout`` seconds, for
    ``uvicorn.Config(http=...)`` (the head's bound is the config's
    ``h11_max_incomplete_event_size``, which h11 applies too)."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"read_timeout": float(read_timeout)})
