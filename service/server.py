"""Run an app under uvicorn with Stencil's shutdown rules.

* SIGTERM / SIGINT: the service stops admitting at once (503 ``draining`` on connections
  already open), uvicorn closes its listening socket (new connections are refused: a balancer
  moves on at once) and lets in-flight requests finish for up to ``grace_s`` seconds. Requests
  still running then are aborted in the engine, so each client gets its answer's end: a 503
  "shutting down" (in-band for a stream) instead of a connection cut mid-stream; uvicorn's own
  cancel comes ``ABORT_MARGIN_S`` later. Then the lifespan stops the engine. Exit status 0.
* Engine loop death: in-flight requests have already failed (``AsyncEngine`` fails them); the
  server is told to exit and the process ends with status 1, so a supervisor restarts it.

Thousands of clients: the listen backlog is 4096 (uvicorn's default 2048 would drop the SYNs
of a burst of 2,000 new connections once the loop falls behind accepting them; the kernel caps
it at ``net.core.somaxconn``), and the soft limit on open files is raised to the hard one at
start, since every connection is a file descriptor (the usual soft limit is 1024).

Slow clients: the connections are served by ``stencil.service.http_limits``'s protocol (uvicorn's
httptools one with header, body and send time-outs, a bound on the request head, and bounded
write buffers), configured by a ``ConnectionLimits``.
"""

from __future__ import annotations

import logging
import resource
import socket
import threading
from collections.abc import Callable

import uvicorn

from stencil.service.state import service_state
from stencil.service.http_limits import ConnectionLimits, protocol_class

log = logging.getLogger("stencil.server")

ABORT_MARGIN_S = 3.0  # between aborting what still runs at the grace's end and uvicorn's cancel


class _Server(uvicorn.Server):
    """uvicorn's server, marking the app as draining as soon as a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, runner: "ServerRunner"):
        super().__init__(config)
        self._runner = runner

    def handle_exit(self, sig, frame) -> None:
        self._runner.drain()
        self._runner.abort_after_grace()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals once it has stopped, so the process would die "by
        # SIGTERM" (status 143). A drained, clean stop is a success: exit 0 instead.
        self._captured_signals.clear()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._runner.on_ready is not None:  # (lifespan done: the model answers)
            self._runner.on_ready(base_url(self.servers[0].sockets[0].getsockname()))


class ServerRunner:
    """Owns the uvicorn server of one app; pass ``runner.engine_dead`` to ``create_app``.

    Usage::

        runner = ServerRunner()
        app = create_app(engine_config, service_config, on_engine_dead=runner.engine_dead)
        sys.exit(runner.run(app, host, port, grace_s=30))
    """

    def __init__(self) -> None:
        self.exit_code = 0
        self.server: _Server | None = None
        self.app = None
        self.grace_s = 30.0
        self._abort_timer: threading.Timer | None = None
        self.on_ready: Callable[[str], None] | None = None

    def drain(self) -> None:
        """Refuse new generation requests from now on (503)."""
        state = service_state(self.app) if self.app is not None else None
        if state is not None:
            state.draining = True

    def abort_after_grace(self) -> None:
        """Once ``grace_s`` has passed (from the first stop signal), abort every request still in
        the engine: its client is told "shutting down" before uvicorn cancels the connection."""
        if self._abort_timer is not None:
            return
        self._abort_timer = threading.Timer(self.grace_s, self._abort_inflight)
        self._abort_timer.daemon = True
        self._abort_timer.start()

    def _abort_inflight(self) -> None:
        state = service_state(self.app) if self.app is not None else None
        if state is not None:
            n = state.engine.abort_all()
            if n:
                log.warning("shutdown: aborting %d requests still running after %.0f s", n, self.grace_s)

    def engine_dead(self, exc: BaseException) -> None:
        """Called on the engine thread when its loop dies: stop serving, exit non-zero."""
        self.exit_code = 1
        self.drain()
        if self.server is not None:
            self.server.should_exit = True  # uvicorn's main loop polls this flag every 0.1 s

    def run(self, app, host: str = "127.0.0.1", port: int = 8000, *, grace_s: float = 30.0,
            sock: socket.socket | None = None, log_level: str = "info", backlog: int = 4096,
            limits: ConnectionLimits | None = None, on_ready: Callable[[str], None] | None = None) -> int:
        """Serve until a stop signal or engine death; return the process exit status.

        Args:
            app: the ASGI app from ``create_app``.
            host / port: where to listen (ignored when ``sock`` is given).
            grace_s: how long in-flight requests may run after a stop signal (seconds).
            sock: an already bound socket (tests use port 0).
            log_level: uvicorn's log level.
            backlog: pending connections the listening socket holds.
            limits: per-connection time-outs and buffers (``None``: ``ConnectionLimits()``).
            on_ready: called once with the base URL (``http://127.0.0.1:8000``) when the app has
                started (model loaded) and the socket listens: the first request can come.
        """
        self.app = app
        self.on_ready = on_ready
        self.grace_s = grace_s
        raise_open_files_limit()
        limits = (limits or ConnectionLimits()).validate()
        config = uvicorn.Config(app, host=host, port=port, lifespan="on", log_config=None,
                                log_level=log_level, timeout_graceful_shutdown=grace_s + ABORT_MARGIN_S,
                                access_log=False, backlog=backlog, http=protocol_class(limits),
                                timeout_keep_alive=limits.keep_alive_timeout_s,
                                limit_concurrency=limits.limit_concurrency)
        self.server = _Server(config, self)
        self.server.run(sockets=[sock] if sock is not None else None)
        if not self.server.started and self.exit_code == 0:
            self.exit_code = 1  # startup failed (model not found, port in use): not a clean stop
        return self.exit_code


def base_url(sockname: tuple) -> str:
    """The URL a client on this machine uses for a listening socket's ``getsockname()``: a
    wildcard address (``0.0.0.0``, ``::``) becomes the loopback one."""
    host, port = sockname[0], sockname[1]
    if ":" in host:
        return f"http://[{'::1' if host == '::' else host}]:{port}"
    return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"


def raise_open_files_limit(want: int | None = None) -> int:
    """Raise this process's soft limit on open files to ``want`` (default: the hard limit);
    return the soft limit now in force (unchanged where the platform refuses)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # Linux's default nr_open
    target = cap if want is None else min(want, cap)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            log.warning("could not raise the open-files limit from %d to %s", soft, target)
    return soft
