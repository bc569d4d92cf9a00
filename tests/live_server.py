"""A real Stencil server on a free loopback port, for tests that need real HTTP (the ``openai``
package, the typed client, the examples run as subprocesses).

uvicorn runs in a daemon thread of the test process; the app is ``create_app`` (OpenAI-compatible
routes included) over a small KV cache.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from engine.config import EngineConfig
from service.app import create_app
from service.state import ServiceConfig

MODEL_NAME = "tiny"


@dataclass(slots=True)
class LiveServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_live_server(model_dir: Path, *, num_kv_blocks: int = 96, startup_timeout_s: float = 120.0,
                      **service_options) -> LiveServer:
    """Serve ``model_dir`` on 127.0.0.1 at a free port; return once ``/health`` answers 200.

    Raises:
        RuntimeError: the server did not come up within ``startup_timeout_s``.
    """
    engine = EngineConfig(model=model_dir, num_kv_blocks=num_kv_blocks, max_num_seqs=8,
                          max_num_batched_tokens=512)
    app = create_app(engine, ServiceConfig(model_name=MODEL_NAME, **service_options), include_openai=True)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="on", log_config=None, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError("the server thread exited during startup")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return LiveServer(url, server, thread)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.should_exit = True
    raise RuntimeError(f"server at {url} not healthy after {startup_timeout_s} s")
