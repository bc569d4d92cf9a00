"""Driver of ``test_cluster_ray.py::test_sigterm_drains`` (run inside ``unshare -n``).

Starts ``stencil serve --replicas 1`` on the tiny model, opens a long streaming request, sends
SIGTERM, waits for /health to say "draining", sends a new request, and prints one JSON line:
the long request's outcome, the new request's status, the server's exit status.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx


def main(model: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    ray_tmp = tempfile.mkdtemp(prefix="std-", dir="/tmp")  # Ray's session files, removed below
    server = subprocess.Popen([sys.executable, "-m", "stencil.service.cli", "serve", "--replicas", "1", "--model", model,
                               "--port", str(port), "--num-kv-blocks", "256", "--threads", "1",
                               "--replica-cpus", "0.5", "--shutdown-grace", "60", "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "RAY_TMPDIR": ray_tmp})
    out: dict = {}
    try:
        # Idle the cluster is up in about 30 s; with both cores busy Ray took minutes.
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).json().get("status") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"the cluster never reported ok (server exit status {server.poll()})")
            time.sleep(0.5)
        long: dict = {"deltas": 0, "final": None}
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "go", "regex": "[ab]{1200}", "max_tokens": 1300, "stream": True, "close_on_budget": False}
            try:
                with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
                    long["status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith('data: {"type":"delta"'):
                            long["deltas"] += 1
                            started.set()
                        elif line.startswith('data: {"type":"final"'):
                            long["final"] = json.loads(line[6:])
            except httpx.HTTPError as e:  # reported in the JSON line, with when it happened
                long["error"] = f"{type(e).__name__}: {e} (after {long['deltas']} deltas)"
            finally:
                started.set()

        t = threading.Thread(target=stream)
        t.start()
        # SIGTERM only once the request streams: one the ingress has not seen yet is not in flight.
        started.wait(300)
        if long["deltas"] == 0:
            raise SystemExit(f"the long request never streamed: {long}")
        server.send_signal(signal.SIGTERM)
        status = None
        deadline = time.monotonic() + 120  # the drain broadcast reaches the ingress in ms idle
        while time.monotonic() < deadline:
            status = httpx.get(url + "/health", timeout=10).json().get("status")
            if status == "draining":
                break
            time.sleep(0.05)
        out["health_after_sigterm"] = status
        out["new_request_status"] = httpx.post(url + "/generate", json={"prompt": "hi", "max_tokens": 2},
                                               timeout=30).status_code
        t.join(300)
        out["long"] = {"status": long.get("status"), "finish_reason": (long["final"] or {}).get("finish_reason"),
                       "valid": (long["final"] or {}).get("valid")}
        if "error" in long:
            out["long"]["error"] = long["error"]
        out["exit_status"] = server.wait(300)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
