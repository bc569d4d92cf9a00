"""Runs the engine loop on a background thread and serves asyncio callers.

torch releases the GIL inside its kernels, so one engine thread keeps the model busy while the
event loop parses requests and streams answers. Commands (add, abort) reach the engine thread
through a queue; outputs come back to each request's ``EngineStream``. A step's outputs travel
together: one ``call_soon_threadsafe`` per event loop per step, not one per request, so 256
running streams cost the loop one wake-up a step. Besides outputs, a stream learns when its
request is first scheduled (``EngineStream.started``), so a server can wait for a running slot
before it sends any header and still answer a request that waited too long with a status code.

``AsyncEngine.submit`` takes a whole request (prompt ids, ``SamplingParams``, ``GrammarSpec``): it checks
it, starts the grammar's compile and queues the request at once, so the engine reads all but the
prompt's last token while the grammar compiles; ``EngineStream.admit`` then waits for the compile and
the budget check, whose errors still come before the answer's first byte. ``AsyncEngine`` and
``EngineStream`` are the local ``EngineClient`` and ``RequestStream`` of ``stencil.service.engine_client``
(structurally: nothing here imports the service).

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
import time
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
    """One submitted request: its admission, then an async iterator of its ``RequestOutput`` items,
    the last one finished (``stencil.service.engine_client.RequestStream``, structurally).

    Attributes:
        request_id: the engine's id of the request.
        started: set once the engine has scheduled the request (or it ended, or failed).
        grammar: the compiled grammar once admitted (None without a constraint).
        warnings: the compiled grammar's notes, once admitted.
        grammar_ms: milliseconds from ``submit`` until the grammar was compiled and the budget
            checked (0 without a constraint), once admitted.
        replica: always None (the request runs in this process).

    Leaving early (``aclose()``, or ``AsyncEngine.generate``'s generator closed) aborts the
    request, so its KV blocks are freed at once. Iterate on the loop that submitted it.
    """

    replica = None

    def __init__(self, aeng: "AsyncEngine", request_id: str, params: SamplingParams | None = None,
                 grammar_future: Future | None = None):
        self._aeng = aeng
        self.request_id = request_id
        self.started = asyncio.Event()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._finished = False
        self._closed = False
        self.held = False  # the engine was asked to hold the request (see the module docstring)
        self._params = params
        self._future = grammar_future
        self._submitted_at = time.perf_counter()
        self._admitted = grammar_future is None
        self.grammar = None
        self.warnings: list[str] = []
        self.grammar_ms = 0.0

    async def admit(self) -> None:
        """Wait for the request's grammar, compiling on the compiler's pool while the engine reads
        the prompt, then check ``max_tokens`` against it; a no-op without a grammar or once done.
        On a refusal the request is aborted (its blocks freed) before the error is raised.

        Raises:
            stencil.grammar.base.GrammarError: the constraint cannot be compiled exactly (or the
                compile timed out).
            EngineError: ``max_tokens`` is below the grammar's shortest answer.
        """
        if self._admitted:
            return
        try:
            # shield: a client leaving cancels this wait, not the compile the engine polls (whose
            # outcome is then read by the callback, so asyncio does not log it as never retrieved)
            waited = asyncio.wrap_future(self._future)
            waited.add_done_callback(lambda f: f.cancelled() or f.exception())
            compiled = await asyncio.shield(waited)
            # a 400 naming max_tokens; off the loop: a small budget may need the closing automaton,
            # whose build for large counted repeats takes seconds of Python
            await asyncio.to_thread(self._aeng.engine.check_budget, compiled, self._params)
        except BaseException:
            await self.aclose()
            raise
        self._admitted = True
        self.grammar = compiled
        self.warnings = [str(w) for w in compiled.warnings]
        self.grammar_ms = (time.perf_counter() - self._submitted_at) * 1e3

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
        if not self._admitted:
            await self.admit()
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

    # -- the model and observation (what ``stencil.service.engine_client.EngineClient`` names) ----------
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

    def replica_health(self) -> None:
        """None: one engine, in this process, has no replicas to report."""
        return None

    # -- requests (``stencil.service.engine_client.EngineClient.submit``) ---------------------------
    async def compile_grammar(self, spec, backend: str | None = None, client: str | None = None):
        """Compile (or fetch from cache) a grammar on the compiler's pool, without blocking the loop.

        Args:
            spec: the ``GrammarSpec``.
            backend: "auto", "eager" or "lazy" for this request (``None``: the compiler's policy).
            client: who asks, for the compiler's per-client share of its workers.

        Raises:
            stencil.grammar.base.GrammarError: the constraint is invalid or cannot be enforced exactly.
        """
        return await asyncio.wrap_future(self.grammar_future(spec, backend, client))

    def grammar_future(self, spec, backend: str | None = None, client: str | None = None) -> Future:
        """Start compiling ``spec`` on the compiler's pool; ``submit`` hands the
        ``concurrent.futures.Future`` to the engine as the request's grammar at once. Arguments as
        ``compile_grammar``.

        Raises:
            ValueError: an unknown ``backend``.
        """
        return self.engine.grammar.submit(spec, backend, client=client)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, spec=None, *,
               request_id: str | None = None, grammar_backend: str | None = None,
               client: str | None = None) -> EngineStream:
        """Check a request, start its grammar's compile, and queue it for the engine thread at once;
        return its stream (call on an event loop).

        The request is queued before its grammar is ready: the engine reads all but its last prompt
        token while the grammar compiles ("compile behind prefill", ``stencil.engine.scheduler``),
        and ``EngineStream.admit`` waits for the compile and the budget check, so that their errors
        still come before the answer's first byte.

        Args:
            prompt_token_ids: the tokenized prompt.
            params: sampling parameters (the request runs with ``LLMEngine.check_request``'s: ``max_tokens``
                lowered to the context's room where the prompt leaves less).
            spec: the ``stencil.grammar.base.GrammarSpec``, or None for free text.
            request_id: unique among live requests (a fresh one when None).
            grammar_backend: "auto", "eager" or "lazy" for this request (None: the compiler's policy).
            client: who asks, for the compiler's per-client share of its workers.

        Raises:
            EngineError / EngineOverloaded: refused here (``LLMEngine.check_request``; the
                waiting-queue limit is decided here, once); later refusals come from ``admit`` or
                out of the stream.
            EngineDeadError: the engine loop died.
            ValueError: an unknown ``grammar_backend``.
        """
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        params = self.engine.check_request(prompt_token_ids, params)  # max_tokens within the context's room
        future = self.grammar_future(spec, grammar_backend, client) if spec is not None else None
        stream = EngineStream(self, request_id or uuid.uuid4().hex, params, future)
        with self._lock:
            self._streams[stream.request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", stream.request_id, prompt_token_ids, params, future))
        self._wake.set()
        return stream

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, spec=None,
                       request_id: str | None = None, *, grammar_backend: str | None = None,
                       client: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request (``submit``), admit it, and yield its outputs until it finishes.

        Leaving the iteration early (client gone, timeout, cancellation) aborts the request, so
        its KV blocks are freed at once.

        Raises:
            EngineError / EngineOverloaded / GrammarError: before anything is yielded.
            EngineDeadError: the engine loop died.
        """
        stream = self.submit(prompt_token_ids, params, spec, request_id=request_id, grammar_backend=grammar_backend,
                             client=client)
        try:
            await stream.admit()
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
                    # Admission was decided in submit(), on the caller's side.
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
