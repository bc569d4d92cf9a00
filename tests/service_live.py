"""A real uvicorn server on a free loopback port, in a background thread (for service tests)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx

from stencil.engine.config import EngineConfig
from stencil.service.app import create_app
from stencil.service.server import ServerRunner
from stencil.service.state import ServiceConfig

TINY_MODEL_NAME = "tiny"


class LiveServer:
    """``create_app(engine_config, service_config)`` served by ``ServerRunner`` on 127.0.0.1:<free port>.

    Attributes:
        url: base URL; app: the Litestar app; runner: its ``ServerRunner``; exit_code: what
            ``runner.run`` returned once the thread ended (None while it runs).
    """

    def __init__(self, engine_config, service_config=None, grace_s: float = 5.0, limits=None):
        self.limits = limits  # stencil.service.http_limits.ConnectionLimits; None: the defaults
        self.runner = ServerRunner()
        self.app = create_app(engine_config, service_config, on_engine_dead=self.runner.engine_dead)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, args=(grace_s,), daemon=True)

    def _run(self, grace_s: float) -> None:
        self.exit_code = self.runner.run(self.app, sock=self.sock, grace_s=grace_s, log_level="warning",
                                         limits=self.limits)

    def start(self, timeout_s: float = 120.0) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if not self.thread.is_alive():
                raise RuntimeError(f"server exited during startup with {self.exit_code}")
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.runner.server is not None:
            self.runner.server.should_exit = True
        self.thread.join(timeout_s)


@contextlib.contextmanager
def tiny_live_server(model_dir, num_kv_blocks: int = 128) -> Iterator[LiveServer]:
    """A started ``LiveServer`` on the tiny model as the OpenAI-route tests use it: served under the
    name ``TINY_MODEL_NAME``, 8 running sequences, ``max_tokens_cap=1024``; stopped on exit.
    ``num_kv_blocks`` is the one value those tests differ in."""
    live = LiveServer(EngineConfig(model=model_dir, num_kv_blocks=num_kv_blocks, max_num_seqs=8),
                      ServiceConfig(model_name=TINY_MODEL_NAME, max_tokens_cap=1024)).start()
    try:
        yield live
    finally:
        live.stop()


def wait_until(pred: Callable[[], bool], timeout_s: float) -> bool:
    """Polls ``pred`` every 20 ms until it is true (True) or ``timeout_s`` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False
