"""Runs the engine loop on a background thread and serves asyncio callers.

torch releases the GIL inside its kernels, so one engine thread keeps the model busy while the
event loop parses requests and streams answers. Commands (add, abort) reach the engine thread
through a queue; outputs come back through each request's ``asyncio.Queue`` via
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; in-flight and new requests fail at once."""


class AsyncEngine:
    """Asyncio front of an ``LLMEngine`` running on its own thread."""

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine if engine is not None else LLMEngine(config)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.on_dead = None  # optional callback(exc) run on the engine thread when the loop dies

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stencil-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (in-flight requests are aborted) and join the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.grammar.close()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- requests --------------------------------------------------------------------------------
    async def compile_grammar(self, spec, backend: str | None = None):
        """Compile (or fetch from cache) a grammar on the compiler's pool, without blocking the loop.

        Args:
            spec: the ``GrammarSpec``.
            backend: "auto", "eager" or "lazy" for this request (``None``: the compiler's policy).

        Raises:
            grammar.base.GrammarError: the constraint is invalid or cannot be enforced exactly.
        """
        return await asyncio.wrap_future(self.engine.grammar.submit(spec, backend))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, grammar=None,
                       request_id: str | None = None, *, admitted: bool = False) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until it finishes.

        ``admitted=True``: the caller already passed ``engine.check_request`` (admission); the
        waiting-queue limit is not checked again, here or on the engine thread.

        Leaving the iteration early (client gone, timeout, cancellation) aborts the request, so
        its KV blocks are freed at once.

        Raises:
            EngineError / EngineOverloaded: before anything is yielded.
            EngineDeadError: the engine loop died.
        """
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        self.engine.check_request(prompt_token_ids, params, admission=not admitted)
        rid = request_id or uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[rid] = (asyncio.get_running_loop(), q)
        self._inbox.put(("add", rid, prompt_token_ids, params, grammar))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # -- the loop --------------------------------------------------------------------------------
    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:
                pass  # the caller's loop is closed

    def _drain_inbox(self) -> None:
        eng = self.engine
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, grammar = cmd
                with self._lock:
                    live = rid in self._streams
                if not live:
                    continue  # the caller left before the engine saw the request
                try:
                    # Admission was decided in generate(), on the caller's side.
                    eng.add_request(rid, prompt, params, grammar, admitted=True)
                except Exception as e:  # noqa: BLE001 - the caller gets the exception
                    self._deliver(rid, e)
            elif cmd[0] == "abort":
                eng.abort(cmd[1])

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not eng.has_unfinished():
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                outputs = eng.step()
                for out in outputs:
                    self._deliver(out.request_id, out)
                if not outputs and not eng.scheduler.running:
                    self._wake.wait(0.002)  # only requests waiting for their grammar: don't spin
                    self._wake.clear()
            for rid in list(eng.scheduler.requests):
                eng.abort(rid)
            for out in eng.step():
                self._deliver(out.request_id, out)
            self._fail_all(EngineDeadError("engine is shutting down"))
        except BaseException as e:  # noqa: BLE001 - the loop must report any death
            log.exception("engine loop died")
            self.error = e
            self._fail_all(EngineDeadError(f"engine loop died: {e!r}"))
            if self.on_dead is not None:
                self.on_dead(e)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._deliver(rid, exc)
