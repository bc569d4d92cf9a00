"""The eager backend: an outlines-core token index per regex, built in a killable child process.

An :class:`EagerGrammar` wraps an outlines-core ``Index`` built from ``(?:REGEX)\\x01`` over the
vocabulary plus the sentinel token (see :data:`stencil.grammar.vocab.END_SENTINEL`). "The sentinel is
allowed" is read as "EOS is allowed"; accepting EOS advances the index over the sentinel, into
its only final state. So EOS is allowed exactly in the regex's accepting states, and after EOS
nothing else is.

An :class:`EagerMatcher` is a cursor: an outlines-core ``Guide`` (which writes masks and keeps the
state history used by :meth:`EagerMatcher.rollback`) plus a terminated flag. Source of the Guide /
Index API: outlines-core 0.2.14 ``src/python_bindings/mod.rs``.
"""

from __future__ import annotations

import hashlib
import os
import queue
import tempfile
import threading
import zlib
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from outlines_core import Guide

from stencil.grammar.backends.index_worker import (BuildFailed, IndexWorker, WorkerDied, WorkerTimeout,
                                           index_from_binary)
from stencil.grammar.base import GrammarError, GrammarSpec, GrammarTimeout, Program
from stencil.grammar.vocab import END_SENTINEL, TokenVocabulary

OUTLINES_VERSION = version("outlines-core")
_DISK_MAGIC = b"STNCIDX2"

# Guide keeps one u32 per accepted token (no preallocation); generations are bounded by the
# model length long before this.
_MAX_ROLLBACK = 1 << 20
_UNKNOWN = object()


@dataclass(frozen=True, slots=True, eq=False)
class EagerGrammar:
    """An immutable compiled constraint, shared by every request with the same spec.

    Attributes:
        spec: what was compiled.
        regex: the regex the output must fully match (without the end sentinel).
        index: the ``outlines_core.Index`` of ``(?:regex)\\x01`` over ``vocab`` + sentinel.
        vocab: the grammar alphabet (EOS ids, sentinel id, model vocab size).
        warnings: notes from the JSON-Schema translation (keywords not enforced, ...).
        index_bytes: size of the index in outlines-core's binary form (a memory estimate).
    """

    spec: GrammarSpec
    regex: str
    index: object
    vocab: TokenVocabulary
    warnings: tuple[str, ...] = ()
    index_bytes: int = 0
    # state → (token, next state) when exactly one token is allowed there, else None. Filled
    # lazily (a state's token list can be 49 k long); dict writes are atomic under the GIL and
    # every writer stores the same value, so sharing across threads is safe.
    _forced: dict = field(default_factory=dict, repr=False)
    # state → (byte, next state) when every allowed token starts with the same byte and the
    # output may not end there (see ``forced_byte``); filled lazily like ``_forced``.
    _forced_bytes: dict = field(default_factory=dict, repr=False)
    _byte_tokens: dict = field(default_factory=dict, repr=False)  # byte value → single-byte token id

    kind = "eager"

    @property
    def nbytes(self) -> int:
        return self.index_bytes

    def matcher(self) -> "EagerMatcher":
        """A fresh cursor at the start of the grammar."""
        return EagerMatcher(self)

    def forced_step(self, state: int) -> tuple[int, int] | None:
        """``(token_id, next_state)`` if ``state`` allows exactly one token, else ``None``."""
        hit = self._forced.get(state, _UNKNOWN)
        if hit is _UNKNOWN:
            allowed = self.index.get_allowed_tokens(state) or []
            hit = None
            if len(allowed) == 1:
                hit = (allowed[0], self.index.get_next_state(state, allowed[0]))
            self._forced[state] = hit
        return hit


    def forced_byte(self, state: int, max_allowed: int = 4096) -> tuple[int, int] | None:
        """``(byte, next_state)`` if the grammar forces the next *byte* from ``state``, else None.

        The byte is forced when the output may not end at ``state`` and every allowed token
        starts with it; the next state is the one reached through the token made of that byte
        alone (byte-level vocabularies have one for every byte). States allowing more than
        ``max_allowed`` tokens (free text) are not examined: they are never forced.
        """
        hit = self._forced_bytes.get(state, _UNKNOWN)
        if hit is not _UNKNOWN:
            return hit
        hit = None
        index, sentinel = self.index, self.vocab.sentinel_id
        allowed = index.get_allowed_tokens(state) or []
        if 0 < len(allowed) <= max_allowed:
            tb = self.vocab.token_bytes
            first = {tb[t][0] for t in allowed if t != sentinel and t in tb}
            if len(first) == 1 and sentinel not in allowed:
                b = first.pop()
                tid = self._single_byte_token(b)
                nxt = index.get_next_state(state, tid) if tid is not None else None
                if nxt is not None:
                    hit = (b, nxt)
        self._forced_bytes[state] = hit
        return hit

    def _single_byte_token(self, b: int) -> int | None:
        if not self._byte_tokens:
            for tid, bs in self.vocab.token_bytes.items():
                if len(bs) == 1:
                    self._byte_tokens.setdefault(bs[0], tid)
            self._byte_tokens.setdefault(-1, -1)  # marks the table as built
        return self._byte_tokens.get(b)


class EagerMatcher:
    """Per-request cursor over an :class:`EagerGrammar` (implements ``GrammarMatcher``).

    Not thread-safe; owned by one request.
    """

    __slots__ = ("_grammar", "_index", "_guide", "_sentinel", "_eos", "_size", "_num_tokens",
                 "_terminated")

    def __init__(self, grammar: EagerGrammar):
        self._grammar = grammar
        self._index = grammar.index
        self._guide = Guide(grammar.index, max_rollback=_MAX_ROLLBACK)
        self._sentinel = grammar.vocab.sentinel_id
        self._eos = frozenset(grammar.vocab.eos_token_ids)
        self._size = grammar.vocab.model_vocab_size
        self._num_tokens = 0
        self._terminated = False

    @property
    def grammar(self) -> EagerGrammar:
        return self._grammar

    @property
    def backend(self) -> str:
        return "eager"

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (EOS included), i.e. how far :meth:`rollback` can go."""
        return self._num_tokens

    def is_terminated(self) -> bool:
        """True once EOS has been accepted."""
        return self._terminated

    def is_accepting(self) -> bool:
        """True when the output so far fully matches, i.e. EOS is allowed now."""
        return (not self._terminated
                and self._index.get_next_state(self._guide.get_state(), self._sentinel) is not None)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """Length of the longest prefix of ``token_ids`` the grammar admits; no state change.

        EOS counts as admitted only in an accepting state, and nothing is admitted after it.
        """
        if self._terminated:
            return 0
        index, state = self._index, self._guide.get_state()
        for k, tid in enumerate(token_ids):
            if tid in self._eos:
                return k + 1 if index.get_next_state(state, self._sentinel) is not None else k
            if tid == self._sentinel or not 0 <= tid < self._size:
                return k
            state = index.get_next_state(state, tid)
            if state is None:
                return k
        return len(token_ids)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over all of ``token_ids``; if any is refused, return False and change nothing."""
        if self.validate_tokens(token_ids) != len(token_ids):
            return False
        for tid in token_ids:
            if tid in self._eos:
                self._guide.advance(self._sentinel, return_tokens=False)
                self._terminated = True
            else:
                self._guide.advance(tid, return_tokens=False)
        self._num_tokens += len(token_ids)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (an accepted EOS included).

        Raises:
            ValueError: ``num_tokens`` negative or more than were accepted.
        """
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self._num_tokens} tokens")
        if num_tokens == 0:
            return
        self._guide.rollback_state(num_tokens)
        self._num_tokens -= num_tokens
        self._terminated = False  # EOS can only be the last token accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the current state into ``bitmask[row]``.

        Args:
            bitmask: int32 ``[R, ceil(model_vocab_size / 32)]`` on the CPU, rows contiguous.
            row: the row to overwrite.

        After EOS the row allows only the EOS ids (a harmless row if the engine still asks).
        Cost: outlines-core fills the row from the state's token list (no Python list); the
        sentinel→EOS fix-up is two numpy word writes.

        Raises:
            ValueError: wrong dtype, device, width or layout.
        """
        words = self._grammar.vocab.bitmask_words
        if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu"
                or bitmask.dim() != 2 or bitmask.shape[1] != words or bitmask.stride(1) != 1):
            raise ValueError(f"bitmask must be a CPU int32 [R, {words}] tensor with contiguous "
                             f"rows, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"row {row} outside [0, {bitmask.shape[0]})")
        view = bitmask.numpy().view(np.uint32)
        if self._terminated:
            view[row] = 0
            self._set_eos_bits(view[row])
            return
        ptr = bitmask.data_ptr() + row * bitmask.stride(0) * bitmask.element_size()
        self._guide.write_mask_into(ptr, words, 4)
        if self._index.get_next_state(self._guide.get_state(), self._sentinel) is not None:
            s = self._sentinel
            view[row, s >> 5] &= np.uint32(~(1 << (s & 31)) & 0xFFFFFFFF)
            self._set_eos_bits(view[row])

    def forced_tokens(self, max_n: int) -> list[int]:
        """The tokens the grammar allows alone, in a row, from the current state (≤ ``max_n``).

        EOS is included (as ``vocab.eos_token_id``, and last) when it is the only token allowed.
        No state change. A state whose one allowed token is a multi-character string counts;
        one where the *text* is forced but several tokenizations exist does not.
        """
        if self._terminated:
            return []
        out: list[int] = []
        state = self._guide.get_state()
        while len(out) < max_n:
            step = self._grammar.forced_step(state)
            if step is None:
                break
            tid, state = step
            if tid == self._sentinel:
                out.append(self._grammar.vocab.eos_token_id)
                break
            out.append(tid)
        return out

    def forced_text(self, max_bytes: int = 64) -> bytes:
        """The bytes the grammar forces next from the current state, up to ``max_bytes``; no state change.

        Unlike :meth:`forced_tokens` this sees through tokenization: after ``{"name":"Ada"`` in
        a schema with a following ``age`` field it returns ``b',"age":'`` although many token
        sequences spell it. Used to draft tokens that the model then verifies (exact).
        """
        if self._terminated:
            return b""
        return self._forced_from(self._guide.get_state(), max_bytes)

    def forced_text_after(self, token_ids: list[int], max_bytes: int = 64) -> bytes | None:
        """The bytes the grammar would force after ``token_ids``; no state change.

        Returns None when the grammar refuses ``token_ids`` (EOS included). Lets a drafter ask
        "if the model closed the string here, what would follow?" without advancing.
        """
        if self._terminated or self.validate_tokens(token_ids) != len(token_ids):
            return None
        if any(t in self._eos for t in token_ids):
            return None
        index, state = self._index, self._guide.get_state()
        for tid in token_ids:
            state = index.get_next_state(state, tid)
        return self._forced_from(state, max_bytes)

    def _forced_from(self, state: int, max_bytes: int) -> bytes:
        out = bytearray()
        while len(out) < max_bytes:
            step = self._grammar.forced_byte(state)
            if step is None:
                break
            b, state = step
            out.append(b)
        return bytes(out)

    def _set_eos_bits(self, row_view: np.ndarray) -> None:
        for e in self._grammar.vocab.eos_token_ids:
            row_view[e >> 5] |= np.uint32(1 << (e & 31))


class EagerBackend:
    """Builds outlines-core indexes for regex programs, each in a child process with limits.

    Thread-safe: each build takes an idle :class:`~stencil.grammar.backends.index_worker.IndexWorker`
    (or starts one), so concurrent builds run in parallel processes.

    Args:
        vocab: the grammar alphabet.
        timeout_s: limit on one index build → :class:`GrammarTimeout` (the child is killed).
        max_regex_chars: longer regexes are refused → :class:`GrammarError`.
        max_index_bytes: larger indexes (outlines-core binary size, ≈ memory) are refused.
        worker_memory_bytes: address-space limit of each child (``None``: unlimited).
        disk_cache_dir: where index binaries persist across restarts, keyed by sha256 of the
            final regex, the vocabulary fingerprint and the outlines-core version (the *regex*,
            not the spec, so a change in the translation can never serve a stale index);
            ``None`` disables it.
    """

    name = "eager"
    kinds = frozenset({"regex"})

    def __init__(self, vocab: TokenVocabulary, *, timeout_s: float = 10.0, max_regex_chars: int = 200_000,
                 max_index_bytes: int = 256 << 20, worker_memory_bytes: int | None = 4 << 30,
                 disk_cache_dir: Path | None = None):
        self.vocab = vocab
        self.timeout_s = timeout_s
        self._max_regex_chars = max_regex_chars
        self._max_index_bytes = max_index_bytes
        self._worker_memory = worker_memory_bytes
        self._disk = Path(disk_cache_dir) if disk_cache_dir is not None else None
        if self._disk is not None:
            self._disk.mkdir(parents=True, exist_ok=True)
        self._outlines_vocab = vocab.to_outlines()
        self._idle: queue.SimpleQueue[IndexWorker] = queue.SimpleQueue()
        self._busy: set[IndexWorker] = set()  # workers building now (close kills them too)
        self._busy_lock = threading.Lock()
        self._closed = False
        self.disk_hits = 0

    def build(self, program: Program, spec: GrammarSpec | None = None) -> EagerGrammar:
        """The index of ``program`` (from the disk cache when there).

        Raises:
            GrammarError: not a regex, too long, refused by outlines-core, too large, or the
                worker died; :class:`GrammarTimeout` past ``timeout_s``.
        """
        if program.kind != "regex":
            raise GrammarError(f"the eager backend takes regexes, not {program.kind!r} programs "
                               "(use the lazy or auto backend)", keyword="grammar_backend")
        if not program.regular:
            raise GrammarError("the program uses an intersection (a pattern with length bounds or a "
                               "format), which the eager backend cannot index; the lazy backend "
                               "serves it", keyword="grammar_backend")
        size = program.regex_size()
        if size > self._max_regex_chars:
            raise GrammarError(f"regex is {size} characters, above the limit of "
                               f"{self._max_regex_chars}")
        regex = program.regex()
        full = "(?:" + regex + ")" + END_SENTINEL.decode()
        raw = self._disk_load(full)
        if raw is None:
            raw = self._build(full, spec)
            self._disk_store(full, raw)
        else:
            self.disk_hits += 1
        return EagerGrammar(spec=spec, regex=regex, index=index_from_binary(raw), vocab=self.vocab,
                            warnings=program.warnings, index_bytes=len(raw))

    def busy_workers(self) -> list[IndexWorker]:
        """The workers building an index now (a snapshot)."""
        with self._busy_lock:
            return list(self._busy)

    def close(self) -> None:
        """Kill every child process, idle or building (idempotent); returns at once.

        A build in flight is not waited for: its child is killed, and the thread that waits on it
        gets EOF from the pipe at once and raises ``GrammarError`` (the backend is closed). Later
        builds raise the same without starting a child.
        """
        with self._busy_lock:
            self._closed = True
            busy = list(self._busy)
        for worker in busy:
            worker.kill()
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    # -- workers ------------------------------------------------------------------------------

    def _build(self, full_regex: str, spec: GrammarSpec | None) -> bytes:
        worker = self._idle_worker()
        try:
            return worker.build(full_regex, self.timeout_s, self._max_index_bytes)
        except WorkerTimeout:
            raise GrammarTimeout(f"grammar compilation exceeded {self.timeout_s:g} s") from None
        except WorkerDied as e:
            if self._closed:
                raise _closed_error() from None
            raise GrammarError(f"grammar too large: the compile worker died ({e}); memory limit "
                               f"{self._worker_memory} bytes") from None
        except BuildFailed as e:
            raise _explain(e, spec) from None
        finally:
            self._release(worker)

    def _idle_worker(self) -> IndexWorker:
        """An idle worker, or a new one, marked busy (so that ``close`` can kill it)."""
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                if self._closed:
                    raise _closed_error() from None
                try:
                    worker = IndexWorker(self._outlines_vocab, self._worker_memory)
                except (WorkerDied, WorkerTimeout) as e:
                    raise (_closed_error() if self._closed else
                           GrammarError(f"cannot start a grammar compile worker: {e}")) from None
            with self._busy_lock:
                if worker.alive and not self._closed:
                    self._busy.add(worker)
                    return worker
            worker.close()

    def _release(self, worker: IndexWorker) -> None:
        with self._busy_lock:
            self._busy.discard(worker)
            keep = worker.alive and not self._closed
        if keep:
            self._idle.put(worker)
        else:
            worker.close()

    # -- disk cache ---------------------------------------------------------------------------

    def _disk_path(self, full_regex: str) -> Path | None:
        if self._disk is None:
            return None
        h = hashlib.sha256()
        for part in (full_regex, self.vocab.fingerprint, OUTLINES_VERSION):
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


def _closed_error() -> GrammarError:
    return GrammarError("the grammar compiler closed before the index was built")


def _explain(failure: BuildFailed, spec: GrammarSpec | None) -> GrammarError:
    from stencil.grammar.regex_tools import locate_syntax_error

    if failure.kind == "syntax" and spec is not None and spec.kind == "regex":
        pos, msg = locate_syntax_error(spec.value)
        return GrammarError(f"invalid regex: {msg or failure.message}", position=pos)
    if failure.kind == "vocabulary":
        return GrammarError("no token sequence can produce this pattern: " + failure.message)
    if failure.kind == "too_large":
        return GrammarError("grammar too large: " + failure.message)
    kind = spec.kind if spec is not None else "grammar"
    return GrammarError(f"cannot compile {kind}: {failure.message}")
