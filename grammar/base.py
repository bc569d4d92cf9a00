"""Grammar interfaces the engine relies on (DESIGN.md §3).

A ``CompiledGrammar`` is immutable and shared (cached by spec + tokenizer); a
``GrammarMatcher`` is a cheap per-request cursor over it. Bitmasks are int32 tensors
``[rows, ceil(vocab_size / 32)]``: bit ``t % 32`` of word ``t // 32`` set means token ``t`` is
allowed (the layout of xgrammar / outlines-core kernels).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

GrammarKind = Literal["json_schema", "regex", "choice"]


class GrammarError(ValueError):
    """A constraint that cannot be compiled exactly.

    Attributes:
        message: what is wrong, in words.
        keyword: the JSON Schema keyword at fault (``None`` for regexes).
        path: JSON pointer of the offending subschema (``"#/properties/age"``) or ``None``.
        position: character offset in a regex, or ``None``.
    """

    def __init__(self, message: str, *, keyword: str | None = None, path: str | None = None,
                 position: int | None = None):
        self.message = message
        self.keyword = keyword
        self.path = path
        self.position = position
        parts = [message]
        if keyword is not None:
            parts.append(f"keyword {keyword!r}")
        if path is not None:
            parts.append(f"at {path}")
        if position is not None:
            parts.append(f"at position {position}")
        super().__init__(" ".join(parts) if len(parts) == 1 else f"{parts[0]} ({', '.join(parts[1:])})")


class GrammarTimeout(GrammarError):
    """Compilation took longer than the configured limit."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request asks its output to match.

    Attributes:
        kind: "json_schema" (``value`` is the schema as canonical JSON text), "regex"
            (``value`` is the pattern, implicitly anchored at both ends) or "choice"
            (``value`` is a JSON array of strings).
        whitespace: JSON only: "compact" (no free whitespace) or "flexible" (a bounded run).
        strict: JSON only: reject unenforceable keywords (True) or ignore them with a warning.
    """

    kind: GrammarKind
    value: str
    whitespace: Literal["compact", "flexible"] = "compact"
    strict: bool = True

    @classmethod
    def json_schema(cls, schema: dict | bool, **kw) -> "GrammarSpec":
        return cls("json_schema", json.dumps(schema, sort_keys=False, separators=(",", ":")), **kw)

    def key(self) -> str:
        """Stable cache key of the spec and its options."""
        return json.dumps([self.kind, self.value, self.whitespace, self.strict])


@dataclass(slots=True)
class CompileStats:
    """Counters a compiler exposes for metrics."""

    compiles: int = 0
    cache_hits: int = 0
    disk_hits: int = 0
    errors: int = 0
    timeouts: int = 0
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
