"""A thread pool for background builds that the interpreter's exit does not wait for.

``ThreadPoolExecutor`` joins its threads when the interpreter exits (``concurrent.futures``
registers an exit hook, and since Python 3.9 its threads are not daemons), so a build running
when the process is told to stop holds the exit until the build ends. A closing automaton of a
regex with large counted repeats (``[a-z]{1,99999}`` over SmolLM2's vocabulary: 4 s) is pure
Python that nothing can interrupt. Its result only serves later requests, so nothing is lost by
abandoning it:
:class:`DaemonPool` runs such work on daemon threads, which the interpreter abandons at exit.

Only for work that leaves nothing behind outside the process (no file half written): a daemon
thread stops wherever it is at exit.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class DaemonPool:
    """Runs callables on up to ``max_workers`` daemon threads named ``{name}_{i}``.

    The subset of ``ThreadPoolExecutor`` that the compiler uses: ``submit`` and ``shutdown``.
    Thread-safe.
    """

    def __init__(self, max_workers: int, name: str):
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max = max_workers
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (future, fn, args, kwargs) or None
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The threads started so far (alive or not)."""
        return tuple(self._threads)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        """Queue ``fn(*args, **kwargs)``; a future of its result.

        Raises:
            RuntimeError: the pool is shut down (as ``ThreadPoolExecutor`` does).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future = Future()
            self._queue.put((future, fn, args, kwargs))
            if len(self._threads) < self._max:
                t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                t.start()
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more work; with ``cancel_futures`` cancel what has not started; with ``wait``
        join the threads (what runs goes on either way: a thread cannot be stopped)."""
        with self._lock:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in self._threads:
                self._queue.put(None)  # one stop mark a thread, after the work still queued
        if wait:
            for t in self._threads:
                t.join()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            _run(*item)
            del item  # an idle thread holds nothing of the last job


def _run(future: Future, fn, args: tuple, kwargs: dict) -> None:
    if not future.set_running_or_notify_cancel():
        return  # cancelled while queued
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the future carries it, as in ThreadPoolExecutor
        future.set_exception(exc)
    else:
        future.set_result(result)
