"""Grammar interfaces the engine relies on (docs/architecture.md, "Grammar backends").

A ``CompiledGrammar`` is immutable and shared (cached by spec + tokenizer); a
``GrammarMatcher`` is a cheap per-request cursor over it. Bitmasks are int32 tensors
``[rows, ceil(vocab_size / 32)]``: bit ``t % 32`` of word ``t // 32`` set means token ``t`` is
allowed (the layout of xgrammar / outlines-core kernels).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Protocol

import msgspec
import torch

from stencil.grammar.program import Program  # noqa: F401 - the grammar API's name for it

GrammarKind = Literal["json_schema", "regex", "choice", "lark"]

# Most repetitions one counted quantifier (``a{n}``, ``{m,n}``), ``minLength`` or ``minItems`` may
# ask for. Each counted repetition is automaton states on the eager backend and derivative
# expressions on the lazy one: ``a{1000000}`` made llguidance fail mid-request ("too many
# expressions constructed") after seconds per token, and a 10^8 ``minLength`` killed an index
# worker. Larger counts are a 400 naming the count; a ``maxItems`` above it is written as the cap.
# Counts nested in one another multiply (``(b{1000}){1000}`` unrolls a million copies and failed
# the same way): their product is held to the same bound (``regex_tools.check_supported``).
MAX_REPEAT_COUNT = 10_000
# Counts side by side add up (eight alternatives of ``(a{100}){100}``, each within the bound,
# held the interpreter ~1.9 s before their 400): the copies all the counts of one regex (or one
# Lark grammar) unroll, summed, are held to four times the bound.
MAX_TOTAL_COPIES = 4 * MAX_REPEAT_COUNT


class GrammarError(ValueError):
    """A constraint that cannot be compiled exactly.

    Attributes:
        message: what is wrong, in words.
        keyword: the JSON Schema keyword at fault (``None`` for regexes).
        path: JSON pointer of the offending subschema (``"#/properties/age"``) or ``None``.
        position: character offset in a regex, or ``None``.
        line, column: 1-based place of the fault in a Lark grammar, or ``None``.
        field: the request field the constraint came from (``"regex"``), when the caller knows
            it (the service sets it; the compiler never does), else ``None``.
    """

    def __init__(self, message: str, *, keyword: str | None = None, path: str | None = None,
                 position: int | None = None, line: int | None = None, column: int | None = None,
                 field: str | None = None):
        self.message = message
        self.field = field
        self.keyword = keyword
        self.path = path
        self.position = position
        self.line = line
        self.column = column
        parts = [message]
        if keyword is not None:
            parts.append(f"keyword {keyword!r}")
        if path is not None:
            parts.append(f"at {path}")
        if position is not None:
            parts.append(f"at position {position}")
        super().__init__(" ".join(parts) if len(parts) == 1 else f"{parts[0]} ({', '.join(parts[1:])})")

    def copy(self, *, field: str | None = None) -> "GrammarError":
        """A fresh exception with the same fields, ``field`` replaced when given (one instance
        raised in many threads would accumulate their tracebacks)."""
        return type(self)(self.message, keyword=self.keyword, path=self.path, position=self.position,
                          line=self.line, column=self.column, field=field if field is not None else self.field)


class GrammarTimeout(GrammarError):
    """Compilation took longer than the configured limit."""


class DeadEndError(RuntimeError):
    """The output reached a state the grammar cannot leave with any token of this vocabulary:
    it is not complete, and what must come next is text no token spells (SmolLM2 has no token
    for byte 0x06, so a regex of ``a`` and that byte dies after ``a``). The constraint's fault, not the
    engine's: the engine fails that request alone and the service answers it with a 400 naming
    the constraint's field.
    """


class GrammarLimitError(DeadEndError):
    """The grammar matcher reached one of its limits at this point of the output (llguidance's
    Earley items in a row or in a step, its lexer's fuel): the constraint is too large or too
    ambiguous to follow here. The constraint's fault too (a 400 naming its field), not the
    engine's: nothing else in the batch is disturbed."""


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def schema_text(schema: object) -> str:
    """``schema`` as compact JSON text: written by msgspec (a tenth of ``json.dumps``' time)
    when reading that text back gives ``schema`` itself, else by ``json.dumps`` (NaN and the
    infinities, which msgspec writes as null; tuples; integers past 64 bits; keys that are not
    strings; and what JSON cannot say, a set, bytes or a Decimal, which msgspec would write as
    something else and ``json`` refuses with a TypeError). Non-ASCII text is written as UTF-8.
    """
    try:
        out = _ENCODER.encode(schema)
        if _DECODER.decode(out) == schema:
            return out.decode()
    except (msgspec.MsgspecError, TypeError, ValueError, OverflowError, UnicodeError, RecursionError):
        pass  # (a circular schema: json says so, "Circular reference detected")
    return json.dumps(schema, sort_keys=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request asks its output to match.

    Attributes:
        kind: "json_schema" (``value`` is the schema as canonical JSON text), "regex"
            (``value`` is the pattern, implicitly anchored at both ends), "choice"
            (``value`` is a JSON array of strings) or "lark" (``value`` is a Lark grammar).
        whitespace: JSON only: "compact" (no free whitespace) or "flexible" (a bounded run).
        strict: JSON only: reject unenforceable keywords (True) or ignore them with a warning.
        additional_properties: JSON only: where an object declares properties and says nothing
            of ``additionalProperties``, "closed" admits no undeclared key (OpenAI's strict
            outputs) and "schema" admits any, with any JSON value (the specification's default).
    """

    kind: GrammarKind
    value: str
    whitespace: Literal["compact", "flexible"] = "compact"
    strict: bool = True
    additional_properties: Literal["closed", "schema"] = "closed"

    @classmethod
    def json_schema(cls, schema: dict | bool, *, whitespace: str = "compact", strict: bool = True,
                    additional_properties: str = "closed") -> "GrammarSpec":
        """JSON documents that ``schema`` admits (compact or bounded flexible whitespace; objects
        closed or open where ``additionalProperties`` is absent, see the attributes).

        Raises:
            TypeError: ``schema`` holds something JSON cannot say (a set, bytes, a Decimal).
        """
        return cls("json_schema", schema_text(schema), whitespace, strict, additional_properties)

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        """Text fully matching ``pattern`` (anchored at both ends; no lookaround)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> "GrammarSpec":
        """Exactly one of ``options``."""
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, lark: str) -> "GrammarSpec":
        """Text in the language of a Lark grammar (llguidance's dialect: a ``start`` rule,
        uppercase terminals as regexes, ``/regex/`` and ``"literal"`` lexemes)."""
        return cls("lark", lark)

    def key(self) -> str:
        """Stable cache key of the spec and its options."""
        return json.dumps([self.kind, self.value, self.whitespace, self.strict,
                           self.additional_properties])


@dataclass(slots=True)
class CompileStats:
    """Counters a compiler exposes for metrics."""

    compiles: int = 0
    cache_hits: int = 0
    disk_hits: int = 0
    errors: int = 0
    timeouts: int = 0
    eager_builds: int = 0  # eager indexes built (in the background under ``auto``)
    eager_failures: int = 0  # eager builds that failed or timed out (the grammar stays lazy)
    compile_ms_count: int = 0  # compiles timed (a count and a sum: bounded memory for a server)
    compile_ms_sum: float = 0.0

    def record_compile_ms(self, ms: float) -> None:
        self.compile_ms_count += 1
        self.compile_ms_sum += ms


class GrammarMatcher(Protocol):
    """Per-request cursor over a compiled grammar."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over all tokens; False (and no state change) if any is refused."""
        ...

    def validate_tokens(self, token_ids: list[int]) -> int:
        """Length of the longest prefix the grammar admits; state unchanged."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the current state into ``bitmask[row]``."""
        ...

    def forced_tokens(self, max_n: int) -> list[int]:
        """Tokens the grammar allows alone, in a row, from the current state (≤ max_n); no state change."""
        ...

    def is_terminated(self) -> bool:
        """True once EOS has been accepted."""
        ...

    def is_accepting(self) -> bool:
        """True when the output so far fully matches (EOS is allowed now)."""
        ...

    def forced_text(self, max_bytes: int = 64) -> bytes:
        """Bytes the grammar forces next (for draft tokens); no state change."""
        ...

    def forced_text_after(self, token_ids: list[int], max_bytes: int = 64) -> bytes | None:
        """Bytes the grammar would force after ``token_ids`` (None if refused); no state change."""
        ...
