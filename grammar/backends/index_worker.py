"""Build outlines-core indexes in a child process that can be killed on a deadline.

A Python thread cannot be stopped, and ``outlines_core.Index(...)`` holds no checkpoints, so a
time limit that really frees the CPU needs a process. Each :class:`IndexWorker` owns one child
(``python -m stencil.grammar.backends.index_worker``) that loads the vocabulary once and then answers build
requests; on a timeout the parent kills it and the next request starts a fresh one.

Frames on the pipes: 8-byte little-endian length, then a pickle of a tuple. Only the parent's own
child is ever unpickled. The index travels as outlines-core's own binary form
(``Index.__reduce__`` / ``Index.from_binary``).

This module imports only the standard library at top level: the child must start in ~0.1 s,
without torch.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import BinaryIO

_LEN = 8


class WorkerTimeout(Exception):
    """The build passed its deadline; the child was killed."""


class WorkerDied(Exception):
    """The child exited without answering (crash, or out of its memory limit)."""


class BuildFailed(Exception):
    """outlines-core refused the regex. ``kind``: syntax, unsupported, vocabulary, too_large, other."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def _write_frame(stream: BinaryIO, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(_LEN, "little"))
    stream.write(data)
    stream.flush()


def _read_frame(stream: BinaryIO):
    head = stream.read(_LEN)
    if len(head) < _LEN:
        raise EOFError
    size = int.from_bytes(head, "little")
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def index_to_binary(index) -> bytes:
    """outlines-core's serialized form of an ``Index`` (what ``pickle`` would carry)."""
    _, (raw,) = index.__reduce__()
    return bytes(raw)


def index_from_binary(raw: bytes):
    from outlines_core import Index

    return Index.from_binary(raw)


class IndexWorker:
    """Parent-side handle of one child process. Not thread-safe: one build at a time.

    Args:
        vocabulary: the ``outlines_core.Vocabulary`` every build uses (sent once, pickled).
        memory_limit_bytes: address-space limit of the child (``RLIMIT_AS``); ``None`` for none.
            A build that exceeds it makes the child die → :class:`WorkerDied`.
        start_timeout_s: how long the child may take to start and load the vocabulary.

    Raises:
        WorkerDied / WorkerTimeout: the child failed to start.
    """

    def __init__(self, vocabulary, memory_limit_bytes: int | None = None,
                 start_timeout_s: float = 60.0):
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        args = [sys.executable, "-m", "stencil.grammar.backends.index_worker", str(memory_limit_bytes or 0)]
        self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._call(("vocab", vocabulary), start_timeout_s)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    def build(self, regex: str, timeout_s: float, max_index_bytes: int) -> bytes:
        """Compile ``regex`` into an index; returns its binary form.

        Raises:
            WorkerTimeout: not done within ``timeout_s`` seconds (the child is killed).
            WorkerDied: the child exited (e.g. out of memory).
            BuildFailed: outlines-core rejected the regex, or the index exceeds
                ``max_index_bytes`` (kind "too_large").
        """
        reply = self._call(("build", regex, max_index_bytes), timeout_s)
        if reply[0] == "ok":
            return reply[1]
        raise BuildFailed(reply[1], reply[2])

    def kill(self) -> None:
        """Kill the child and nothing else; safe from any thread, also while a build waits on it:
        the build then fails with :class:`WorkerDied` and closes the pipes in its own thread."""
        if self._proc.poll() is None:
            self._proc.kill()

    def close(self) -> None:
        """Kill the child (idempotent)."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for s in (self._proc.stdin, self._proc.stdout):
            try:
                s.close()
            except OSError:
                pass

    def _call(self, message, timeout_s: float):
        fired = threading.Event()

        def kill() -> None:
            fired.set()
            self._proc.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.daemon = True
        timer.start()
        try:
            _write_frame(self._proc.stdin, message)
            return _read_frame(self._proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            code = self._proc.wait()
            self.close()
            if fired.is_set():
                raise WorkerTimeout(f"index build exceeded {timeout_s:g} s") from None
            raise WorkerDied(f"index worker exited with code {code}") from None
        finally:
            timer.cancel()


def _classify(message: str) -> str:
    if "incompatible" in message:
        return "vocabulary"
    if "unsupported regex feature" in message or "anchored" in message:
        return "unsupported"
    if "NFA" in message or "parse" in message:
        return "syntax"
    return "other"


WORKER_NICE = 10
"""The children build at a lower CPU priority (``os.nice``): an eager index is background work
under ``auto`` (a request never waits for it), and at equal priority its build had taken a core
from the engine's prefill on a 2-core machine: the second request of a new schema, the one that
starts the build, saw its TTFT rise 3-40x (Gemma 3, 200-token prompts). Where a core is free the
build runs at full speed; under load it yields (an ``eager``-policy request then waits longer)."""


def _serve(memory_limit: int) -> None:
    try:
        os.nice(WORKER_NICE)
    except OSError:  # not permitted here: build at the parent's priority
        pass
    if memory_limit > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    from outlines_core import Index

    # The protocol owns the real stdout; anything printed by accident goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    vocabulary = None
    while True:
        try:
            msg = _read_frame(inp)
        except EOFError:
            return  # parent gone or closed us
        if msg[0] == "vocab":
            vocabulary = msg[1]
            _write_frame(out, ("ready",))
            continue
        _, regex, max_bytes = msg
        try:
            raw = index_to_binary(Index(regex, vocabulary))
        except ValueError as e:
            _write_frame(out, ("error", _classify(str(e)), str(e)))
            continue
        if len(raw) > max_bytes:
            _write_frame(out, ("error", "too_large",
                               f"index is {len(raw)} bytes, above the limit of {max_bytes}"))
            continue
        _write_frame(out, ("ok", raw))


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
