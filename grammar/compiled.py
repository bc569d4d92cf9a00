"""A compiled constraint, served by whichever backend is ready for it.

A :class:`CompiledGrammar` is shared by every request with the same spec. It holds the program
(the regex or Lark grammar the front end wrote) and up to two backend grammars: the lazy one
(llguidance, ready within milliseconds) and the eager one (an outlines-core index, µs masks, built
in the background once the grammar proves popular). ``matcher()`` hands out a cursor on the
preferred backend that is ready; a request keeps its cursor's backend to the end.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from stencil.grammar.base import GrammarError, GrammarSpec, Program
from stencil.grammar.vocab import TokenVocabulary


class CompiledGrammar:
    """An immutable constraint with its backend grammars (thread-safe).

    Attributes:
        spec: what was compiled.
        program: the front end's output (``kind`` "regex" or "lark", ``text``).
        vocab: the grammar alphabet.
        warnings: notes from the translation (keywords relaxed, bounds applied).
        policy: the compiler's backend policy when this was built ("auto", "eager" or "lazy").
    """

    def __init__(self, spec: GrammarSpec, program: Program, vocab: TokenVocabulary, policy: str):
        self.spec = spec
        self.program = program
        self.vocab = vocab
        self.policy = policy
        self._lock = threading.Lock()
        self._grammars: dict[str, object] = {}  # backend name → its grammar
        self._errors: dict[str, GrammarError] = {}  # backend name → why it could not build
        self._pending: dict[str, Future] = {}  # backend name → build in flight
        self.sightings = 1  # compiles that asked for this spec (auto builds eager on the second)
        self._closing: Future | None = None  # the closing automaton (stencil.grammar.closing), once asked for
        self._closing_pool = None  # an executor for building it off the caller's thread
        self._min_bytes: int | None = None  # bytes of the shortest output, once read
        self._upper_bytes: int | None = None  # bytes of some output (min_output_tokens), once read
        self._bounds_lock = threading.Lock()
        self._bounds_program: Program | None = None  # what min_bytes reads (a Lark text read once)
        self._own: Program | None = None  # Stencil's own translation of a "json" program's spec
        self._translate = None  # spec → that translation (set by the compiler: its options)

    @property
    def warnings(self) -> tuple[str, ...]:
        """Notes from the translation; for a "json" program with ``own_warnings``, those of
        Stencil's own translation (computed once, in the background after the compile)."""
        if self.program.own_warnings:
            try:
                return self.own_program().warnings
            except GrammarError:  # (a limit the handover did not meet: no notes to give)
                return ()
        return self.program.warnings

    # -- what the engine uses ----------------------------------------------------------------
    def matcher(self, backend: str | None = None):
        """A fresh cursor at the start of the grammar.

        Args:
            backend: a backend's name to insist on one (it must be built), or ``None``: the
                eager grammar when it is ready, else the lazy one (else the one built).

        Raises:
            GrammarError: the requested backend has no grammar for this spec.
        """
        with self._lock:
            grammar = self._grammars.get(backend or self._preferred() or "")
            if grammar is None:
                err = self._errors.get(backend or "lazy")
                if err is not None:
                    raise err.copy()
                raise GrammarError(f"no {backend or 'ready'} grammar for this spec",
                                   keyword="grammar_backend")
        return grammar.matcher()

    def budget_matcher(self, max_tokens: int, backend: str | None = None, soft_limits=None):
        """A cursor (as :meth:`matcher`) that also keeps the output closable within
        ``max_tokens`` tokens (:class:`stencil.grammar.budget.BudgetMatcher`); ``soft_limits``: the
        run-on guard (``stencil.grammar.budget.SoftLimits``), JSON Schema grammars only."""
        from stencil.grammar.budget import BudgetMatcher

        limits = soft_limits if self.spec.kind == "json_schema" else None
        if limits is not None:
            limits = _raised_by_schema(limits, self.spec.value)
        return BudgetMatcher(self.matcher(backend), self.closing(), max_tokens, limits)

    def closing(self) -> Future:
        """The grammar's closing automaton, built once in the background (a future; it raises
        ``ClosingUnsupported`` for grammars it does not model)."""
        with self._lock:
            if self._closing is not None:
                return self._closing
            if self._closing_pool is not None:
                try:
                    self._closing = self._closing_pool.submit(self._build_closing)
                    return self._closing
                except RuntimeError:  # pool shut down: built here, below
                    pass
            f: Future = Future()
            f.set_running_or_notify_cancel()
            self._closing = f
        # (outside the lock: the build reads ``own_program``, which takes it; others asking
        # meanwhile wait on ``f``)
        try:
            f.set_result(self._build_closing())
        except Exception as e:  # noqa: BLE001
            f.set_exception(e)
        return f

    def own_program(self) -> Program:
        """Stencil's own translation of the spec: the program itself, unless it is a "json"
        program handed to llguidance, whose spec is then translated once (the same language,
        ``json_schema.handover``), for the eager index and the closing automaton.

        Raises:
            GrammarError: the translation fails (it cannot, where the handover's argument holds;
                a size or time limit can).
        """
        if self.program.kind != "json":
            return self.program
        with self._lock:
            own = self._own
        if own is None:
            if self._translate is not None:
                own = self._translate(self.spec)
            else:
                from stencil.grammar.frontend import to_program

                own = to_program(self.spec, handover=False)
            with self._lock:
                self._own = own
        return own

    def _build_closing(self):
        from stencil.grammar.closing import ClosingAutomaton, ClosingUnsupported

        program = self.own_program()
        if program.kind == "lark" and program.root is None:  # written by hand: read through lark
            from stencil.grammar.lark_closing import lark_program

            program = lark_program(program.text)
        try:
            return ClosingAutomaton(program, self.vocab)
        except RecursionError:  # (a chain of hundreds of rules: the automaton's reading recurses a rule a level)
            raise ClosingUnsupported("the grammar's rules nest too deeply for the closing automaton") from None

    def min_output_tokens(self, max_tokens: int) -> int | None:
        """The fewest tokens an output needs, when that is more than ``max_tokens`` (``None``:
        ``max_tokens`` is enough, or the grammar is not modelled). Cheap when ``max_tokens`` is
        at least the bytes of some output (each token spells at least one byte): first against
        the bytes of one output read along one branch of each large alternation, then of the
        shortest output, then the closing automaton's token distance."""
        for upper in (True, False):
            known = self._bytes_bound(upper)
            if known is None:  # not translated (a limit): no admission check
                return None
            if max_tokens >= known:
                return None
        return self._min_tokens_beyond(max_tokens)

    def _bytes_bound(self, upper: bool) -> int | None:
        """Bytes of the shortest output (``upper``: of some output, :func:`min_bytes`'s ``upper``),
        once each; ``None``: the program was not translated (a limit); 0 where it cannot be read."""
        cached = self._upper_bytes if upper else self._min_bytes
        if cached is not None:
            return cached
        with self._bounds_lock:  # (read once: a second caller waits for the first's answer)
            return self._read_bytes_bound(upper)

    def _read_bytes_bound(self, upper: bool) -> int | None:
        cached = self._upper_bytes if upper else self._min_bytes
        if cached is not None:
            return cached
        from stencil.grammar.program import min_bytes

        try:
            p = self._bounds_program
            if p is None:
                p = self.own_program()
                if p.kind == "lark" and p.root is None:  # written by hand: read through lark
                    from stencil.grammar.closing import ClosingUnsupported
                    from stencil.grammar.lark_closing import lark_program

                    try:
                        p = lark_program(p.text)
                    except ClosingUnsupported:
                        p = Program("lark", p.text)  # (no root: no admission check)
                self._bounds_program = p  # (both bounds read it: the Lark text is parsed once)
            if p.kind == "regex":
                found = min_bytes(p.text, p.terminals, upper=upper)
            elif p.root is not None:
                found = min_bytes(p.root, p.terminals, dict(p.rules), upper=upper)
            else:
                found = 0
        except GrammarError:
            return None
        except RecursionError:  # rules nested too deeply to read: no admission check
            found = 0
        except ValueError:  # a user regex outside the compiler's dialect: 4 bytes a character
            if self.program.kind != "regex":
                found = 0  # (a Lark grammar min_bytes cannot read: no check)
            else:
                import re._parser as sre_parse

                found = 4 * sre_parse.parse(self.program.text).getwidth()[0]
        if upper:
            self._upper_bytes = found
        else:
            self._min_bytes = found
        return found

    def _min_tokens_beyond(self, max_tokens: int) -> int | None:
        """The closing automaton's count of the fewest tokens, when more than ``max_tokens``."""
        try:
            automaton = self.closing().result()
        except Exception:  # noqa: BLE001 - not modelled: no admission check
            return None
        from stencil.grammar.closing import EXACT_END_BYTES

        start = automaton.start
        if automaton.byte_distance(start) > EXACT_END_BYTES and automaton.token_lower_bound(start) > max_tokens:
            # the least its bytes need, without writing (and tokenizing) an end that may be
            # millions of bytes long (rules that repeat rules); shorter ends are counted exactly
            need = automaton.token_lower_bound(start)
        else:
            need = automaton.token_distance(start)
        return need if need > max_tokens else None

    @property
    def backend(self) -> str:
        """The backend ``matcher()`` uses now: "eager" or "lazy" (or another backend's name when
        only it is built)."""
        with self._lock:
            return self._preferred() or "lazy"

    def _preferred(self) -> str | None:
        """The built backend ``matcher()`` takes (the lock held): eager (µs masks) before lazy,
        before any other; ``None`` when none is built."""
        return next((n for n in ("eager", "lazy", *self._grammars) if n in self._grammars), None)

    @property
    def regex(self) -> str | None:
        """The regex the output must fully match, or None for a grammar program."""
        return self.program.text if self.program.kind == "regex" else None

    @property
    def index_bytes(self) -> int:
        """Memory of the backend grammars that report it (the eager index), bytes."""
        with self._lock:
            return sum(getattr(g, "nbytes", 0) for g in self._grammars.values())

    def has(self, backend: str) -> bool:
        with self._lock:
            return backend in self._grammars

    def error(self, backend: str) -> GrammarError | None:
        with self._lock:
            return self._errors.get(backend)

    def using(self, backend: str | None) -> "CompiledGrammar | PinnedGrammar":
        """This grammar with ``matcher()`` pinned to ``backend`` (itself when ``None``)."""
        return self if backend is None else PinnedGrammar(self, backend)

    # -- what the compiler uses --------------------------------------------------------------
    def _set(self, backend: str, grammar) -> None:
        with self._lock:
            self._grammars[backend] = grammar
            self._errors.pop(backend, None)

    def _fail(self, backend: str, error: GrammarError) -> None:
        with self._lock:
            self._errors[backend] = error

    def __repr__(self) -> str:
        return (f"CompiledGrammar({self.spec.kind}, {self.program.kind} of {len(self.program.text)} chars, "
                f"backends={sorted(self._grammars)})")


def _raised_by_schema(limits, schema_text: str):
    """The run-on guard's bounds, raised to what the schema itself allows (its largest
    ``maxLength``/``minLength`` and ``maxItems``/``minItems``): the guard never cuts what the
    schema asks for."""
    import json
    from dataclasses import replace

    strings = items = 0
    stack = [json.loads(schema_text)]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("maxLength", "minLength") and isinstance(v, int):
                    strings = max(strings, v)
                elif k in ("maxItems", "minItems") and isinstance(v, int):
                    items = max(items, v)
                else:
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(node)
    return replace(limits, string_chars=max(limits.string_chars, strings + 1),
                   array_items=max(limits.array_items, items + 1))


class PinnedGrammar:
    """A :class:`CompiledGrammar` whose ``matcher()`` always uses one backend (a per-request
    ``grammar_backend`` choice). Other attributes are the shared grammar's."""

    def __init__(self, grammar: CompiledGrammar, backend: str):
        self.grammar = grammar
        self.pinned = backend

    def matcher(self):
        return self.grammar.matcher(self.pinned)

    def budget_matcher(self, max_tokens: int, soft_limits=None):
        return self.grammar.budget_matcher(max_tokens, self.pinned, soft_limits)

    @property
    def backend(self) -> str:
        return self.pinned

    def __getattr__(self, name):
        return getattr(self.grammar, name)
