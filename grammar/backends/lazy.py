"""The lazy backend: llguidance's matcher, fed by Stencil's own regexes and Lark grammars.

llguidance (guidance-ai/llguidance, MIT) keeps a lexer of lazily built derivative states
(Brzozowski derivatives; Owens, Reppy and Turon 2009, "Regular-expression derivatives
re-examined") under an Earley parser, so nothing is computed for a state until a sequence reaches
it: a grammar is ready in about a millisecond, whatever its size, and a mask costs microseconds to
a few hundred (llguidance's optimizations note,
github.com/guidance-ai/llguidance/blob/main/docs/optimizations.md). The input is the regex (or Lark grammar)
that :mod:`stencil.grammar.json_schema` wrote, so exactness, key order and whitespace are the same as on
the eager backend; or, for a "json" program, a schema for llguidance's own JSON front end whose
language is provably that same one (``json_schema.handover``), built through its C API
(``llg_c``), which needs no Lark text and forces no tokens.

The alphabet is the :class:`~stencil.grammar.vocab.TokenVocabulary` itself (its token bytes, not the
tokenizer's own decoder), so both backends see the same bytes for every id; ids outside the
alphabet are handed to llguidance as special tokens, which no grammar here can produce. EOS is the
vocabulary's EOS ids, allowed exactly in accepting states.

Source of the API: llguidance 1.9 ``python/llguidance/_lib.pyi`` (``LLMatcher``,
``LLTokenizer``, ``LLExecutor``).
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
import threading

import numpy as np
import torch

from stencil.grammar.backends.llg_c import CMatcher
from stencil.grammar.base import DeadEndError, GrammarError, GrammarLimitError, Program
from stencil.grammar.vocab import TokenVocabulary

MATCHER_POOL_SIZE = 4  # reset llguidance matchers kept per grammar for later cursors (``_give_back``)
MASK_THREADS = 8  # most threads computing one step's masks (``prefetch_masks``)
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


class _VocabTokenizer:
    """The object ``llguidance.LLTokenizer`` reads a vocabulary from (its ``TokenizerWrapper``
    protocol): ``tokens`` (bytes per id), ``eos_token_id``, ``bos_token_id``,
    ``special_token_ids``, and a call that tokenizes bytes (greedy longest match over the
    vocabulary: only used by llguidance for its own forced-token helpers, which Stencil does not
    call)."""

    def __init__(self, vocab: TokenVocabulary):
        n = vocab.model_vocab_size
        self.tokens = [vocab.token_bytes.get(i) or f"<[{i}]>".encode() for i in range(n)]
        self.special_token_ids = [i for i in range(n) if i not in vocab.token_bytes]
        self.eos_token_id = vocab.eos_token_id
        self.bos_token_id = None
        self.is_tokenizer_wrapper = True
        self._by_bytes = {b: i for i, b in vocab.token_bytes.items()}
        self._longest = max((len(b) for b in vocab.token_bytes.values()), default=1)

    def __call__(self, text) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        out, i = [], 0
        while i < len(data):
            for j in range(min(len(data), i + self._longest), i, -1):
                tid = self._by_bytes.get(data[i:j])
                if tid is not None:
                    out.append(tid)
                    i = j
                    break
            else:
                i += 1  # a byte no token spells: skipped (never produced by a grammar here)
        return out


class LazyBackend:
    """Builds llguidance matchers for programs over one vocabulary (thread-safe).

    Every program is built through llguidance's C API (``llg_c``: one tokenizer, no token
    forcing) when the installed llguidance is the release its structures were written for;
    otherwise regex and Lark programs go through the Python bindings (``LLTokenizer``,
    ``LLMatcher`` with ``no_forcing``: the same masks) and JSON programs are not handed over.
    One tokenizer matters at large vocabularies: each holds the token trie and llguidance's
    slices, ~99 MB at Gemma 3's 262,144 tokens (35 MB without the slices), and both used to be
    built.

    Args:
        vocab: the grammar alphabet.
        limits: ``llguidance.LLParserLimits`` (``None``: llguidance's defaults, which bound the
            lexer's fuel per step and the parser's items, so no mask is unbounded); other limits
            are set through the Python bindings (regex and Lark programs built there).
    """

    name = "lazy"
    kinds = frozenset({"regex", "lark", "json"})

    def __init__(self, vocab: TokenVocabulary, limits=None):
        import llguidance

        from stencil.grammar.backends.llg_c import library

        self._llg = llguidance
        self.vocab = vocab
        self._limits = limits
        self._tokenizer = None  # llguidance.LLTokenizer, made where the C API is not used
        self._executor = None
        self._pool = None  # threads computing the masks of C matchers in parallel (``mask_pool``)
        self._lock = threading.Lock()
        self.eos = frozenset(vocab.eos_token_ids)
        self._c_tokenizer = None  # llg_c.CTokenizer
        self.checked = None  # (bitmask, row stride in bytes, rows): the last one a matcher checked
        self.uses_c_api = library() is not None
        if self.uses_c_api:
            self.c_tokenizer()  # ~0.5 s for 49 k tokens, 2.7 s for 262 k: paid up front
        if not self.uses_c_api or limits is not None:
            self.tokenizer  # noqa: B018 - (built up front, as above)
        self.eos_bits = tuple((e >> 5, np.uint32(1 << (e & 31))) for e in sorted(self.eos))
        words: dict[int, int] = {}
        for w, bit in self.eos_bits:
            words[w] = words.get(w, 0) | int(bit)
        self.eos_words = tuple(words.items())  # (word, its EOS bits) as ints, for a memoryview's reads

    def build(self, program: Program) -> "LazyGrammar":
        """A grammar ready for matchers; the first mask is computed here, so errors show now.

        Raises:
            GrammarError: the regex or grammar is invalid for llguidance (for Lark, with the line
                and column of the fault in ``position``-free text and ``line``/``column``).
        """
        llg = self._llg
        if program.kind == "json":
            root = self.c_tokenizer().matcher("json", program.text)
            if root.is_error():
                raise GrammarError("llguidance refused the schema handed to it: "
                                   + (root.get_error().strip().splitlines() or ["?"])[0])
            return LazyGrammar(self, root, program)
        if program.kind not in ("regex", "lark"):
            raise GrammarError(f"the lazy backend cannot take a {program.kind!r} program")
        if self.uses_c_api and self._limits is None:
            # The C tokenizer is not canonical, so llguidance forces no tokens: a Lark grammar's
            # masks are those of ``no_forcing`` (appended all the same: it is the meaning).
            if program.kind == "regex" and not program.terminals and program.regular:
                # (an intersection, ``&``, has no plain-regex form: such a program goes as Lark)
                root = self.c_tokenizer().matcher("regex", program.text)
            else:
                root = self.c_tokenizer().matcher("lark", program.lark() + "\n" + _NO_FORCING)
            if root.is_error():
                raise _explain(program, root.get_error())
            return LazyGrammar(self, root, program)
        if program.kind == "regex" and not program.terminals and program.regular:
            top = json.loads(llg.LLMatcher.grammar_from_regex(program.text))
        else:
            top = {"grammars": [{"lark_grammar": program.lark()}]}
        # llguidance normally narrows a mask to the canonical tokenization of bytes the grammar
        # forces ("xyz" as one token, not x-y-z); the eager index allows every tokenization, and
        # so must this backend, or the two would accept different token sequences.
        for g in top["grammars"]:
            if g.get("lark_grammar") is not None:
                g["lark_grammar"] = g["lark_grammar"] + "\n" + _NO_FORCING
        grammar = json.dumps(top)
        kw = {} if self._limits is None else {"limits": self._limits}
        root = llg.LLMatcher(self.tokenizer, grammar, log_level=0, **kw)
        if root.is_error():
            raise _explain(program, root.get_error())
        return LazyGrammar(self, root, program)

    @property
    def tokenizer(self):
        """The vocabulary as an ``llguidance.LLTokenizer`` of the Python bindings (made on first
        use: only where programs are built there, see the class docstring)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._llg.LLTokenizer(_VocabTokenizer(self.vocab),
                                                        n_vocab=self.vocab.model_vocab_size,
                                                        eos_token=list(self.vocab.eos_token_ids))
            return self._tokenizer

    def c_tokenizer(self):
        """The vocabulary as a tokenizer of llguidance's C API (``llg_c``: programs are built
        there without token forcing; JSON ones without the Lark front end); made once."""
        with self._lock:
            if self._c_tokenizer is None:
                from stencil.grammar.backends.llg_c import CTokenizer

                self._c_tokenizer = CTokenizer(self.vocab)
            return self._c_tokenizer

    def executor(self):
        """A shared ``llguidance.LLExecutor`` for filling many rows at once (created on first use)."""
        with self._lock:
            if self._executor is None:
                self._executor = self._llg.LLExecutor()
            return self._executor

    def mask_pool(self) -> tuple:
        """``(pool, workers)``: threads for the masks of C API matchers (``prefetch_masks``), one
        fewer than the CPUs this process may use (the calling thread takes a share), made on
        first use; ``(None, 0)`` on one CPU."""
        with self._lock:
            if self._pool is None:
                import os
                from concurrent.futures import ThreadPoolExecutor

                cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
                n = min(cpus, MASK_THREADS) - 1
                self._pool = (ThreadPoolExecutor(n, thread_name_prefix="llg-mask"), n) if n > 0 else (None, 0)
            return self._pool

    def close(self) -> None:
        """Let the mask threads go (matchers still alive compute their masks on the caller's)."""
        with self._lock:
            pool, self._pool = self._pool, (None, 0)
        if pool is not None and pool[0] is not None:
            pool[0].shutdown(wait=False)


_LARK_AT = re.compile(r"(?:at )?(\d+)\((\d+)\):\s*")
_NO_FORCING = "%llguidance {\"no_forcing\": true}\n"  # appended: the user's line numbers stay


def _explain(program: Program, message: str) -> GrammarError:
    """A GrammarError from llguidance's message: first line only, with line/column for Lark."""
    lines = message.strip().splitlines()
    first = lines[0] if lines else "invalid grammar"
    if first.rstrip().endswith(":"):
        # A regex parse error puts its reason on a later "error: ..." line, after a picture of the regex.
        reason = next((ln.strip()[len("error:"):].strip() for ln in lines[1:] if ln.strip().startswith("error:")), "")
        if reason:
            first = f"{first.rstrip()} {reason}"
    if program.kind == "lark":
        m = _LARK_AT.search(first)
        if m:
            line, col = int(m.group(1)), int(m.group(2))
            text = first[m.end():]
            return GrammarError(f"invalid Lark grammar at line {line}, column {col}: {text}",
                                keyword="grammar", line=line, column=col)
        return GrammarError(f"invalid Lark grammar: {first}", keyword="grammar")
    return GrammarError(f"cannot compile regex: {first}")


class LazyGrammar:
    """An llguidance grammar with a warmed root matcher; ``matcher()`` deep-copies it (≈ 2 µs).

    The root's first mask was computed at build time, so a copy starts with the lexer states of
    the start already built, and with that mask itself: every matcher starts in the root state,
    whose mask is the same for all (computing it again cost ≈ 90 µs of each request's time to
    first mask)."""

    kind = "lazy"

    def __init__(self, backend: LazyBackend, root, program: Program):
        self.backend = backend
        self.program = program
        self.regex = program.text if program.kind == "regex" else None
        self.vocab = backend.vocab
        self._root = root
        self._root_lock = threading.Lock()
        self._handed_out = False  # a cursor shares the root (the first one: ``matcher``)
        self._pool: list = []  # llguidance matchers of finished cursors, reset (``_give_back``)
        probe = LazyMatcher(self, root)
        try:
            # Warms the start's lexer states; the mask is kept for every matcher's first step.
            probe._current_mask()
            self._root_buf = (probe._view, probe._bits, probe._mask_ptr)
        except RuntimeError:
            if root.is_error() and "NoExtension" not in root.get_error():
                raise GrammarError("cannot compile: " + root.get_error().strip().splitlines()[0]) from None
            what = "pattern" if program.kind == "regex" else "grammar"
            raise GrammarError(f"no token sequence can produce this {what}: no token of the vocabulary "
                               f"can start it (its first bytes are none the vocabulary spells, or the "
                               f"{what} has no finite output, as 'start: start')") from None
        finally:
            probe._m = None  # the root stays the grammar's: never given back to the pool
        self.nbytes = 0

    def matcher(self) -> "LazyMatcher":
        """A cursor at the start, with the root's mask (its buffer shared until the cursor's
        first own mask). The first cursor of a grammar also shares the root matcher until its
        first step, so the grammar's first mask costs no copy (``deep_copy``, 0.1-0.3 ms); later
        cursors get their llguidance matcher here, before their first step, so no step of theirs
        waits for it: a finished cursor's, reset (``_give_back``), or else a copy of the root."""
        with self._root_lock:
            first, self._handed_out = not self._handed_out, True
        return LazyMatcher(self, None if first else self._copy_root(), self._root_buf, shared=True)

    def _copy_root(self):
        """An llguidance matcher in the start state: a pooled one, reset, else a copy of the root."""
        while True:
            with self._root_lock:
                if not self._pool:
                    return self._root.deep_copy()
                m = self._pool.pop()
            if getattr(m, "freed", False):  # finalized in the very collection that gave it back
                continue
            try:
                if m.reset():  # (False in an error state: that one is dropped)
                    return m
            except Exception:  # noqa: BLE001 - a matcher that cannot be reset is not reused
                pass

    def _give_back(self, m) -> None:
        """Keep the llguidance matcher of a finished cursor for a later one (at most
        ``MATCHER_POOL_SIZE``), which resets it to the start state when it takes it (so a
        grammar about to be dropped with its pool wastes no reset).

        Why: the lexer states a matcher built (derivatives of the regexes it met) stay with it
        through a reset, while a copy of the root starts from the root's only. llguidance's C API
        copies a matcher deeply (``llg_clone_matcher``), so the cursors of a "json" program
        never share those states as the Python ``deep_copy`` does; a reused matcher has them. On
        MaskBench (ten instances per schema, one cursor each) that halved the masks above 131 µs
        of ``Github_hard---o90714`` (82 to 42) and took those of the 537 handed-over schemas of a
        600-schema sample from 1,989 to 1,729. Each kept matcher holds its lexer states while the
        grammar is cached (about 0.1 MB after a few answers). A matcher in an error state is
        dropped (it cannot be reset), and so is one already finalized, here and again when
        ``_copy_root`` takes it: a cursor caught in a reference cycle (an exception's traceback
        holds one) is finalized by the garbage collector together with its matcher, in either
        order, so the matcher may be freed before the cursor gives it back or just after (in
        the same collection); a freed matcher reused crashed the next cursor's reset
        (``CMatcher.freed``)."""
        if len(self._pool) >= MATCHER_POOL_SIZE or sys.is_finalizing() or getattr(m, "freed", False):
            return
        # Never waits: this runs from ``__del__``, which the garbage collector may call on a
        # thread that holds this very lock (``_copy_root`` allocating); then the matcher is freed.
        if self._root_lock.acquire(blocking=False):
            try:
                if len(self._pool) < MATCHER_POOL_SIZE:
                    self._pool.append(m)
            finally:
                self._root_lock.release()


class LazyMatcher:
    """Per-request cursor over a :class:`LazyGrammar` (implements ``GrammarMatcher``).

    The mask of the current state is computed once and kept until the state changes: the
    scheduler asks for forced tokens after every step and the engine for the bitmask row before
    the next one, both from the same state. Not thread-safe; owned by one request.

    The per-token path is kept to a few calls into llguidance, because Python around them cost
    more than llguidance's own work (MaskBench-dev, median token: about 10 us in llguidance, 100
    us in the wrapper before): the mask is checked with one ``count_nonzero`` (not a list of its
    set words), copied into the caller's row with one ``memmove``, and a token the valid mask
    allows is consumed without a separate validation.
    """

    __slots__ = ("_grammar", "_m", "_vocab", "_eos", "_eos_bits", "_words", "_num_tokens", "_terminated",
                 "_view", "_bits", "_mask_ptr", "_mask_valid", "_checked", "_mask_shared", "_size")

    def __init__(self, grammar: LazyGrammar, m, mask: tuple | None = None, shared: bool = False):
        """``m``: llguidance's matcher, or None for the grammar's root, copied at the first step
        (``_own``). ``mask``: the current state's mask when the caller knows it, as another
        matcher holds it (``(_view, _bits, _mask_ptr)``: uint32 ``[words]``, its memoryview, its
        address; ``shared``: the root's, never written, else owned by this matcher from now on),
        or None (computed on first use).

        The masks live in numpy arrays, not tensors: a torch call on the path of a new schema
        (to its first mask) cost 40-50 us each where the CPU's caches had gone cold between
        schemas, as they do between a server's requests (MaskBench's harness, median schema: the
        allocation and the views of a tensor took 0.09 ms of 1.3; numpy's 0.025).
        """
        self._grammar = grammar
        self._m = m
        self._vocab = grammar.backend.vocab
        self._eos = grammar.backend.eos
        self._eos_bits = grammar.backend.eos_bits
        self._words = self._vocab.bitmask_words
        self._size = self._vocab.model_vocab_size
        self._num_tokens = 0
        self._terminated = False
        if mask is None:
            self._set_buffer(np.zeros(self._words, np.uint32))
        else:
            self._view, self._bits, self._mask_ptr = mask
        self._mask_shared = shared
        self._mask_valid = mask is not None
        self._checked = None  # (bitmask, row stride in bytes, rows) of the last bitmask checked

    def _own(self) -> None:
        """Copy the root matcher for this cursor alone (before its first step)."""
        if self._m is None:
            self._m = self._grammar._copy_root()

    def __del__(self) -> None:
        # The cursor is done (its request finished, or the caller made a new one): its matcher,
        # with the lexer states it built, serves a later cursor of the grammar.
        m = getattr(self, "_m", None)
        if m is not None:
            self._m = None
            try:
                self._grammar._give_back(m)
            except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter exit)
                pass

    def _set_buffer(self, mask: np.ndarray) -> None:
        """Keep the current state's mask in ``mask`` (uint32 ``[words]``, contiguous)."""
        self._mask_shared = False
        self._view = mask
        self._bits = memoryview(mask)  # the same words, read one at a time as Python ints
        self._mask_ptr = mask.__array_interface__["data"][0]

    @property
    def grammar(self) -> LazyGrammar:
        return self._grammar

    @property
    def backend(self) -> str:
        return "lazy"

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def is_terminated(self) -> bool:
        return self._terminated

    def is_accepting(self) -> bool:
        if self._terminated:
            return False
        if self._m is None:
            with self._grammar._root_lock:
                return self._grammar._root.is_accepting()
        return self._m.is_accepting()

    def _check(self) -> None:
        self._own()
        if self._m.is_error():
            if "NoExtension" in self._m.get_error() or "NoExtension" in str(self._m.stop_reason()):
                raise _dead_end()
            error = self._m.get_error().strip().splitlines()[0]
            if any(mark in error.lower() for mark in _LIMIT_MARKS):
                raise GrammarLimitError(f"the constraint is too large for the grammar matcher at this point of the "
                                        f"output ({error}); write long lists of alternatives as one terminal (a "
                                        f"regex) or split the constraint")
            raise RuntimeError(f"grammar matcher failed: {error}")

    def validate_tokens(self, token_ids: list[int]) -> int:
        """Length of the longest admitted prefix (EOS only where the output may end); no state change.

        EOS never reaches llguidance (which refuses it once the grammar cannot grow, although the
        output is complete): it is admitted here exactly when the tokens before it are accepted
        and leave the matcher accepting."""
        if self._terminated or not token_ids:
            return 0
        self._own()
        size = self._vocab.model_vocab_size
        cut = len(token_ids)
        for k, t in enumerate(token_ids):
            if t in self._eos or not 0 <= t < size:
                cut = k
                break
        prefix = list(token_ids[:cut])
        n = self._m.validate_tokens(prefix) if prefix else 0
        self._check()
        if n < cut or cut == len(token_ids) or token_ids[cut] not in self._eos:
            return n
        if prefix:
            self._m.consume_tokens(prefix)
            accepting = self._m.is_accepting()
            self._m.rollback(len(prefix))
        else:
            accepting = self._m.is_accepting()
        return cut + 1 if accepting else cut

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over all of ``token_ids``; if any is refused, return False and change nothing."""
        if not token_ids:
            return True
        if len(token_ids) == 1 and self._mask_valid and not self._terminated:
            # One token against the mask of this very state (the decode step's case): the mask
            # says whether it is allowed, EOS included, so no validation is needed.
            t = token_ids[0]
            if not 0 <= t < self._size or not (self._bits[t >> 5] >> (t & 31)) & 1:
                return False
            if t in self._eos:
                self._terminated = True
            else:
                if self._m is None:
                    self._own()
                if not self._m.consume_token(t):
                    self._check()
                    raise RuntimeError("llguidance refused a token its mask allowed")
            self._num_tokens += 1
            self._mask_valid = False
            return True
        if self.validate_tokens(token_ids) != len(token_ids):  # (owns the matcher)
            return False
        eos = token_ids[-1] in self._eos
        body = list(token_ids[:-1] if eos else token_ids)
        if body and not self._m.consume_tokens(body):
            self._check()
            raise RuntimeError("llguidance refused tokens it had validated")
        self._num_tokens += len(token_ids)
        self._mask_valid = False
        self._terminated = eos
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
        inner = num_tokens - (1 if self._terminated else 0)  # EOS was never given to llguidance
        if inner:
            self._own()
            self._m.rollback(inner)
            self._check()
        self._num_tokens -= num_tokens
        self._terminated = False
        self._mask_valid = False

    def _current_mask(self) -> np.ndarray:
        """The current state's mask (uint32 ``[words]``), EOS bits set exactly when accepting
        (cached per state).

        Raises:
            RuntimeError: llguidance failed, or no token can continue a non-accepting state (the
                vocabulary cannot spell what the grammar requires next).
        """
        if not self._mask_valid:
            if self._m is None:
                self._own()
            if self._mask_shared:  # the root's buffer: this state's mask goes in a buffer of its own
                self._set_buffer(np.zeros(self._words, np.uint32))
            if self._m.unsafe_compute_mask_ptr(self._mask_ptr, self._words * 4) is True:  # (llg_c)
                bits = self._bits
                for w, b in self._grammar.backend.eos_words:
                    if bits[w] & b:
                        break
                else:  # no EOS bit in a computed mask: final as it stands (``_finish_mask``)
                    self._mask_valid = True
                    return self._view
                self._finish_mask()
            else:  # (the Python bindings' call returns None)
                self._finish_mask()
        return self._view

    @property
    def needs_mask(self) -> bool:
        """Whether the current state's mask is still to be computed (``prefetch_masks``)."""
        return not self._mask_valid and not self._terminated

    def _finish_mask(self) -> None:
        """Check llguidance's raw mask in ``self._view`` and set the EOS bits; mark it valid.

        llguidance computes a real mask unless the matcher is stopped or failed, when it writes
        its EOS set as a stand-in (``compute_mask_or_eos`` in its ``python_ext/src/llmatcher.rs``);
        a failure is an error state (``_check``), a stop is asked for. So an EOS bit in the mask
        of a state that is not accepting marks a stand-in, the one case that needs a closer look.

        ``_current_mask`` skips this where the C API (``llg_c``) computed a mask without an EOS
        bit: such a mask is final as it stands, since llguidance allows EOS in every accepting
        state and a stopped matcher's stand-in is its EOS set, so the state is neither, and a
        state no token can continue is a failure there ("NoExtension"), so the mask is not empty.
        That saves three calls into llguidance and a scan of the mask on nearly every step.
        """
        m = self._m
        if m.is_error():
            self._check()
        view = self._view
        accepting = m.is_accepting()
        if m.is_stopped():  # nothing can follow: llguidance's mask is then a stand-in
            if not accepting:
                raise _dead_end()
            view[:] = 0
        if accepting:
            for w, bit in self._eos_bits:
                view[w] |= bit
        elif any(view[w] & bit for w, bit in self._eos_bits):
            for w, bit in self._eos_bits:
                view[w] &= ~bit
            if not view.any():
                raise _dead_end()
        self._mask_valid = True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the current state into ``bitmask[row]``.

        Args:
            bitmask: int32 ``[R, ceil(model_vocab_size / 32)]`` on the CPU, rows contiguous.
            row: the row to overwrite.

        Raises:
            ValueError: wrong dtype, device, width or layout, or a row out of range.
            RuntimeError: llguidance hit one of its limits (the request fails alone).
        """
        checked = self._checked
        if checked is None or checked[0] is not bitmask:
            # The backend keeps the last bitmask checked: a new cursor writing into the same
            # rows as the last one (a server's batch bitmask) asks torch nothing more.
            checked = self._grammar.backend.checked
            if checked is None or checked[0] is not bitmask:
                _check_bitmask(bitmask, row, self._words)
                checked = self._grammar.backend.checked = (bitmask, bitmask.stride(0) * 4, bitmask.shape[0])
            self._checked = checked
        if not 0 <= row < checked[2]:
            raise ValueError(f"row {row} outside [0, {checked[2]})")
        dst = bitmask.data_ptr() + row * checked[1]
        if self._terminated:
            ctypes.memset(dst, 0, self._words * 4)
            row_view = bitmask[row].numpy().view(np.uint32)
            for w, bit in self._eos_bits:
                row_view[w] |= bit
            return
        if not self._mask_valid:
            self._current_mask()
        ctypes.memmove(dst, self._mask_ptr, self._words * 4)

    def forced_tokens(self, max_n: int) -> list[int]:
        """Tokens allowed alone, in a row, from the current state (≤ ``max_n``); no state change.

        "Alone" means the mask has one bit (the EOS ids counting as one): the same rule as the
        eager backend, so forcing never changes which tokens an output is made of.
        """
        if self._terminated:
            return []
        self._own()
        out: list[int] = []
        while len(out) < max_n:
            mask = self._current_mask().view(np.uint8)
            nz = np.flatnonzero(mask)
            if nz.size == 0 or nz.size > 8:  # cheap exit: many allowed tokens
                break
            bits = int(_POPCOUNT[mask[nz]].sum())
            ids = [int(b) * 8 + i for b in nz for i in range(8) if mask[b] >> i & 1]
            non_eos = [t for t in ids if t not in self._eos]
            if bits == 1 and non_eos:
                tid = non_eos[0]
            elif not non_eos and ids:
                out.append(self._vocab.eos_token_id)
                break
            else:
                break
            if not self._m.consume_token(tid):
                self._check()
                break
            self._mask_valid = False
            out.append(tid)
        taken = len(out) - (1 if out and out[-1] in self._eos else 0)
        if taken:
            self._m.rollback(taken)
            self._mask_valid = False
        return out

    def forced_text(self, max_bytes: int = 64) -> bytes:
        """The bytes the grammar forces next, up to ``max_bytes`` (llguidance's fast-forward
        bytes; empty where the output may end); no state change."""
        if self._terminated:
            return b""
        self._own()
        if isinstance(self._m, CMatcher):  # from masks (llg_c), the first one this state's own
            return self._m.compute_ff_bytes(max_bytes, self._view if self._mask_valid else None)
        return bytes(self._m.compute_ff_bytes())[:max_bytes]

    def forced_text_after(self, token_ids: list[int], max_bytes: int = 64) -> bytes | None:
        """The bytes the grammar would force after ``token_ids``; None if it refuses them (or
        they contain EOS). No state change."""
        if self._terminated or any(t in self._eos for t in token_ids):
            return None
        if self.validate_tokens(token_ids) != len(token_ids):
            return None
        if not token_ids:
            return self.forced_text(max_bytes)
        self._m.consume_tokens(list(token_ids))
        try:
            if isinstance(self._m, CMatcher):
                return self._m.compute_ff_bytes(max_bytes)
            return bytes(self._m.compute_ff_bytes())[:max_bytes]
        finally:
            self._m.rollback(len(token_ids))


def prefetch_masks(matchers: list[LazyMatcher], backend: LazyBackend) -> list[tuple[LazyMatcher, Exception]]:
    """Compute the current masks of many lazy matchers at once, in parallel.

    Matchers of the C API (``llg_c``; every program where it is used) compute their masks on
    ``backend.mask_pool()``'s threads and the calling one, each thread a share of the matchers
    (each llguidance call releases the GIL); those of the Python bindings through llguidance's
    ``LLExecutor``, which fills every row on its own thread pool without the GIL (vLLM batches
    them the same way past 128 rows). Either way each matcher keeps its mask, so its next
    ``fill_bitmask`` or ``forced_tokens`` costs a copy, where one call per matcher would run them
    one by one. Matchers whose mask is already valid (or that ended) are skipped.

    Args:
        matchers: lazy matchers of ``backend``, owned by the calling thread.
        backend: their ``LazyBackend``.

    Returns:
        ``(matcher, error)`` for each matcher whose mask could not be made (its next call
        raises it again, so its request fails alone); the others' masks are valid.
    """
    pending = [m for m in matchers if m.needs_mask]
    in_c = [m for m in pending if isinstance(m._grammar._root, CMatcher)]
    failed = _prefetch_c(in_c, *backend.mask_pool()) if len(in_c) > 1 else []
    todo = [m for m in pending if m._m is not None and not isinstance(m._m, CMatcher)]
    if len(todo) > 1:
        failed += _prefetch_executor(todo, backend.executor())
    return failed


def _prefetch_c(matchers: list[LazyMatcher], pool, workers: int) -> list[tuple[LazyMatcher, Exception]]:
    """Each C API matcher's mask (``_current_mask``), the matchers dealt round-robin to the
    pool's threads and this one; a mask that fails stays invalid (its next call raises)."""
    def share(part: list[LazyMatcher]) -> list[tuple[LazyMatcher, Exception]]:
        out = []
        for m in part:
            try:
                m._current_mask()
            except Exception as e:  # noqa: BLE001 - reported to the caller, request by request
                out.append((m, e))
        return out

    if pool is None:
        return share(matchers)
    n = workers + 1
    futures = [pool.submit(share, matchers[k::n]) for k in range(1, n) if matchers[k::n]]
    failed = share(matchers[0::n])
    for f in futures:
        failed += f.result()
    return failed


def _prefetch_executor(todo: list[LazyMatcher], executor) -> list[tuple[LazyMatcher, Exception]]:
    """The masks of Python-binding matchers through ``executor`` (``LLExecutor``)."""
    words = todo[0]._words
    rows = np.empty((len(todo), words), np.uint32)
    try:
        executor.unsafe_compute_mask_ptr([(m._m, k) for k, m in enumerate(todo)],
                                         rows.__array_interface__["data"][0], words * 4, len(todo))
    except Exception:  # noqa: BLE001 - each matcher computes (and reports) its own mask instead
        return []
    failed = []
    for k, m in enumerate(todo):
        m._set_buffer(rows[k])
        try:
            m._finish_mask()
        except Exception as e:  # noqa: BLE001 - reported to the caller, request by request
            m._set_buffer(np.zeros(words, np.uint32))
            failed.append((m, e))
    return failed


# How llguidance 1.9.1 words a matcher that reached one of its limits ("Current row has 5001
# items; max is 2000", "Too many items (limit 50000; mask)", "lexer error: too many expressions
# constructed", the lexer's fuel).
_LIMIT_MARKS = ("max is", "too many", "(limit ", "fuel")  # (matched in lowercase)


def _dead_end() -> DeadEndError:
    return DeadEndError("no token can continue the output here: the model's vocabulary cannot spell "
                        "what the constraint requires next")


def _check_bitmask(bitmask: torch.Tensor, row: int, words: int) -> None:
    if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu"
            or bitmask.dim() != 2 or bitmask.shape[1] != words or bitmask.stride(1) != 1):
        raise ValueError(f"bitmask must be a CPU int32 [R, {words}] tensor with contiguous "
                         f"rows, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
    if not 0 <= row < bitmask.shape[0]:
        raise ValueError(f"row {row} outside [0, {bitmask.shape[0]})")
