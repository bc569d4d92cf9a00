"""llguidance's C API, for the grammars its own JSON Schema front end builds.

The Python ``LLMatcher`` takes a JSON Schema grammar only with llguidance's token forcing on:
where the grammar forces bytes, its mask is the one canonical token of them (as its tokenizer
callback spells them), which would make the lazy backend accept fewer token sequences than the
eager index and than a Lark grammar with ``%llguidance {"no_forcing": true}``. A Lark grammar
avoids that, but every Lark grammar costs llguidance a fixed ~1 ms before its first item (it
builds its Lark lexer anew each time: ``parser/src/lark/lexer.rs``, ``lex_lark``), about what
its whole JSON front end takes for a median MaskBench schema.

The C API in the same library (``parser/llguidance.h``, ``parser/src/ffi.rs``) takes a tokenizer
without a tokenize function (``use_approximate_greedy_tokenize_fn``); such a tokenizer is not
canonical (``tokenize_is_canonical`` is false), and llguidance never forces tokens with it
(``can_force_bytes`` in ``parser/src/tokenparser.rs``): masks are computed with the forced bytes
as a prefix, exactly as with ``no_forcing`` (checked on 37,739 masks of 150 MaskBench schemas,
and in ``tests/grammar/test_grammar_handover.py``). So a JSON Schema grammar built here has the masks
of ``start: %json {...}`` with ``no_forcing``, without the Lark front end.

Only what ``LazyMatcher`` needs is bound; each :class:`CMatcher` method has the name and meaning
of the Python ``LLMatcher`` method it stands for. Every call releases the GIL (ctypes), as the
Python bindings do. Structures follow llguidance 1.9.1's header; the version is checked.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref

from stencil.grammar.vocab import TokenVocabulary

VERIFIED_VERSION = "llguidance@1.9.1"  # the C structures below are this release's
_SPECIAL = b"\xff"  # TokTrie::SPECIAL_TOKEN_MARKER: a token no grammar byte can match

_u32, _size, _vp, _bool = ctypes.c_uint32, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_bool


class _TokenizerInitV2(ctypes.Structure):
    _fields_ = [("struct_size", _size), ("vocab_size", _u32), ("tok_eos", _u32),
                ("token_lens", ctypes.POINTER(_u32)), ("token_bytes", ctypes.c_char_p),
                ("tokenizer_json", ctypes.c_char_p), ("tokenize_assumes_string", _bool),
                ("tokenize_fn", _vp), ("use_approximate_greedy_tokenize_fn", _bool),
                ("tokenize_user_data", _vp), ("slices", _vp), ("tok_eos_extra", ctypes.POINTER(_u32)),
                ("tok_eos_extra_count", _u32)]


_INIT_BYTES = 512  # room for LlgConstraintInit (about 90 bytes in 1.9.1); filled by the library
_INIT_STDERR_LOG = 12  # offset of ``log_stderr_level`` (after the tokenizer pointer and buffer level)
_INIT_MAX_ITEMS_IN_ROW = 24  # offset of ``limits.max_items_in_row`` (size_t; llguidance's default 2,000)
# Earley items one row of the parser may hold. llguidance's 2,000 failed requests mid-answer on
# Lark grammars well inside every other limit: a rule of 5,000 literal alternatives, a chain of
# 1,000 rules (two items a link). 10,000 serves those; the per-step limits (``step_max_items``,
# the lexer's fuel) still bound every mask, and a request that reaches one fails alone with a 400
# (``stencil.grammar.base.GrammarLimitError``).
MAX_ITEMS_IN_ROW = 10_000


def _signatures(lib) -> None:
    sig = {
        "llg_get_version": ([], ctypes.c_char_p),
        "llg_new_tokenizer_v2": ([ctypes.POINTER(_TokenizerInitV2), ctypes.c_char_p, _size], _vp),
        "llg_free_tokenizer": ([_vp], None),
        "llg_constraint_init_set_defaults": ([_vp, _vp], None),
        "llg_new_matcher": ([_vp, ctypes.c_char_p, ctypes.c_char_p], _vp),
        "llg_clone_matcher": ([_vp], _vp),
        "llg_free_matcher": ([_vp], None),
        "llg_matcher_get_error": ([_vp], ctypes.c_char_p),
        "llg_matcher_is_error": ([_vp], _bool),
        "llg_matcher_is_accepting": ([_vp], _bool),
        "llg_matcher_is_stopped": ([_vp], _bool),
        "llg_matcher_compute_mask_into": ([_vp, _vp, _size], ctypes.c_int32),
        "llg_matcher_consume_token": ([_vp, _u32], ctypes.c_int32),
        "llg_matcher_consume_tokens": ([_vp, ctypes.POINTER(_u32), _size], ctypes.c_int32),
        "llg_matcher_validate_tokens": ([_vp, ctypes.POINTER(_u32), _size], ctypes.c_int32),
        "llg_matcher_rollback": ([_vp, _size], ctypes.c_int32),
        "llg_matcher_reset": ([_vp], ctypes.c_int32),
    }
    for name, (args, res) in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


_LIB = None
_LIB_LOCK = threading.Lock()


class _Freer:
    """Frees llguidance matchers on a daemon thread of its own.

    A matcher that has served requests holds the lexer states it built (``CMatcher.reset``
    keeps them), and freeing them is work in proportion: 0.05-0.1 ms for a MaskBench schema
    after its instances, paid by whichever thread drops the last reference, often the one about
    to compile the next grammar. ``llg_free_matcher`` releases the GIL (ctypes), so on its own
    thread the work runs beside that compile. A matcher shares nothing that its free could
    disturb (llguidance keeps the grammar and tokenizer it uses behind atomic reference counts).
    Matchers still queued when the interpreter exits are left to the process's end.

    They go to the thread ``FREE_BATCH`` at a time: waking it is a system call that cost the
    dropping thread 10-20 us each time (two matchers per MaskBench schema), where a batch pays
    it once. So up to ``FREE_BATCH - 1`` dropped matchers wait for the next ones.
    """

    def __init__(self) -> None:
        import queue
        from collections import deque

        self._pending: deque = deque()  # (lib, ptr) dropped, not yet handed to the thread
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # batches for the thread
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __call__(self, lib, ptr: int) -> None:
        # Called by finalizers, which the garbage collector may run anywhere: nothing here waits
        # (``deque`` appends and pops and ``SimpleQueue.put`` are atomic and reentrant: two
        # callers that both see a full batch each take distinct matchers; a busy lock means
        # another call is starting the thread).
        pending = self._pending
        pending.append((lib, ptr))
        if len(pending) < FREE_BATCH:
            return
        batch = []
        try:
            while len(batch) < FREE_BATCH:
                batch.append(pending.popleft())
        except IndexError:
            pass
        if not batch:
            return
        self._queue.put(batch)
        if self._thread is None and self._lock.acquire(blocking=False):
            try:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="llg-free", daemon=True)
                    self._thread.start()
            finally:
                self._lock.release()

    def _run(self) -> None:
        while True:
            for lib, ptr in self._queue.get():
                lib.llg_free_matcher(ptr)


FREE_BATCH = 8  # dropped matchers handed to the freeing thread at once (``_Freer``)
_FREE = _Freer()


def library():
    """The llguidance shared library with the signatures set, or None when this llguidance is
    not the release the structures were written for (then nothing is handed over)."""
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            import llguidance

            lib = ctypes.CDLL(os.path.join(os.path.dirname(llguidance.__file__), "_lib.abi3.so"))
            _signatures(lib)
            version = (lib.llg_get_version() or b"").decode()
            _LIB = lib if version.split()[0] == VERIFIED_VERSION else False
        return _LIB or None


class CTokenizer:
    """A non-canonical llguidance tokenizer over a :class:`TokenVocabulary` (the same bytes per
    id as ``LazyBackend``'s Python tokenizer: ids without bytes are special tokens), and the
    constraint settings every matcher is built with (no logging to stderr).

    Raises:
        RuntimeError: llguidance refused the vocabulary, or its version is not the verified one.
    """

    def __init__(self, vocab: TokenVocabulary):
        lib = library()
        if lib is None:
            raise RuntimeError(f"llguidance's C API is used with {VERIFIED_VERSION} only")
        self._lib = lib
        n = vocab.model_vocab_size
        tokens = [vocab.token_bytes.get(i) or _SPECIAL + f"<[{i}]>".encode() for i in range(n)]
        lens = (_u32 * n)(*map(len, tokens))
        blob = b"".join(tokens)
        eos = sorted(vocab.eos_token_ids)
        first = vocab.eos_token_id if vocab.eos_token_id in eos else eos[0]
        extra = [e for e in eos if e != first]
        extra_arr = (_u32 * max(1, len(extra)))(*extra)
        init = _TokenizerInitV2(struct_size=ctypes.sizeof(_TokenizerInitV2), vocab_size=n, tok_eos=first,
                                token_lens=lens, token_bytes=blob, use_approximate_greedy_tokenize_fn=True,
                                tok_eos_extra=extra_arr if extra else None, tok_eos_extra_count=len(extra))
        err = ctypes.create_string_buffer(1024)
        ptr = lib.llg_new_tokenizer_v2(ctypes.byref(init), err, len(err))
        if not ptr:
            raise RuntimeError(f"llguidance refused the vocabulary: {err.value.decode(errors='replace')}")
        self._ptr = ptr
        self._init = ctypes.create_string_buffer(_INIT_BYTES)
        lib.llg_constraint_init_set_defaults(self._init, ptr)
        ctypes.memmove(ctypes.addressof(self._init) + _INIT_STDERR_LOG, ctypes.byref(_u32(0)), 4)
        items = _size.from_buffer(self._init, _INIT_MAX_ITEMS_IN_ROW)
        if items.value == 2000:  # (the field where 1.9.1 keeps it: checked before it is written)
            items.value = MAX_ITEMS_IN_ROW
        self.mask_bytes = 4 * ((n + 31) // 32)
        # for forced bytes (``compute_ff_bytes``): each id's bytes, length and first byte (-1: none)
        self.token_bytes = vocab.token_bytes
        self.eos = frozenset(eos)
        import numpy as np

        self.token_len = np.array([len(vocab.token_bytes[i]) if i in vocab.token_bytes and i not in self.eos
                                   else 1 << 20 for i in range(n)], dtype=np.int64)
        self.first_byte = np.array([vocab.token_bytes[i][0] if i in vocab.token_bytes and i not in self.eos
                                    else -1 for i in range(n)], dtype=np.int16)
        self._finalizer = weakref.finalize(self, lib.llg_free_tokenizer, ptr)

    def matcher(self, kind: str, data: str) -> "CMatcher":
        """A matcher of grammar ``data`` of ``kind`` ("json" for a JSON Schema); check its
        ``is_error()``, as with the Python ``LLMatcher``.

        Raises:
            GrammarError: ``data`` holds a lone surrogate (U+D800-U+DFFF: a Python schema may;
                JSON text cannot), which no UTF-8 output can spell.
        """
        try:
            raw = data.encode()
        except UnicodeEncodeError as e:
            from stencil.grammar.base import GrammarError

            raise GrammarError(f"the constraint holds a lone surrogate (U+{ord(e.object[e.start]):04X}), "
                               "which no UTF-8 text can spell") from None
        ptr = self._lib.llg_new_matcher(self._init, kind.encode(), raw)
        return CMatcher(self._lib, ptr, self)


class CMatcher:
    """One llguidance matcher (``LlgMatcher``), with the Python ``LLMatcher``'s method names."""

    __slots__ = ("_lib", "_ptr", "_tok", "__weakref__")

    def __init__(self, lib, ptr: int, tokenizer: CTokenizer):
        if not ptr:
            raise MemoryError("llguidance returned no matcher")
        self._lib = lib
        self._ptr = ptr
        self._tok = tokenizer  # keeps the tokenizer alive while the matcher lives

    def __del__(self) -> None:
        # Freed when the last reference goes (``_FREE``'s thread). Not at the interpreter's exit,
        # when the process's end frees it (and the thread may be gone). A ``__del__``, not a
        # ``weakref.finalize``: one fifth of the cost per matcher, on every new schema's path.
        ptr = getattr(self, "_ptr", 0)  # (unset where ``__init__`` raised)
        self._ptr = 0
        if ptr and not sys.is_finalizing():
            try:
                _FREE(self._lib, ptr)
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass

    @property
    def freed(self) -> bool:
        """Whether ``__del__`` has run (its pointer handed to the freeing thread). A cursor's
        finalizer can still see such a matcher: the garbage collector finalizes every object of
        an unreachable cycle, in no set order, so the matcher of a cursor caught in a cycle may
        be finalized before the cursor that gives it back, or after, in the same collection
        (``lazy.LazyGrammar._give_back`` refuses it, ``_copy_root`` skips it)."""
        return not self._ptr

    def deep_copy(self) -> "CMatcher":
        return CMatcher(self._lib, self._lib.llg_clone_matcher(self._ptr), self._tok)

    def is_error(self) -> bool:
        return self._lib.llg_matcher_is_error(self._ptr)

    def get_error(self) -> str:
        err = self._lib.llg_matcher_get_error(self._ptr)
        return "" if err is None else err.decode(errors="replace")

    def stop_reason(self) -> str:
        """The C API has no stop reason of its own; the error text names it."""
        return self.get_error()

    def is_accepting(self) -> bool:
        return self._lib.llg_matcher_is_accepting(self._ptr)

    def is_stopped(self) -> bool:
        return self._lib.llg_matcher_is_stopped(self._ptr)

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> bool:
        """Write the mask into ``nbytes`` bytes at address ``ptr`` (the vocabulary's width).
        True when llguidance computed it; False on a failure, which leaves the matcher in its
        error state (``is_error``; no token can continue is one: "NoExtension")."""
        return self._lib.llg_matcher_compute_mask_into(self._ptr, ptr, nbytes) == 0

    def consume_token(self, token: int) -> bool:
        return self._lib.llg_matcher_consume_token(self._ptr, token) == 0

    def consume_tokens(self, tokens: list[int]) -> bool:
        arr = (_u32 * len(tokens))(*tokens)
        return self._lib.llg_matcher_consume_tokens(self._ptr, arr, len(tokens)) == 0

    def validate_tokens(self, tokens: list[int]) -> int:
        arr = (_u32 * len(tokens))(*tokens)
        return max(0, self._lib.llg_matcher_validate_tokens(self._ptr, arr, len(tokens)))

    def rollback(self, num_tokens: int) -> bool:
        return self._lib.llg_matcher_rollback(self._ptr, num_tokens) == 0

    def reset(self) -> bool:
        """Back to the start state, keeping the lexer states built so far (a clone,
        ``llg_clone_matcher``, copies them once and shares nothing after: each copy of a root
        builds them again, which the Python ``deep_copy`` avoids by sharing them). False when the
        matcher is in an error state (llguidance cannot reset one)."""
        return self._lib.llg_matcher_reset(self._ptr) == 0

    def compute_ff_bytes(self, max_bytes: int = 64, mask=None) -> bytes:
        """Bytes the grammar forces next, read from masks (the C API computes forced tokens for
        canonical tokenizers only): while the state is not accepting and its allowed tokens (a
        few) all begin with the shortest of them, that token's bytes are forced (every
        continuation begins with some allowed token); it is consumed and the next mask read.
        Exact. The tokens are consumed on this matcher (whose lexer states stay built) and
        rolled back at the end: no state change. ``mask``: the current state's mask when the
        caller has it (uint32 words), which saves the first step's computation."""
        import numpy as np

        tok = self._tok
        buf = np.zeros(tok.mask_bytes // 4, dtype=np.uint32)
        out, taken = b"", 0
        try:
            while len(out) < max_bytes and not (self.is_accepting() or self.is_stopped() or self.is_error()):
                if mask is None or taken:
                    self.unsafe_compute_mask_ptr(buf.ctypes.data, tok.mask_bytes)
                    if self.is_error():
                        break
                    mask = buf
                words = np.flatnonzero(mask)
                if words.size == 0:
                    break
                bits = np.unpackbits(mask[words].view(np.uint8), bitorder="little").reshape(words.size, 32)
                ids = (words[:, None] * 32 + np.arange(32))[bits.astype(bool)]
                ids = ids[ids < len(tok.token_len)]
                if ids.size == 0:
                    break
                tid = int(ids[np.argmin(tok.token_len[ids])])
                first = tok.token_bytes.get(tid)
                if first is None or tid in tok.eos:
                    break
                if np.any(tok.first_byte[ids] != first[0]):
                    break
                if len(first) > 1 and (ids.size > 256 or any(
                        not tok.token_bytes[i].startswith(first) for i in ids.tolist())):
                    break
                if not self.consume_token(tid):
                    break
                taken += 1
                out += first
        finally:
            if taken:
                self.rollback(taken)
        return out[:max_bytes]
