"""Behaviour that needs a real server and real sockets: client disconnects, engine death, the example."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from stencil.engine.config import EngineConfig
from stencil.service.state import service_state
from stencil.service.state import ServiceConfig
from service_live import LiveServer

ROOT = Path(__file__).resolve().parents[2]
LONG = {"prompt": "go", "regex": "[ab]{4000}", "max_tokens": 1000, "close_on_budget": False}  # can only end by length or abort
# 2,000 tokens (the a/b tokens average 2.1 characters): seconds of decoding even on the tiny model,
# so a loaded machine's client still finds it running when it reads its first delta.
LONGER = {"prompt": "go", "regex": "[ab]{6000}", "max_tokens": 2000, "close_on_budget": False}


def _wait(pred, timeout_s: float = 10.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return False


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = LiveServer(EngineConfig(model=tiny_model_dir, num_kv_blocks=256),
                     ServiceConfig(max_tokens_cap=2048)).start()
    yield srv
    srv.stop()


def _http_count(srv, endpoint: str, status: str) -> float:
    m = service_state(srv.app).metrics.requests
    return sum(s.value for fam in m.collect() for s in fam.samples
               if s.name.endswith("_total") and s.labels == {"endpoint": endpoint, "status": status})


def _finished_total(srv) -> float:
    m = service_state(srv.app).metrics.finished
    return sum(s.value for fam in m.collect() for s in fam.samples if s.name.endswith("_total"))


def test_client_disconnect_aborts_and_frees_blocks(server):
    aeng = service_state(server.app).engine
    eng = aeng.engine
    # An earlier test's request may still be ending on a loaded machine: start from an idle engine.
    assert _wait(lambda: eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0)
    finished_before = _finished_total(server)
    dropped_before = _http_count(server, "/generate", "499")
    # The engine holds still after the step that makes the first text, until the client's hang-up
    # reaches its inbox: however slow this machine is, the request is running when the client
    # leaves (a free-running engine could finish all 2,000 tokens before a starved client reads).
    gate, hold = threading.Event(), threading.Event()
    gate.set()
    hold.set()
    plain_step = eng.step

    def gated_step():
        assert gate.wait(60), "the test never released the engine"
        outs = plain_step()
        if hold.is_set() and any(o.new_text for o in outs):
            gate.clear()
        return outs

    eng.step = gated_step
    try:
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", server.url + "/generate", json={**LONGER, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"delta"' in line:
                        break  # one delta seen: the request is running; now hang up
                assert not gate.is_set()
                assert eng.stats()["running"] == 1 and eng.stats()["kv_blocks_free"] < 256
        assert _wait(lambda: not aeng._inbox.empty())  # the server saw the hang-up and asked to abort
    finally:
        hold.clear()
        gate.set()
        del eng.step
    assert _wait(lambda: eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0)
    assert _wait(lambda: eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"])
    # Aborted, not run to its 2000 tokens: a finished request would have been counted.
    assert _finished_total(server) == finished_before
    # Counted as the client's hang-up (499), not as the 200 its headers carried.
    assert _wait(lambda: _http_count(server, "/generate", "499") == dropped_before + 1)
    # And the server goes on serving.
    ok = httpx.post(server.url + "/generate", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def _hang_up_after_headers(url: str, path: str, body: dict) -> bytes:
    """POST ``body`` as a stream, read until the response headers, then reset the connection."""
    import socket
    import struct

    host, port = httpx.URL(url).host, httpx.URL(url).port
    payload = json.dumps(body).encode()
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(200)
            if not chunk:
                break
            head += chunk
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
    return head


@pytest.mark.parametrize("path, body", [
    ("/generate", {**LONGER, "stream": True}),
    ("/v1/completions", {"prompt": "go", "max_tokens": 2000, "stream": True,
                         "structured_outputs": {"regex": "[ab]{6000}"}}),
])
def test_streams_abandoned_right_after_the_headers_are_aborted(server, path, body):
    """A client that leaves as soon as the headers arrive: the body is cancelled before it takes
    its first item, so the stream's own cleanup never runs; the response's background task must
    abort the engine request (before it did, 9 in 10 such requests ran on, then were held for
    ever by flow control with their KV blocks)."""
    eng = service_state(server.app).engine.engine
    assert _wait(lambda: eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0)
    if path.startswith("/v1"):
        body = {**body, "model": httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]}
    for _ in range(10):
        assert _hang_up_after_headers(server.url, path, body).startswith(b"HTTP/1.1 200")
    assert _wait(lambda: eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0, timeout_s=30)
    assert _wait(lambda: eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"])
    assert service_state(server.app).inflight == 0


def test_non_streamed_client_timeout_aborts(server):
    eng = service_state(server.app).engine.engine
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", json=LONG, timeout=0.5)
    assert _wait(lambda: eng.stats()["running"] == 0 and eng.stats()["kv_blocks_free"] == 256)


def test_example_extract_runs(server):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "extract.py"), "--url", server.url,
                           "--max-tokens", "200"], capture_output=True, text=True, timeout=120)
    # The tiny model's words are random, but the answer must be a schema-valid, typed Person.
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Person(name=")


def test_engine_death_fails_inflight_and_exits_nonzero(tiny_model_dir):
    srv = LiveServer(EngineConfig(model=tiny_model_dir, num_kv_blocks=64), ServiceConfig()).start()
    eng = service_state(srv.app).engine
    results: dict = {}

    def plain():
        results["plain"] = httpx.post(srv.url + "/generate", json=LONG, timeout=30)

    def streamed():
        with httpx.stream("POST", srv.url + "/generate", json={**LONG, "stream": True}, timeout=30) as r:
            results["stream"] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    assert _wait(lambda: eng.engine.stats()["running"] == 2)

    def boom():
        raise RuntimeError("simulated device fault")

    eng.engine.step = boom
    for t in threads:
        t.join(60)  # (a guard: the answers come at once)
    assert not any(t.is_alive() for t in threads), "in-flight requests hung after the engine died"
    assert results["plain"].status_code == 503 and "died" in results["plain"].json()["detail"]
    events = results["stream"]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["type"] == "error" and last["error"]["status"] == 503
    srv.thread.join(20)
    assert srv.exit_code == 1


def test_sigterm_drains_then_tells_a_stream_still_running_that_the_server_stops(tiny_model_dir):
    """A stop signal: new work on an open connection gets a 503; a stream still running
    when the grace period ends gets an in-band 503 "shutting down" and ``[DONE]`` (not a cut
    connection), and the process exits 0."""
    import signal

    srv = LiveServer(EngineConfig(model=tiny_model_dir, num_kv_blocks=256), ServiceConfig(max_tokens_cap=4096),
                     grace_s=1.0).start()
    lines: list[str] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/generate", json={**LONGER, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    first.set()

    with httpx.Client(base_url=srv.url, timeout=30) as open_conn:
        assert open_conn.get("/health").status_code == 200  # a kept-alive connection, open before the signal
        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(120)
        srv.runner.server.handle_exit(signal.SIGTERM, None)
        r = open_conn.post("/generate", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.text, r.text
    t.join(60)
    assert not t.is_alive()
    assert lines[-1] == "[DONE]"
    end = json.loads(lines[-2])
    assert end["type"] == "error" and end["error"]["status"] == 503, end
    assert "shutting down" in end["error"]["detail"], end
    srv.thread.join(30)
    assert srv.exit_code == 0
