"""The engine-level grammar compiler: spec → program → backend grammars, cached, with a policy.

* ``compile(spec)`` blocks; ``submit(spec)`` returns a ``Future`` at once (a thread pool runs the
  front end and the lazy build; the engine keeps the request in WAITING_FOR_GRAMMAR meanwhile).
  Concurrent requests for the same spec share one compile.
* Backends come from :mod:`stencil.grammar.backends.backend_registry`. Policy ``auto`` (the default): a request
  never waits for an eager index — it is served by the lazy matcher (llguidance) within
  milliseconds; a spec seen a second time (or compiled with ``hot=True``) gets its eager index
  (outlines-core, µs masks) built in the background, in a child process with the eager limits,
  and later requests use it once it is ready. A regex the eager backend refuses or cannot build in
  time stays lazy. ``eager`` waits for the index (the behaviour before the lazy backend);
  ``lazy`` never builds one. A per-request ``backend`` overrides the policy.
* Caches: an in-memory LRU of :class:`CompiledGrammar` keyed by the spec (one compiler has one
  vocabulary and recursion depth), bounded by count and by eager index bytes; remembered failures (a time-out
  only for ``failure_ttl_s``); the eager backend's disk cache of index binaries.
* Time: the front end runs under a deadline of ``timeout_s`` (GrammarTimeout), the eager build in a
  child killed at ``timeout_s``; llguidance bounds each of its own steps by fuel.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from stencil.grammar.background import DaemonPool
from stencil.grammar.backends import backend_registry
from stencil.grammar.base import CompileStats, GrammarError, GrammarSpec, GrammarTimeout, Program
from stencil.grammar.compiled import CompiledGrammar
from stencil.grammar.frontend import to_program, warm_up
from stencil.grammar.vocab import TokenVocabulary, build_vocabulary

POLICIES = backend_registry.POLICIES


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` into :class:`CompiledGrammar` for one tokenizer + model.

    Args:
        tokenizer: a Hugging Face tokenizer, or a ready :class:`TokenVocabulary`.
        vocab_size: the model's logits width (≥ the tokenizer's size).
        max_workers: concurrent compiles (front end + lazy build threads).
        timeout_s: limit on one compile, seconds: the front end's deadline and the eager
            index build's (→ :class:`GrammarTimeout`).
        cache_size: compiled grammars kept in memory (LRU).
        backend: policy, "auto" (default), "eager" or "lazy" (see the module docstring).
        disk_cache_dir: where eager index binaries persist across restarts; ``None`` disables.
        max_recursion_depth: JSON Schema ``$ref`` unrolling depth where a regex is written.
        max_regex_chars: the eager backend refuses longer regexes (the lazy one takes them).
        max_index_bytes: larger eager indexes (≈ memory) are refused.
        cache_max_bytes: the in-memory LRU also evicts beyond this many eager index bytes.
        worker_memory_bytes: address-space limit of each eager build child (``None``: none).
        failure_ttl_s: how long a timed-out spec is answered from memory before it may be
            retried (other failures are deterministic and remembered while in the LRU).
        eager_workers: concurrent background eager builds (each a child process).

    Raises:
        ValueError: an unknown ``backend``, or a vocabulary for another logits width.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_workers: int = 2,
                 timeout_s: float = 10.0, cache_size: int = 256, backend: str = "auto",
                 disk_cache_dir: Path | None = None, max_recursion_depth: int = 3,
                 max_regex_chars: int = 200_000, max_index_bytes: int = 256 << 20,
                 cache_max_bytes: int = 2 << 30, worker_memory_bytes: int | None = 4 << 30,
                 failure_ttl_s: float = 60.0, eager_workers: int = 1):
        if backend not in POLICIES:
            raise ValueError(f"grammar backend must be one of {POLICIES}, got {backend!r}")
        if isinstance(tokenizer, TokenVocabulary):
            if tokenizer.model_vocab_size != vocab_size:
                raise ValueError(f"vocabulary is for {tokenizer.model_vocab_size} logits, "
                                 f"not {vocab_size}")
            self.vocab = tokenizer
        else:
            self.vocab = build_vocabulary(tokenizer, model_vocab_size=vocab_size)
        self.policy = backend
        self.stats = CompileStats()
        self._timeout_s = timeout_s
        self._cache_size = cache_size
        self._cache_max_bytes = cache_max_bytes
        self._depth = max_recursion_depth
        self._eager_opts = dict(timeout_s=timeout_s, max_regex_chars=max_regex_chars,
                                max_index_bytes=max_index_bytes, worker_memory_bytes=worker_memory_bytes,
                                disk_cache_dir=disk_cache_dir)
        self._backends: dict[str, Any] = {}
        self._backend_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._inflight: dict[GrammarSpec, Future] = {}
        # key → (error, monotonic time); bounded like the main cache
        self._failures: OrderedDict[GrammarSpec, tuple[GrammarError, float]] = OrderedDict()
        self._failure_ttl_s = failure_ttl_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._client_share = max(1, max_workers - 1)
        self._client_running: dict[str, int] = {}
        self._client_queue: dict[str, deque] = {}
        # Eager builds never share the request pool: a slow index cannot delay a lazy compile.
        self._eager_pool = ThreadPoolExecutor(max_workers=eager_workers, thread_name_prefix="grammar-eager")
        # Closing automata (budget-aware masks) are built after the compile, off the request path,
        # on a daemon thread: the process's exit does not wait for one (see ``close``).
        self._closing_pool = DaemonPool(max_workers=1, name="grammar-closing")
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._eager_pool, self._backends,
                                           self._closing_pool)
        if backend != "eager":
            self.backend("lazy")  # its tokenizer trie takes ~0.6 s for 49 k tokens: pay it up front
        # The first compile's one-time costs, started now (``warm_up`` waits for them).
        self._warm = self._pool.submit(self._warm_up)

    # -- public -------------------------------------------------------------------------------

    def compile(self, spec: GrammarSpec, backend: str | None = None, *, hot: bool = False) -> CompiledGrammar:
        """Compile (or fetch from cache) ``spec``; blocks. Arguments as :meth:`submit`.

        Raises:
            GrammarError: the spec cannot be compiled exactly (with ``position`` for regexes,
                ``line``/``column`` for Lark grammars, ``keyword``/``path`` for schemas).
            GrammarTimeout: the compile exceeded ``timeout_s``.
        """
        out = self.submit(spec, backend, hot=hot, _inline=True)
        return out.result() if isinstance(out, Future) else out

    def submit(self, spec: GrammarSpec, backend: str | None = None, *, hot: bool = False,
               client: str | None = None, _inline: bool = False) -> "Future[CompiledGrammar]":
        """Start compiling ``spec``; never blocks. The future raises as :meth:`compile`.

        Args:
            spec: the constraint.
            backend: "auto", "eager" or "lazy" for this request (``None``: the compiler's policy).
                With "eager" the future waits for the index; with "lazy" the result's matchers
                are llguidance's even when an index exists.
            hot: build the eager index now (in the background under "auto"), not at the second
                sighting.
            client: who asks (an API key, a peer address). One client's compiles take at most
                ``max_workers - 1`` of the workers at once (at least one); the rest wait in that
                client's own queue, so its slow schemas never delay another client's answer.

        Raises:
            ValueError: an unknown ``backend``.
            RuntimeError: the compiler is closed.
        """
        # (``_inline``, from ``compile`` alone: a grammar that is ready comes back as itself, not
        # in a future, which spares the caller two futures and their locks on the first-mask path)
        policy = self.policy if backend is None else backend
        if policy not in POLICIES:
            raise ValueError(f"grammar backend must be one of {POLICIES}, got {policy!r}")
        pin = policy != self.policy  # a per-request choice: matchers from that backend only
        key = self._key(spec)
        with self._lock:
            if self._closed:
                raise RuntimeError("GrammarCompiler is closed")
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                hit.sightings += 1
                return self._serve(hit, policy, hot or hit.sightings >= 2, pin, _inline)
            failed = self._recent_failure(key)
            if failed is not None:
                self.stats.cache_hits += 1
                return _done(exc=failed)
            running = self._inflight.get(key)
            if running is not None:
                self.stats.cache_hits += 1
                out: Future = Future()
                running.add_done_callback(lambda f: self._chain(f, out, policy, True, pin))
                return out
            if _inline and client is None:
                # ``compile`` waits anyway: the first compile runs on the caller's thread, which
                # saves the hand-over to a pool thread (a wake-up, ~1.5 ms on a busy 2-core
                # machine, on every request's time to first mask). Others asking meanwhile share
                # this future as usual.
                first = Future()
                first.set_running_or_notify_cancel()
            else:
                first = self._start(spec, key, policy, client)
            self._inflight[key] = first
        if _inline and client is None:
            try:
                grammar = self._compile_and_store(spec, key, policy)
            except BaseException as e:  # noqa: BLE001 - the future carries it, as a pool's would
                first.set_exception(e)
                return _done(exc=_own_copy(e))
            first.set_result(grammar)
            return self._serve(grammar, policy, hot, pin, True)  # (what ``_chain`` would give, without its futures)
        out = Future()
        first.add_done_callback(lambda f: self._chain(f, out, policy, hot, pin))
        return out

    def _start(self, spec: GrammarSpec, key: GrammarSpec, policy: str, client: str | None) -> Future:
        """Submit the first compile of ``spec`` to the pool, or queue it behind the client's own
        compiles when that client already holds its share of the workers (lock held)."""
        if client is None:
            return self._pool.submit(self._compile_and_store, spec, key, policy)
        out: Future = Future()
        job = (spec, key, policy, out)
        if self._client_running.get(client, 0) < self._client_share:
            self._run_client_job(client, job)
        else:
            self._client_queue.setdefault(client, deque()).append(job)
        return out

    def _run_client_job(self, client: str, job) -> None:
        """Run one of ``client``'s compiles on the pool; when it ends, start its next (lock held)."""
        spec, key, policy, out = job
        self._client_running[client] = self._client_running.get(client, 0) + 1

        def done(f: Future) -> None:
            _copy_result(f, out)
            with self._lock:
                self._client_running[client] -= 1
                queue = self._client_queue.get(client)
                if queue:
                    self._run_client_job(client, queue.popleft())
                if not queue:
                    self._client_queue.pop(client, None)
                if not self._client_running[client]:
                    del self._client_running[client]

        try:
            self._pool.submit(self._compile_and_store, spec, key, policy).add_done_callback(done)
        except RuntimeError as e:  # the pool is shut down
            self._client_running[client] -= 1
            out.set_exception(e)

    def close(self) -> None:
        """Stop the pools and kill the eager build processes (idempotent); returns at once and
        waits for no background build.

        Builds not started are cancelled. An eager build runs in a child process
        (``stencil.grammar.backends.index_worker``), which is killed: the pool thread that waits on it
        wakes at once and fails the build (``GrammarError``), so the interpreter's exit, which
        joins ``ThreadPoolExecutor`` threads, has nothing to wait for. A closing automaton being
        built is pure Python, which cannot be stopped: it runs on a daemon thread
        (:class:`stencil.grammar.background.DaemonPool`), abandoned at exit. Compiles on the request pool
        are not abandoned (a request waits on each, under the ``timeout_s`` deadline).
        """
        with self._lock:
            self._closed = True
        self._finalizer()

    def settle(self) -> None:
        """Wait until the background work queued so far on the closing automaton's thread has
        run (closing automata, a hand-written grammar's shortest output, translations' notes):
        what a benchmark calls between measurements, so that one compile's follow-up work is not
        timed as part of the next."""
        try:
            self._closing_pool.submit(lambda: None).result()
        except RuntimeError:  # the pool is shut down: nothing runs there any more
            pass

    def warm_up(self) -> None:
        """Wait until the one-time costs of a first compile are paid, so that none is paid by a
        user's first schema; a server calls it before it reports healthy. Idempotent, and cheap
        once done; a closed compiler's returns at once if its warm-up had not started.

        The constructor starts the warm-up on the request pool: a compile of a small tool-call
        schema through the path a request takes (the front end and its first imports, above all
        ``jsonschema``'s, ~90 ms cold; the policy's first backend, llguidance's first matcher and
        mask; the shortest output and its closing automaton; a budget-aware matcher taking one
        token), with the front end's own :func:`stencil.grammar.frontend.warm_up` (Unicode sets,
        the validators) before it. That grammar is dropped: it is not in the cache and not in
        :attr:`stats`. Under the ``eager`` policy only the front end is warmed (an eager index
        is built in a child process, whose start is each build's own cost).

        The engine's ``StructuredOutputManager`` calls it; so does the MaskBench adapter before
        its clock (``stencil bench first_mask`` measures a first schema with and without it).

        Raises:
            GrammarError: the front end failed on the warm-up schema (a bug, not a user's error).
                A vocabulary that cannot spell that schema's JSON stops the warm-up after the
                front end, without an error.
        """
        if not self._warm.cancelled():  # (cancelled by ``close``: nothing left to warm)
            self._warm.result()

    def _warm_up(self) -> None:
        from stencil.grammar.bitmask import allocate_bitmask  # (torch: imported where used)

        warm_up()
        if self.policy != "eager":
            # The lark library builds its own grammar-file parser once per process (~0.3-0.6 s,
            # regex collision checks): here, not in the first Lark grammar's compile (a large
            # tool list's answer is one: ``stencil.grammar.tool_calls``).
            from stencil.grammar.lark_closing import lark_program

            lark_program('start: "a"\n')
        first = "lazy" if self.policy == backend_registry.AUTO else self.policy  # (as a compile's)
        if first == "eager" or self._closed:
            return
        spec = GrammarSpec.json_schema(_WARM_SCHEMA)
        program = to_program(spec, max_recursion_depth=self._depth, deadline=time.monotonic() + self._timeout_s)
        grammar = self._new_grammar(spec, program, self.policy)
        try:
            grammar._set(first, self._build(first, self._program_for(grammar, first, False), spec))
        except GrammarError:  # a vocabulary that cannot spell JSON (some tests'): nothing more to warm
            return
        grammar.min_output_tokens(0)  # the shortest output, then the closing automaton
        matcher = grammar.budget_matcher(64)
        bitmask = allocate_bitmask(1, self.vocab.model_vocab_size)  # int32 [1, ceil(vocab / 32)]
        matcher.fill_bitmask(bitmask, 0)
        token = _first_allowed(bitmask[0].numpy())
        if token is not None:  # (None: a vocabulary that cannot spell JSON, as in some tests)
            matcher.accept_tokens([token])
            matcher.fill_bitmask(bitmask, 0)

    def __enter__(self) -> "GrammarCompiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def backend(self, name: str):
        """The backend object ``name`` ("eager" or "lazy"), created on first use."""
        with self._backend_lock:
            b = self._backends.get(name)
            if b is None:
                opts = self._eager_opts if name == "eager" else {}
                b = backend_registry.create(name, self.vocab, **opts)
                self._backends[name] = b
            return b

    # -- policy -------------------------------------------------------------------------------

    def _chain(self, first: Future, out: Future, policy: str, hot: bool, pin: bool) -> None:
        """Complete ``out`` from the shared first compile, then apply the request's policy."""
        exc = first.exception()
        if exc is not None:
            out.set_exception(_own_copy(exc))
            return
        served = self._serve(first.result(), policy, hot, pin)
        served.add_done_callback(lambda f: _copy_result(f, out))

    def _serve(self, grammar: CompiledGrammar, policy: str, hot: bool, pin: bool, ready: bool = False):
        """A future of ``grammar`` as ``policy`` wants it (builds what is missing); ``pin``: its
        matchers come from that backend even when the other one is ready. ``ready``: a grammar
        that needs no build comes back as itself, not in a future."""
        done = (lambda g: g) if ready else _done
        if policy != backend_registry.AUTO:  # one backend by name
            if grammar.has(policy):
                return done(grammar.using(policy) if pin else grammar)
            return self._ensure(grammar, policy, wait=True, pin=pin)
        # auto: whatever is ready now; the eager index later, in the background, when hot.
        if (hot and (grammar.program.regular or grammar.program.kind == "json") and not grammar.has("eager")
                and grammar.error("eager") is None):
            # (a "json" program is regular when Stencil's own translation is: found in the build)
            self._ensure(grammar, "eager", wait=False, exact_only=True)
        if grammar.has("eager") or grammar.has("lazy"):
            return done(grammar)
        return self._ensure(grammar, "lazy", wait=True, pin=False)

    def _ensure(self, grammar: CompiledGrammar, name: str, *, wait: bool, pin: bool = False,
                exact_only: bool = False) -> Future:
        """Build ``grammar``'s ``name`` backend once (shared future); a future of the result.
        ``exact_only``: an eager index only of the very language the lazy backend serves (the
        background build of ``auto``), never the regex-mode subset of an eager-only request."""
        with grammar._lock:
            pending = grammar._pending.get(name)
            if pending is None:
                err = grammar._errors.get(name)
                if err is not None:
                    return _done(exc=err.copy())
                pool = self._eager_pool if name == "eager" else self._pool
                try:
                    pending = pool.submit(self._build_backend, grammar, name, exact_only)
                except RuntimeError as e:  # pool shut down
                    return _done(exc=e)
                grammar._pending[name] = pending
        if not wait:
            return pending
        out: Future = Future()

        def done(f: Future) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(_own_copy(exc))
            else:
                out.set_result(grammar.using(name) if pin else grammar)

        pending.add_done_callback(done)
        return out

    def _build_backend(self, grammar: CompiledGrammar, name: str, exact_only: bool = False) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            built = self._build(name, self._program_for(grammar, name, exact_only), grammar.spec)
        except GrammarError as e:
            grammar._fail(name, e)
            with self._lock:
                if name == "eager":
                    self.stats.eager_failures += 1
            raise
        finally:
            with grammar._lock:
                grammar._pending.pop(name, None)
        grammar._set(name, built)
        with self._lock:
            if name == "eager":
                self.stats.eager_builds += 1
                self.stats.disk_hits = getattr(self._backends.get("eager"), "disk_hits", 0)
                self._evict()
            self.stats.record_compile_ms((time.perf_counter() - start) * 1e3)
        return grammar

    @staticmethod
    def _program_for(grammar: CompiledGrammar, name: str, exact_only: bool) -> Program:
        """The program ``name`` builds: the grammar's, or for the eager index of a "json" program
        (handed to llguidance) Stencil's own translation of its spec, the same language."""
        program = grammar.program
        if name == "eager" and program.kind == "json":
            program = grammar.own_program()
            if exact_only and not program.regular:
                raise GrammarError("the eager backend cannot serve this schema's language (it needs "
                                   "grammar rules or intersections): it stays on the lazy backend",
                                   keyword="grammar_backend")
        return program

    def _build(self, name: str, program: Program, spec: GrammarSpec):
        backend = self.backend(name)
        if program.kind not in backend.kinds and not (name == "eager" and spec.kind == "json_schema"):
            raise GrammarError(f"the {name} backend cannot serve a {program.kind} grammar; "
                               "use grammar_backend 'lazy' or 'auto'", keyword="grammar_backend")
        if name == "eager":
            if not program.regular and spec.kind == "json_schema":
                # An eager-only request for a schema that needs rules or intersections: the regex
                # compilation (recursion unrolled, a subset; intersections refused by keyword).
                program = to_program(spec, max_recursion_depth=self._depth, grammar=False,
                                     deadline=time.monotonic() + self._timeout_s)
            return backend.build(program, spec)
        return backend.build(program)

    # -- compile path -------------------------------------------------------------------------

    @staticmethod
    def _key(spec: GrammarSpec) -> GrammarSpec:
        """The caches' key: the spec itself (a frozen dataclass: its kind, text and options).
        What else a compile depends on (the vocabulary, the libraries' versions, the recursion
        depth) is fixed for one compiler, and these caches live in memory only. (A SHA-256 of all
        of them cost ~0.03 ms on a cold cache, on every new schema's first mask.)"""
        return spec

    def _compile_and_store(self, spec: GrammarSpec, key: GrammarSpec, policy: str) -> CompiledGrammar:
        """Front end, then the first backend the policy needs; cached on success."""
        start = time.perf_counter()
        try:
            program = to_program(spec, max_recursion_depth=self._depth,
                                 deadline=time.monotonic() + self._timeout_s)
            grammar = self._new_grammar(spec, program, policy)
            first = "lazy" if policy == backend_registry.AUTO else policy
            try:
                built = self._build(first, self._program_for(grammar, first, False), spec)
            except GrammarError:
                if program.kind != "json" or first != "lazy":
                    raise
                # llguidance refused what was handed to it (one of its own limits): Stencil's
                # own translation, the same language, in its place.
                grammar = self._new_grammar(spec, grammar.own_program(), policy)
                built = self._build(first, grammar.program, spec)
            grammar._set(first, built)
            if program.kind == "lark" and program.root is None:
                # A hand-written grammar's shortest output is read through lark (ms for most, 25 ms
                # for a tool-call answer of 100 functions): on the closing automaton's thread while
                # the prompt is read, not on the compile's path nor the engine thread's at the
                # request's admission (which waits for it, CompiledGrammar._bytes_bound).
                self._closing_pool.submit(grammar.min_output_tokens, 1 << 30)
            if grammar.program.own_warnings:  # ready before the first answer asks for them
                self._closing_pool.submit(grammar.own_program)
            with self._lock:
                self._store(key, grammar)
                self.stats.compiles += 1
                if first == "eager":
                    self.stats.eager_builds += 1
                    self.stats.disk_hits = getattr(self._backends.get("eager"), "disk_hits", 0)
                self.stats.record_compile_ms((time.perf_counter() - start) * 1e3)
            return grammar
        except GrammarError as e:
            with self._lock:
                if isinstance(e, GrammarTimeout):
                    self.stats.timeouts += 1
                else:
                    self.stats.errors += 1
                self._remember_failure(key, e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _new_grammar(self, spec: GrammarSpec, program: Program, policy: str) -> CompiledGrammar:
        grammar = CompiledGrammar(spec, program, self.vocab, policy)
        grammar._closing_pool = self._closing_pool
        grammar._translate = lambda s: to_program(s, max_recursion_depth=self._depth, handover=False,
                                                  deadline=time.monotonic() + self._timeout_s)
        return grammar

    # -- caches -------------------------------------------------------------------------------

    def _store(self, key: GrammarSpec, grammar: CompiledGrammar) -> None:
        """Insert into the LRU (caller holds the lock)."""
        if self._cache_size <= 0:
            return
        self._cache[key] = grammar
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used grammars beyond the count and byte limits (lock held)."""
        total = sum(g.index_bytes for g in self._cache.values())
        while self._cache and (len(self._cache) > self._cache_size or total > self._cache_max_bytes):
            _, old = self._cache.popitem(last=False)
            total -= old.index_bytes

    def _remember_failure(self, key: GrammarSpec, error: GrammarError) -> None:
        """Caller holds the lock."""
        if self._cache_size <= 0:
            return
        self._failures[key] = (error, time.monotonic())
        while len(self._failures) > self._cache_size:
            self._failures.popitem(last=False)

    def _recent_failure(self, key: GrammarSpec) -> GrammarError | None:
        """A fresh copy of the remembered error, or None (caller holds the lock)."""
        entry = self._failures.get(key)
        if entry is None:
            return None
        error, when = entry
        if isinstance(error, GrammarTimeout) and time.monotonic() - when > self._failure_ttl_s:
            del self._failures[key]
            return None
        return error.copy()


# What ``warm_up`` compiles: the shape of a typical tool call's arguments (kept small: its own
# cost is paid once per compiler).
_WARM_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "exact": {"type": "boolean"},
    },
    "required": ["city"],
}


def _first_allowed(words) -> int | None:
    """The lowest token id set in one bitmask row (int32 ``[ceil(vocab / 32)]``), or None."""
    set_words = words.nonzero()[0]
    if not len(set_words):
        return None
    w = int(set_words[0])
    bits = int(words[w]) & 0xFFFFFFFF
    return w * 32 + (bits & -bits).bit_length() - 1


def _own_copy(exc: BaseException) -> BaseException:
    """What one waiter of a shared compile gets: its own copy of a ``GrammarError`` (one instance
    raised in many threads would gather their tracebacks), any other exception as it is."""
    return exc.copy() if isinstance(exc, GrammarError) else exc


def _done(result=None, exc: BaseException | None = None) -> Future:
    f: Future = Future()
    if exc is not None:
        f.set_exception(exc)
    else:
        f.set_result(result)
    return f


def _copy_result(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


def _shutdown(pool: ThreadPoolExecutor, eager_pool: ThreadPoolExecutor, backends: dict,
              closing_pool: DaemonPool) -> None:
    pool.shutdown(wait=False, cancel_futures=True)
    eager_pool.shutdown(wait=False, cancel_futures=True)
    closing_pool.shutdown(wait=False, cancel_futures=True)
    for b in list(backends.values()):
        b.close()
