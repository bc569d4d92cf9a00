"""Latency of ``GET /health`` and ``GET /metrics`` while a load runs, from a process of its own.

``python -m stencil.benchmarks.probe URL INTERVAL_S OUT.json``: until SIGTERM, alternately fetch
``/health`` and ``/metrics`` (a fresh connection each time, as a monitor would), every
``INTERVAL_S`` seconds, then write ``{"health_ms": [...], "metrics_ms": [...], "failures": N}``
to ``OUT.json``, with the most running and waiting requests ``/health`` reported
(``running_max``, ``waiting_max``). A process apart from the load generator, so its own event loop and GIL never
delay a probe: the figures are the server's. Only loopback URLs are accepted.
"""

from __future__ import annotations

import http.client
import json
import signal
import sys
import time
from urllib.parse import urlsplit


def probe(host: str, port: int, path: str, timeout_s: float = 30.0, body: list | None = None) -> float | None:
    """Milliseconds to fetch ``path`` (status 200 and the whole body), None on failure; the
    body is appended to ``body`` when given."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        data = r.read()
        ms = (time.perf_counter() - t0) * 1e3 if r.status == 200 else None
        if body is not None and ms is not None:
            body.append(data)
        return ms
    except OSError:
        return None
    finally:
        conn.close()


def main(argv: list[str]) -> int:
    url, interval, out = argv[0], float(argv[1]), argv[2]
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        print("probe: loopback URLs only", file=sys.stderr)
        return 2
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    times: dict[str, list[float]] = {"health_ms": [], "metrics_ms": []}
    most = {"running_max": 0, "waiting_max": 0}
    failures = 0
    k = 0
    while not stop:
        key, path = (("health_ms", "/health"), ("metrics_ms", "/metrics"))[k % 2]
        body: list[bytes] = []
        ms = probe(parts.hostname, parts.port or 80, path, body=body)
        if ms is None:
            failures += 1
        else:
            times[key].append(ms)
        if body and path == "/health":
            try:
                engine = json.loads(body[0])["engine"]
                most["running_max"] = max(most["running_max"], int(engine["running"]))
                most["waiting_max"] = max(most["waiting_max"], int(engine["waiting"]))
            except (ValueError, KeyError, TypeError):
                pass
        k += 1
        time.sleep(interval)
    with open(out, "w") as f:
        json.dump({**times, **most, "failures": failures}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
