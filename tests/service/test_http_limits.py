"""Per-connection time-outs and buffers (``stencil.service.http_limits``).

The protocol is driven with a fake event loop whose timers fire when the test says, and a fake
transport that records what is written: no test waits on the wall clock. One live test on the
tiny model: a client that stops reading its stream is dropped, its request aborted, its KV
blocks freed.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from uvicorn.server import ServerState

from stencil.engine.config import ConfigError, EngineConfig
from stencil.service.http_limits import ConnectionLimits, protocol_class
from stencil.service.state import ServiceConfig
from service_live import LiveServer


class FakeTimer:
    def __init__(self, delay: float, callback):
        self.delay, self.callback, self.cancelled = delay, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """``call_later`` records timers (fired by ``fire``); ``create_task`` records ASGI runs."""

    def __init__(self):
        self.timers: list[FakeTimer] = []
        self.tasks: list = []

    def call_later(self, delay, callback, *args):
        timer = FakeTimer(delay, lambda: callback(*args))
        self.timers.append(timer)
        return timer

    def pending(self) -> list[FakeTimer]:
        return [t for t in self.timers if not t.cancelled and not getattr(t, "fired", False)]

    def fire(self, delay: float) -> None:
        """Run the pending timers set for ``delay`` seconds."""
        due = [t for t in self.pending() if t.delay == delay]
        assert due, f"no timer of {delay} s pending: {[t.delay for t in self.pending()]}"
        for t in due:
            t.fired = True
            t.callback()

    def create_task(self, coro, **_):
        coro.close()  # the app is not run: these tests are about the connection

        class Task:
            def add_done_callback(self, fn):
                pass
        self.tasks.append(coro)
        return Task()


class FakeTransport:
    def __init__(self):
        self.written = bytearray()
        self.closed = self.aborted = False
        self.high_water = None

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self.high_water = high

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5555), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


LIMITS = ConnectionLimits(header_timeout_s=7.0, body_timeout_s=11.0, send_timeout_s=13.0, max_header_bytes=1024,
                          write_buffer_bytes=4096)


async def _app(scope, receive, send):  # never run (FakeLoop.create_task)
    raise AssertionError


def _connection(limits: ConnectionLimits = LIMITS):
    loop = FakeLoop()
    proto = protocol_class(limits)(config=uvicorn.Config(_app), server_state=ServerState(), app_state={}, _loop=loop)
    transport = FakeTransport()
    proto.connection_made(transport)
    return proto, transport, loop


def test_head_dribbled_in_gets_408_at_the_header_timeout():
    proto, transport, loop = _connection()
    assert transport.high_water == 4096
    assert [t.delay for t in loop.pending()] == [7.0]  # armed at connect: a silent client is timed too
    for byte in b"POST /generate HTTP/1.1\r\nHost: x\r\n":  # one byte at a time, never the blank line
        proto.data_received(bytes([byte]))
    assert not transport.closed
    loop.fire(7.0)
    assert transport.written.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and b"connection: close" in transport.written
    assert transport.closed and not loop.tasks  # no request reached the app


def test_connection_that_sends_nothing_is_closed():
    proto, transport, loop = _connection()
    loop.fire(7.0)
    assert transport.closed and b"408" in transport.written


def test_complete_head_cancels_the_header_timer_and_runs_the_request():
    proto, transport, loop = _connection()
    proto.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert len(loop.tasks) == 1
    assert loop.pending() == []  # head timer cancelled; no body to wait for
    assert not transport.closed


def test_head_over_the_limit_is_431():
    proto, transport, loop = _connection()
    proto.data_received(b"GET / HTTP/1.1\r\n")
    proto.data_received(b"X-Pad: " + b"a" * 1100 + b"\r\n")
    assert transport.written.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert transport.closed and not loop.tasks


def test_large_body_after_a_small_head_is_not_counted_as_head():
    proto, transport, loop = _connection()
    body = b"x" * 5000
    proto.data_received(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + body)
    assert not transport.closed and len(loop.tasks) == 1


def test_body_not_finished_in_time_gets_408_and_the_handler_is_told():
    proto, transport, loop = _connection()
    proto.data_received(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
    assert [t.delay for t in loop.pending()] == [11.0]
    cycle = proto.cycle
    loop.fire(11.0)
    assert b"HTTP/1.1 408" in transport.written and transport.closed
    assert cycle.disconnected  # the handler's receive() says http.disconnect


def test_body_in_time_cancels_the_body_timer():
    proto, transport, loop = _connection()
    proto.data_received(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nabc")
    proto.data_received(b"def")
    assert loop.pending() == [] and not transport.closed


def test_stalled_reader_is_dropped_at_the_send_timeout():
    proto, transport, loop = _connection()
    proto.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    proto.pause_writing()  # the transport's buffer passed its high-water mark
    assert [t.delay for t in loop.pending()] == [13.0]
    proto.resume_writing()  # the client read: the clock stops
    assert loop.pending() == []
    proto.pause_writing()
    loop.fire(13.0)
    assert transport.aborted  # reset, not close(): close would wait for the client to read


def test_later_request_on_a_kept_alive_connection_has_its_own_header_timer():
    proto, transport, loop = _connection()
    proto.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    proto.cycle.response_complete = True  # as uvicorn marks it once the answer is written
    proto.data_received(b"GET /hea")
    assert [t.delay for t in loop.pending()] == [7.0]
    loop.fire(7.0)
    assert b"408" in transport.written and transport.closed


def test_limits_are_validated():
    with pytest.raises(ConfigError, match="send_timeout_s"):
        ConnectionLimits(send_timeout_s=0).validate()
    with pytest.raises(ConfigError, match="send_buffer_bytes"):
        ConnectionLimits(send_buffer_bytes=-1).validate()
    assert ConnectionLimits(send_buffer_bytes=None, limit_concurrency=10).validate().limit_concurrency == 10


# -- live: a client that stops reading ------------------------------------------------------------

def _metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_client_that_stops_reading_is_dropped_and_its_request_aborted(tiny_model_dir):
    limits = ConnectionLimits(send_timeout_s=0.5, write_buffer_bytes=4096, send_buffer_bytes=4096)
    srv = LiveServer(EngineConfig(model=tiny_model_dir, num_kv_blocks=256, max_num_seqs=4),
                     ServiceConfig(max_tokens_cap=1500), limits=limits).start()
    try:
        body = (b'{"messages": [{"role": "user", "content": "Say a lot."}], "max_tokens": 1500, "temperature": 0,'
                b' "stream": true, "logprobs": true, "top_logprobs": 20}')
        client = socket.socket()
        # A small receive window: the server's buffers, not the client's, fill up.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        # ... and never reads. The server must drop it and abort the request well before its 1500
        # tokens are written (the tiny model needs seconds for them; the bound is the send timeout).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            h = httpx.get(srv.url + "/health", timeout=10).json()
            if (_metric(srv.url, "stencil_http_requests_total", status="499") >= 1 and h["inflight"] == 0
                    and h["engine"]["running"] == 0):
                break
            time.sleep(0.1)
        e = h["engine"]
        assert h["inflight"] == 0 and e["running"] == 0 and e["waiting"] == 0
        assert e["kv_blocks_free"] == e["kv_blocks_total"]
        # Aborted, not finished: no finished request counted its tokens.
        assert _metric(srv.url, "stencil_completion_tokens_total") == 0
        assert _metric(srv.url, "stencil_http_requests_total", endpoint="/v1/chat/completions", status="499") == 1
        # The client finds what was buffered, then a reset or an end without [DONE].
        client.settimeout(10)
        received = bytearray()
        try:
            while chunk := client.recv(65536):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        client.close()
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
        # The server still serves.
        r = httpx.post(srv.url + "/generate", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
    finally:
        srv.stop()
