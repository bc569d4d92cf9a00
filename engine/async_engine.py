"""Runs the engine loop on a background thread and serves asyncio callers.

torch releases the GIL inside its kernels, so one engine thread keeps the model busy while the
event loop parses requests and streams answers. Commands (add, abort) reach the engine thread
through a queue; outputs come back to each request's ``EngineStream``. A step's outputs travel
together: one ``call_soon_threadsafe`` per event loop per step, not one per request, so 256
running streams cost the loop one wake-up a step. Besides outputs, a stream learns when its
request is first scheduled (``EngineStream.started``), so a server can wait for a running slot
before it sends any header and still answer a request that waited too long with a status code.

Flow control: a stream whose caller stops taking outputs (a client that reads its answer slowly
or not at all, the server's writes paused) would make the engine run on for nobody, its outputs
piling up in the stream. Once ``HOLD_AT`` outputs wait untaken the request is held
(``LLMEngine.hold``: no tokens until let go, KV blocks kept), and let go when the caller has taken
all but ``RELEASE_AT``, as a socket's high- and low-water marks do. A held request still counts
against its deadline, so a caller that never catches up ends in a time-out, not a leak.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future

from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import LLMEngine
from stencil.engine.malloc import HeapTrimmer
from stencil.engine.outputs import RequestOutput
from stencil.engine.request import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; in-flight and new requests fail at once."""


_STARTED = object()  # delivered when a request is first scheduled
HOLD_AT = 32  # untaken outputs at which a request is held (each is one step's tokens)
RELEASE_AT = 8  # ... and let go once no more than this many wait


class EngineStream:
    """One submitted request: an async iterator of its ``RequestOutput`` items, last one finished.

    Attributes:
        request_id: the engine's id of the request.
        started: set once the engine has scheduled the request (or it ended, or failed).

    Leaving early (``aclose()``, or ``AsyncEngine.generate``'s generator closed) aborts the
    request, so its KV blocks are freed at once. Iterate on the loop that submitted it.
    """

    def __init__(self, aeng: "AsyncEngine", request_id: str):
        self._aeng = aeng
        self.request_id = request_id
        self.started = asyncio.Event()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._finished = False
        self._closed = False
        self.held = False  # the engine was asked to hold the request (see the module docstring)

    def _put(self, item) -> None:
        """On the stream's loop: one item from the engine thread."""
        self.started.set()
        if item is not _STARTED:
            self._queue.put_nowait(item)
            if not self.held and self._queue.qsize() >= HOLD_AT and not self._closed:
                self.held = True
                self._aeng._command(("hold", self.request_id, True))

    def __aiter__(self) -> "EngineStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if self.held and self._queue.qsize() <= RELEASE_AT:
            self.held = False
            self._aeng._command(("hold", self.request_id, False))
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finished:
            self._finished = True
            self._aeng._unregister(self.request_id)
        return item

    async def aclose(self) -> None:
        """Stop listening; abort the request unless it finished."""
        if self._closed:
            return
        self._closed = True
        self._aeng._unregister(self.request_id)
        if not self._finished:
            self._aeng.abort(self.request_id)


class AsyncEngine:
    """Asyncio front of an ``LLMEngine`` running on its own thread."""

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        """Build the engine (from ``config``) or take ``engine``; the loop starts with :meth:`start`.

        From a config, the engine is built on the engine thread itself, which then runs the loop:
        every torch call (load, warm-up, steps) happens on one thread. OpenMP (torch's CPU
        threads and the native kernels) runs a thread's parallel regions on a team of its own;
        a later thread's team was measured 2x slower per decode step here than the team of the
        thread that loaded the model (18 vs 35-44 ms, SmolLM2-135M int4, 2 cores).

        Raises:
            whatever ``LLMEngine(config)`` raises (re-raised here, on the caller's thread).
        """
        self._go = threading.Event()
        self._thread: threading.Thread | None = None
        if engine is None:
            built: dict = {}
            ready = threading.Event()

            def own_thread() -> None:
                try:
                    built["engine"] = LLMEngine(config)
                except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                    built["error"] = e
                ready.set()
                if "engine" in built:
                    self._go.wait()
                    if not self._stop.is_set():
                        self._run()

            self._stop = threading.Event()
            self._thread = threading.Thread(target=own_thread, name="stencil-engine", daemon=True)
            self._thread.start()
            ready.wait()
            if "error" in built:
                self._thread.join()
                raise built["error"]
            engine = built["engine"]
        else:
            self._stop = threading.Event()
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._trimmer = HeapTrimmer()  # freed heap memory back to the kernel, every 10 s at most
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, EngineStream]] = {}
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.on_dead = None  # optional callback(exc) run on the engine thread when the loop dies

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stencil-engine", daemon=True)
            self._thread.start()
        self._go.set()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (in-flight requests are aborted), join the thread, then close the
        grammar compiler's pool (its worker processes) even when the join failed."""
        try:
            self._stop.set()
            self._wake.set()
            self._go.set()
            if self._thread is not None:
                self._thread.join(timeout)
        finally:
            self.engine.grammar.close()

    @property
    def is_alive(self) -> bool:
        return (self._go.is_set() and self._thread is not None and self._thread.is_alive()
                and self.error is None)

    # -- the model and admission (what ``stencil.service.engine_client.EngineClient`` names) --------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab(self):
        """Token id → bytes (``stencil.grammar.vocab.TokenVocabulary``) of the engine's grammar compiler."""
        return self.engine.grammar.vocab

    @property
    def vocab_size(self) -> int:
        """Rows of the model's logits."""
        return self.engine.grammar.vocab.model_vocab_size

    @property
    def model_path(self) -> str:
        """The configured model, as given (``EngineConfig.model``)."""
        return str(self.engine.config.model)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *, admission: bool = True) -> None:
        """``LLMEngine.check_request`` (thread-safe: it reads the engine's limits and queue length)."""
        self.engine.check_request(prompt_token_ids, params, admission=admission)

    def check_budget(self, grammar, params: SamplingParams) -> None:
        """``LLMEngine.check_budget``."""
        self.engine.check_budget(grammar, params)

    def stats(self) -> dict:
        """``LLMEngine.stats()`` (a snapshot read without a lock)."""
        return self.engine.stats()

    @property
    def kernels(self) -> dict[str, str]:
        return self.engine.kernels

    @property
    def grammar_stats(self):
        """The grammar compiler's counters (``stencil.grammar.base.CompileStats``)."""
        return self.engine.grammar.stats

    # -- requests --------------------------------------------------------------------------------
    async def compile_grammar(self, spec, backend: str | None = None, client: str | None = None):
        """Compile (or fetch from cache) a grammar on the compiler's pool, without blocking the loop.

        Args:
            spec: the ``GrammarSpec``.
            backend: "auto", "eager" or "lazy" for this request (``None``: the compiler's policy).
            client: who asks, for the compiler's per-client share of its workers.

        Raises:
            stencil.grammar.base.GrammarError: the constraint is invalid or cannot be enforced exactly.
        """
        return await asyncio.wrap_future(self.engine.grammar.submit(spec, backend, client=client))

    def grammar_future(self, spec, backend: str | None = None, client: str | None = None) -> Future:
        """Start compiling ``spec`` on the compiler's pool; the ``concurrent.futures.Future``
        may be given to ``submit`` as the request's grammar at once: the request then prefills
        all but its last prompt token while it compiles (``stencil.engine.scheduler``). Arguments as
        ``compile_grammar``.

        Raises:
            ValueError: an unknown ``backend``.
        """
        return self.engine.grammar.submit(spec, backend, client=client)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, grammar=None,
               request_id: str | None = None, *, admitted: bool = False) -> EngineStream:
        """Queue a request for the engine thread; return its stream (call on an event loop).

        ``admitted=True``: the caller already passed ``engine.check_request`` (admission); the
        waiting-queue limit is not checked again, here or on the engine thread.

        Raises:
            EngineError / EngineOverloaded: refused here; later refusals (on the engine
                thread) come out of the stream.
            EngineDeadError: the engine loop died.
        """
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        self.engine.check_request(prompt_token_ids, params, admission=not admitted)
        stream = EngineStream(self, request_id or uuid.uuid4().hex)
        with self._lock:
            self._streams[stream.request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", stream.request_id, prompt_token_ids, params, grammar))
        self._wake.set()
        return stream

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, grammar=None,
                       request_id: str | None = None, *, admitted: bool = False) -> AsyncIterator[RequestOutput]:
        """Submit a request (``submit``) and yield its outputs until it finishes.

        Leaving the iteration early (client gone, timeout, cancellation) aborts the request, so
        its KV blocks are freed at once.

        Raises:
            EngineError / EngineOverloaded: before anything is yielded.
            EngineDeadError: the engine loop died.
        """
        stream = self.submit(prompt_token_ids, params, grammar, request_id, admitted=admitted)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    def _unregister(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._command(("abort", request_id))

    def _command(self, cmd: tuple) -> None:
        """Queue ``cmd`` for the engine thread and wake it (thread-safe)."""
        self._inbox.put(cmd)
        self._wake.set()

    def abort_all(self) -> int:
        """Abort every request that has a stream (each gets its ``"abort"`` output); return how
        many. Thread-safe: the server calls it when a stop signal's grace period runs out."""
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self.abort(rid)
        return len(ids)

    # -- the loop --------------------------------------------------------------------------------
    def _deliver(self, rid: str, item) -> None:
        self._deliver_all([(rid, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand ``(request id, item)`` pairs to their streams: one callback per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[EngineStream, object]]] = {}
        with self._lock:
            for rid, item in items:
                target = self._streams.get(rid)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_dispatch, batch)
            except RuntimeError:
                pass  # the caller's loop is closed

    def _drain_inbox(self) -> bool:
        """Apply queued adds and aborts; return whether any request was aborted."""
        eng = self.engine
        aborted = False
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return aborted
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
                aborted = eng.abort(cmd[1]) or aborted
            elif cmd[0] == "hold":
                eng.hold(cmd[1], cmd[2])

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                if self._drain_inbox() and not eng.has_unfinished():
                    # The last running request was aborted: no step follows, so its "abort"
                    # output (a client still listening, e.g. at shutdown) is delivered here.
                    self._deliver_all([(out.request_id, out) for out in eng.step()])
                if not eng.has_unfinished():
                    self._trimmer.maybe_trim()
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                outputs = eng.step()
                self._trimmer.maybe_trim()  # freed activations back to the kernel (engine/malloc.py)
                started = eng.started
                if outputs or started:
                    self._deliver_all([(rid, _STARTED) for rid in started]
                                      + [(out.request_id, out) for out in outputs])
                if not outputs and eng.idle:
                    self._wake.wait(0.002)  # only requests waiting for their grammar: don't spin
                    self._wake.clear()
            for rid in list(eng.scheduler.requests):
                eng.abort(rid)
            self._deliver_all([(out.request_id, out) for out in eng.step()])
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
        self._deliver_all([(rid, exc) for rid in rids])


def _dispatch(batch: list[tuple[EngineStream, object]]) -> None:
    """On a stream's event loop: put each item in its stream."""
    for stream, item in batch:
        stream._put(item)
