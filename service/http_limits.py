"""Per-connection bounds of the HTTP server: time-outs and buffers uvicorn does not have.

uvicorn (0.5x, httptools parser) times out only an idle kept-alive connection: a client that
opens a connection and dribbles its request head one byte a second (slowloris), or sends a body
at that pace, holds its connection and its request for ever; httptools sets no bound on the
size of a head; and a client that stops reading a stream leaves the response's handler blocked
on its write for ever (uvicorn pauses writes at the transport's high-water mark and waits for
the client), with the request still running in the engine. ``protocol_class(limits)`` is
uvicorn's httptools protocol with, per connection:

* ``header_timeout_s``: from the connection's open, or a later request's first byte, to the end
  of the request head; past it ``408`` and close. A connection that sends nothing is closed too.
* ``max_header_bytes``: request line and headers; more is ``431`` and close.
* ``body_timeout_s``: from the end of the head to the end of the body; past it ``408`` and close
  (the handler waiting for the body is told the client left).
* ``send_timeout_s``: the longest the server's writes may stay paused because the client takes
  no bytes (nginx's ``send_timeout``); past it the connection is reset (``SO_LINGER`` 0), so the
  handler sees ``http.disconnect`` and the engine request is aborted, its KV blocks freed.
* ``write_buffer_bytes`` / ``send_buffer_bytes``: what a response may queue for a slow client,
  in the transport (high-water mark; the handler waits above it) and in the kernel
  (``SO_SNDBUF``; without it Linux grows a loopback socket's buffer to ``tcp_wmem``'s maximum,
  4 MiB by default). A slow reader thus holds at most about their sum plus one event.

``keep_alive_timeout_s`` and ``limit_concurrency`` are uvicorn's own settings, passed through.
Timers run on the event loop (``loop.call_later``), so tests drive them with a fake loop.
"""

from __future__ import annotations

import logging
import socket
import struct
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from stencil.engine.config import ConfigError

log = logging.getLogger("stencil.http")


@dataclass(slots=True)
class ConnectionLimits:
    """Bounds on one HTTP connection (seconds and bytes; see the module docstring).

    Attributes:
        header_timeout_s: open (or a request's first byte) to the end of the request head.
        body_timeout_s: end of the head to the end of the body.
        send_timeout_s: longest pause of the writes to a client that takes no bytes.
        keep_alive_timeout_s: idle time of a kept-alive connection (uvicorn's ``timeout_keep_alive``).
        max_header_bytes: request line plus headers.
        write_buffer_bytes: the transport's high-water mark (asyncio's default is 64 KiB).
        send_buffer_bytes: the socket's ``SO_SNDBUF`` (the kernel doubles it); None: the kernel's
            autotuning.
        limit_concurrency: connections plus running requests before uvicorn answers 503; None:
            no limit (the engine's waiting queue and 429s bound the work).
    """

    header_timeout_s: float = 20.0
    body_timeout_s: float = 30.0
    send_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_header_bytes: int = 64 << 10
    write_buffer_bytes: int = 64 << 10
    send_buffer_bytes: int | None = 128 << 10
    limit_concurrency: int | None = None

    def validate(self) -> "ConnectionLimits":
        """Check ranges; return self.

        Raises:
            stencil.engine.config.ConfigError: naming the offending field.
        """
        for name in ("header_timeout_s", "body_timeout_s", "send_timeout_s", "keep_alive_timeout_s",
                     "max_header_bytes", "write_buffer_bytes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("send_buffer_bytes", "limit_concurrency"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 or None, got {getattr(self, name)}")
        return self


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with ``limits`` (a class attribute: see ``protocol_class``)."""

    limits: ConnectionLimits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer = None
        self._body_timer = None
        self._send_timer = None
        self._in_head = True
        self._head_bytes = 0

    # -- connection --------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        lim = self.limits
        transport.set_write_buffer_limits(high=lim.write_buffer_bytes)
        sock = transport.get_extra_info("socket")
        if lim.send_buffer_bytes is not None and sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, lim.send_buffer_bytes)
            except OSError:  # not a TCP socket (a test's pipe): the kernel's default stands
                pass
        self._head_timer = self.loop.call_later(lim.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc) -> None:
        for timer in (self._head_timer, self._body_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._send_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        counting = self._in_head
        if counting:
            self._head_bytes += len(data)
        super().data_received(data)
        # Still in the head after this chunk (a chunk that ends it may carry body bytes too).
        if counting and self._in_head and self._head_bytes > self.limits.max_header_bytes:
            self._refuse(431, f"request head over {self.limits.max_header_bytes} bytes")

    # -- parser callbacks --------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._head_timer is None:  # a later request on a kept-alive connection
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        if self._body_timer is None and not self.transport.is_closing():
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # -- flow control ------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().resume_writing()

    # -- time-outs ---------------------------------------------------------------------------------
    def _response_in_progress(self) -> bool:
        return self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._response_in_progress():
            # A pipelined head waits behind the answer being written (reading is paused): its
            # clock starts again once that answer is out of the way.
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
            return
        self._refuse(408, f"request head not received within {self.limits.header_timeout_s:g} s")

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.cycle is None or not self.cycle.more_body:
            return
        self._refuse(408, f"request body not received within {self.limits.body_timeout_s:g} s")

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if not self.flow.write_paused:
            return
        log.info("dropping %s: it took no response bytes for %g s", _peer(self.client), self.limits.send_timeout_s)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # A reset, not a FIN behind the unsent bytes: the kernel frees the socket's buffers at
            # once instead of probing a zero window for minutes (an orphan socket).
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.transport.abort()  # close() would wait for the client to read the buffer

    def _refuse(self, status: int, why: str) -> None:
        """Answer ``status`` with ``why`` and close; a request being read is told the client left."""
        log.info("closing %s: %s", _peer(self.client), why)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            started = cycle.response_started
            cycle.disconnected = True  # the handler's receive() now says http.disconnect
            cycle.message_event.set()
            if started:  # mid-answer: no status line can be sent any more
                self.transport.abort()
                return
        body = why.encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), body))
        self.transport.close()


def _peer(client) -> str:
    return "%s:%d" % client if client else "a client"


def protocol_class(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """uvicorn's httptools protocol bounded by ``limits`` (pass as ``uvicorn.Config(http=...)``)."""
    return type("StencilHttpProtocol", (LimitedHttpToolsProtocol,), {"limits": limits.validate()})
