"""The engine-level grammar compiler: spec → regex → outlines-core index, cached.

* ``compile(spec)`` blocks; ``submit(spec)`` returns a ``Future`` at once (a thread pool runs the
  compile; the engine keeps the request in WAITING_FOR_GRAMMAR meanwhile). Concurrent requests
  for the same spec share one compile.
* The index itself is built in a child process (:mod:`grammar.index_worker`) killed at
  ``timeout_s``, so a runaway regex (exponential DFA) costs no CPU after its deadline.
* Caches: an in-memory LRU of :class:`CompiledGrammar` keyed by (spec, vocabulary fingerprint,
  library versions), bounded by count and by index bytes; optionally a disk cache of index
  binaries keyed by sha256 of (the final regex, vocabulary fingerprint, outlines-core version).
  The disk key uses the *regex*, not the spec, so a change in the JSON-Schema translation can
  never serve a stale index.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import tempfile
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

from grammar.base import CompileStats, GrammarError, GrammarSpec, GrammarTimeout
from grammar.backends.index_worker import (BuildFailed, IndexWorker, WorkerDied, WorkerTimeout,
                                  index_from_binary)
from grammar.backends.eager import CompiledGrammar
from grammar.regex_tools import check_supported, choice_regex, locate_syntax_error
from grammar.vocab import END_SENTINEL, TokenVocabulary, build_vocabulary

_OUTLINES_VERSION = version("outlines-core")
_FORMAT = "stencil-grammar-1"  # bump when CompiledGrammar's construction changes meaning
_DISK_MAGIC = b"STNCIDX2"


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` into :class:`CompiledGrammar` for one tokenizer + model.

    Args:
        tokenizer: a Hugging Face tokenizer, or a ready :class:`TokenVocabulary`.
        vocab_size: the model's logits width (≥ the tokenizer's size).
        max_workers: concurrent compiles (threads, each driving at most one child process).
        timeout_s: limit on one index build, in seconds → :class:`GrammarTimeout`.
        cache_size: compiled grammars kept in memory (LRU).
        disk_cache_dir: where index binaries persist across restarts; ``None`` disables.
        max_recursion_depth: JSON Schema ``$ref`` recursion unrolling depth.
        max_regex_chars: longer regexes are refused → :class:`GrammarError`.
        max_index_bytes: larger indexes (outlines-core binary size, ≈ memory) are refused.
        cache_max_bytes: the in-memory LRU also evicts beyond this many index bytes.
        worker_memory_bytes: address-space limit of each child (``None``: unlimited).
        failure_ttl_s: how long a timed-out spec is answered from memory before it may be
            retried (other failures are deterministic and remembered while in the LRU), so a
            client repeating a runaway schema cannot tie up the workers.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_workers: int = 2,
                 timeout_s: float = 10.0, cache_size: int = 256,
                 disk_cache_dir: Path | None = None, max_recursion_depth: int = 3,
                 max_regex_chars: int = 200_000, max_index_bytes: int = 256 << 20,
                 cache_max_bytes: int = 2 << 30, worker_memory_bytes: int | None = 4 << 30,
                 failure_ttl_s: float = 60.0):
        if isinstance(tokenizer, TokenVocabulary):
            if tokenizer.model_vocab_size != vocab_size:
                raise ValueError(f"vocabulary is for {tokenizer.model_vocab_size} logits, "
                                 f"not {vocab_size}")
            self.vocab = tokenizer
        else:
            self.vocab = build_vocabulary(tokenizer, model_vocab_size=vocab_size)
        self.stats = CompileStats()
        self._timeout_s = timeout_s
        self._cache_size = cache_size
        self._cache_max_bytes = cache_max_bytes
        self._disk = Path(disk_cache_dir) if disk_cache_dir is not None else None
        if self._disk is not None:
            self._disk.mkdir(parents=True, exist_ok=True)
        self._depth = max_recursion_depth
        self._max_regex_chars = max_regex_chars
        self._max_index_bytes = max_index_bytes
        self._worker_memory = worker_memory_bytes
        self._outlines_vocab = self.vocab.to_outlines()
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._inflight: dict[str, Future] = {}
        # key → (error, monotonic time); bounded like the main cache
        self._failures: OrderedDict[str, tuple[GrammarError, float]] = OrderedDict()
        self._failure_ttl_s = failure_ttl_s
        self._idle: queue.SimpleQueue[IndexWorker] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._idle)

    # -- public -------------------------------------------------------------------------------

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or fetch from cache) ``spec``; blocks.

        Raises:
            GrammarError: the spec cannot be compiled exactly (with ``position`` for regexes).
            GrammarTimeout: the index build exceeded ``timeout_s``.
        """
        return self.submit(spec).result()

    def submit(self, spec: GrammarSpec) -> "Future[CompiledGrammar]":
        """Start compiling ``spec`` in the pool; never blocks. The future raises as ``compile``."""
        key = self._key(spec)
        with self._lock:
            if self._closed:
                raise RuntimeError("GrammarCompiler is closed")
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                done: Future = Future()
                done.set_result(hit)
                return done
            failed = self._recent_failure(key)
            if failed is not None:
                self.stats.cache_hits += 1
                done = Future()
                done.set_exception(failed)
                return done
            running = self._inflight.get(key)
            if running is not None:
                self.stats.cache_hits += 1
                return running
            fut = self._pool.submit(self._compile_and_store, spec, key)
            self._inflight[key] = fut
            return fut

    def close(self) -> None:
        """Stop the pool and kill the child processes (idempotent)."""
        with self._lock:
            self._closed = True
        self._finalizer()

    def __enter__(self) -> "GrammarCompiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- compile path -------------------------------------------------------------------------

    def _key(self, spec: GrammarSpec) -> str:
        parts = [spec.key(), self.vocab.fingerprint, _OUTLINES_VERSION, _FORMAT, self._depth]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def _compile_and_store(self, spec: GrammarSpec, key: str) -> CompiledGrammar:
        try:
            grammar = self._compile_uncached(spec)
            with self._lock:
                self._store(key, grammar)
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

    def _compile_uncached(self, spec: GrammarSpec) -> CompiledGrammar:
        start = time.perf_counter()
        regex, notes = self._to_regex(spec)
        if len(regex) > self._max_regex_chars:
            raise GrammarError(f"regex is {len(regex)} characters, above the limit of "
                               f"{self._max_regex_chars}")
        full = "(?:" + regex + ")" + END_SENTINEL.decode()
        raw = self._disk_load(full)
        from_disk = raw is not None
        if raw is None:
            raw = self._build(full, spec)
            self._disk_store(full, raw)
        grammar = CompiledGrammar(spec=spec, regex=regex, index=index_from_binary(raw),
                                  vocab=self.vocab, warnings=tuple(notes), index_bytes=len(raw))
        with self._lock:
            if from_disk:
                self.stats.disk_hits += 1
            else:
                self.stats.compiles += 1
            self.stats.record_compile_ms((time.perf_counter() - start) * 1e3)
        return grammar

    def _to_regex(self, spec: GrammarSpec) -> tuple[str, list[str]]:
        if spec.kind == "regex":
            return check_supported(spec.value), []
        if spec.kind == "choice":
            try:
                choices = json.loads(spec.value)
            except json.JSONDecodeError as e:
                raise GrammarError(f"choice is not valid JSON: {e.msg}", position=e.pos) from None
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice must be a JSON array of strings")
            return choice_regex(choices), []
        if spec.kind == "json_schema":
            return self._schema_regex(spec)
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")

    def _schema_regex(self, spec: GrammarSpec) -> tuple[str, list[str]]:
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"schema is not valid JSON: {e.msg}") from None
        from grammar.json_schema import schema_to_regex

        regex, notes = schema_to_regex(schema, whitespace=spec.whitespace, strict=spec.strict,
                                       max_recursion_depth=self._depth)
        return regex, list(notes)

    def _build(self, full_regex: str, spec: GrammarSpec) -> bytes:
        worker = self._idle_worker()
        try:
            raw = worker.build(full_regex, self._timeout_s, self._max_index_bytes)
        except WorkerTimeout:
            raise GrammarTimeout(f"grammar compilation exceeded {self._timeout_s:g} s") from None
        except WorkerDied as e:
            raise GrammarError(f"grammar too large: the compile worker died ({e}); memory limit "
                               f"{self._worker_memory} bytes") from None
        except BuildFailed as e:
            raise self._explain(e, spec) from None
        finally:
            self._release(worker)
        return raw

    def _explain(self, failure: BuildFailed, spec: GrammarSpec) -> GrammarError:
        if failure.kind == "syntax" and spec.kind == "regex":
            pos, msg = locate_syntax_error(spec.value)
            return GrammarError(f"invalid regex: {msg or failure.message}", position=pos)
        if failure.kind == "vocabulary":
            return GrammarError("no token sequence can produce this pattern: "
                                + failure.message)
        if failure.kind == "too_large":
            return GrammarError("grammar too large: " + failure.message)
        return GrammarError(f"cannot compile {spec.kind}: {failure.message}")

    # -- workers ------------------------------------------------------------------------------

    def _idle_worker(self) -> IndexWorker:
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                try:
                    return IndexWorker(self._outlines_vocab, self._worker_memory)
                except (WorkerDied, WorkerTimeout) as e:
                    raise GrammarError(f"cannot start a grammar compile worker: {e}") from None
            if worker.alive:
                return worker
            worker.close()

    def _release(self, worker: IndexWorker) -> None:
        if worker.alive and not self._closed:
            self._idle.put(worker)
        else:
            worker.close()

    # -- caches -------------------------------------------------------------------------------

    def _store(self, key: str, grammar: CompiledGrammar) -> None:
        """Insert into the LRU (caller holds the lock)."""
        if self._cache_size <= 0:
            return
        self._cache[key] = grammar
        self._cache_bytes += grammar.index_bytes
        while self._cache and (len(self._cache) > self._cache_size
                               or self._cache_bytes > self._cache_max_bytes):
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.index_bytes

    def _remember_failure(self, key: str, error: GrammarError) -> None:
        """Caller holds the lock."""
        if self._cache_size <= 0:
            return
        self._failures[key] = (error, time.monotonic())
        while len(self._failures) > self._cache_size:
            self._failures.popitem(last=False)

    def _recent_failure(self, key: str) -> GrammarError | None:
        """A fresh copy of the remembered error, or None (caller holds the lock)."""
        entry = self._failures.get(key)
        if entry is None:
            return None
        error, when = entry
        if isinstance(error, GrammarTimeout) and time.monotonic() - when > self._failure_ttl_s:
            del self._failures[key]
            return None
        # A new instance per raise: one exception object re-raised in many threads would
        # accumulate their tracebacks.
        cls = GrammarTimeout if isinstance(error, GrammarTimeout) else GrammarError
        return cls(error.message, keyword=error.keyword, path=error.path, position=error.position)

    def _disk_path(self, full_regex: str) -> Path | None:
        if self._disk is None:
            return None
        h = hashlib.sha256()
        for part in (full_regex, self.vocab.fingerprint, _OUTLINES_VERSION):
            h.update(part.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        return self._disk / f"{h.hexdigest()}.idx"

    def _disk_load(self, full_regex: str) -> bytes | None:
        path = self._disk_path(full_regex)
        if path is None or not path.exists():
            return None
        try:
            data = path.read_bytes()
        except OSError:
            return None
        head, check, raw = data[:8], data[8:12], data[12:]
        if head != _DISK_MAGIC or zlib.crc32(raw).to_bytes(4, "little") != check:
            path.unlink(missing_ok=True)  # torn or foreign file: rebuild
            return None
        return raw

    def _disk_store(self, full_regex: str, raw: bytes) -> None:
        path = self._disk_path(full_regex)
        if path is None:
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                # CRC32 catches corruption at 3 GB/s (sha256 is 4x slower on 100 MB indexes);
                # tampering is out of scope: the directory is ours.
                f.write(_DISK_MAGIC + zlib.crc32(raw).to_bytes(4, "little") + raw)
            os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
        except OSError:
            pass  # the disk cache is an optimisation; a full disk must not fail the request


def _shutdown(pool: ThreadPoolExecutor, idle: "queue.SimpleQueue[IndexWorker]") -> None:
    pool.shutdown(wait=False, cancel_futures=True)
    while True:
        try:
            idle.get_nowait().close()
        except queue.Empty:
            return
