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

from grammar.base import GrammarError, GrammarSpec, Program
from grammar.vocab import TokenVocabulary


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
        self.warnings = program.warnings
        self.policy = policy
        self._lock = threading.Lock()
        self._grammars: dict[str, object] = {}  # backend name → its grammar
        self._errors: dict[str, GrammarError] = {}  # backend name → why it could not build
        self._pending: dict[str, Future] = {}  # backend name → build in flight
        self.sightings = 1  # compiles that asked for this spec (auto builds eager on the second)

    # -- what the engine uses ----------------------------------------------------------------
    def matcher(self, backend: str | None = None):
        """A fresh cursor at the start of the grammar.

        Args:
            backend: "eager" or "lazy" to insist on one (it must be built), or ``None``: the
                eager grammar when it is ready, else the lazy one.

        Raises:
            GrammarError: the requested backend has no grammar for this spec.
        """
        with self._lock:
            if backend is None:
                grammar = self._grammars.get("eager") or self._grammars.get("lazy")
            else:
                grammar = self._grammars.get(backend)
            if grammar is None:
                err = self._errors.get(backend or "lazy")
                if err is not None:
                    raise err.copy()
                raise GrammarError(f"no {backend or 'ready'} grammar for this spec",
                                   keyword="grammar_backend")
        return grammar.matcher()

    @property
    def backend(self) -> str:
        """The backend ``matcher()`` uses now: "eager" or "lazy"."""
        with self._lock:
            return "eager" if "eager" in self._grammars else "lazy"

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


class PinnedGrammar:
    """A :class:`CompiledGrammar` whose ``matcher()`` always uses one backend (a per-request
    ``grammar_backend`` choice). Other attributes are the shared grammar's."""

    def __init__(self, grammar: CompiledGrammar, backend: str):
        self.grammar = grammar
        self.pinned = backend

    def matcher(self):
        return self.grammar.matcher(self.pinned)

    @property
    def backend(self) -> str:
        return self.pinned

    def __getattr__(self, name):
        return getattr(self.grammar, name)
