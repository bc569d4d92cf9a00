"""The whitespace of a JSON answer, guessed for drafts where the grammar leaves it free.

Under ``whitespace="flexible"`` the grammar forces nothing where whitespace may come: after
``{"name": "Ada",`` it allows a newline, spaces or the next key's quote, so the drafter's
forced text (``","age":`` in compact JSON) stops at every separator. Models write JSON in one
layout throughout, usually pretty-printed with a fixed indent (SmolLM2: two spaces), so the
whitespace to come is predictable from what the answer wrote so far: ``JsonLayout.of(text)``
reads it (is there a line break between members, the indent per level, a space after the
colon), and ``guess`` says what that layout puts at the end of ``text``. Before the answer has
shown its layout, the guess is the common pretty-printed one (a newline, two spaces per level,
``": "``). A guess is only a draft: the model verifies it, so a wrong one costs a draft row and
never changes an output.

``_Scan`` is this module's own walk over the JSON prefix, not the service's scanner
(``stencil.service.json_scan``, a layer above: values' offsets and keys) nor the run-on guard's
(``stencil.grammar.budget``: bytes fed per token, with rollback): what a layout is read from is the
whitespace between the characters outside strings and the last such character, which both of
those skip. The three share only the few lines that step over a string's escapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

_OPENERS = frozenset("{[")
_CLOSERS = frozenset("}]")
_WS = frozenset(" \t\r\n")


class _Scan:
    """A walk over a JSON prefix that skips strings (and the escapes in them) and gathers the
    whitespace between the other characters; ``JsonLayout.of`` and ``position`` both read it.

    Attributes (of the text taken in so far):
        depth: containers open (a stray closer does not go below 0).
        in_string: inside a string.
        escape: inside a string, just after a backslash.
        last: the last character outside strings and whitespace ("" at the start; ``"`` after
            a string).
        run: the whitespace written after ``last``.
    """

    __slots__ = ("depth", "in_string", "escape", "last", "run")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape, self.last, self.run = 0, False, False, "", ""

    def tokens(self, text: str) -> Iterator[str]:
        """Takes ``text`` in, yielding each character outside strings and whitespace before it
        is taken: while the caller holds one, the attributes describe the text before it (so
        ``run`` is the whitespace that precedes it and ``last`` the character before that)."""
        for ch in text:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string, self.last = False, '"'
                continue
            if ch in _WS:
                self.run += ch
                continue
            yield ch
            self.run = ""
            if ch == '"':
                self.in_string = True
            elif ch in _OPENERS:
                self.depth += 1
            elif ch in _CLOSERS:
                self.depth = max(self.depth - 1, 0)
            self.last = ch


@dataclass(frozen=True, slots=True)
class Position:
    """Where a JSON prefix ends.

    Attributes:
        in_string: the prefix ends inside a string (no free whitespace there).
        depth: containers open at the end.
        last: the last character outside strings and whitespace ("" at the start).
        trailing_ws: whitespace already written after ``last``.
    """

    in_string: bool
    depth: int
    last: str
    trailing_ws: str


@dataclass(frozen=True, slots=True)
class JsonLayout:
    """How an answer lays its JSON out.

    Attributes:
        newline: members and items go on lines of their own.
        indent: the indent of one level when ``newline`` ("  ", "    ", "\\t").
        colon_space: a space after each ``:``.
        comma_space: on one line, a space after each ``,`` (``{"a": 1, "b": 2}``).
    """

    newline: bool = True
    indent: str = "  "
    colon_space: bool = True
    comma_space: bool = False

    @classmethod
    def of(cls, text: str) -> "JsonLayout":
        """The layout ``text`` shows, the pretty-printed default for what it has not shown yet.

        Reads the whitespace runs outside strings: the first run after ``{``, ``[`` or ``,``
        says whether members get their own lines (and, divided by the depth, the indent of a
        level); the first run after ``:`` whether a space follows the colon.
        """
        newline = indent = colon_space = comma_space = None
        scan = _Scan()
        for ch in scan.tokens(text):
            last, run, depth = scan.last, scan.run, scan.depth
            if (last in _OPENERS or last == ",") and ch not in _CLOSERS:
                if newline is None:
                    newline = "\n" in run
                    if newline and depth > 0:
                        tail = run[run.rfind("\n") + 1:]
                        if tail and len(tail) % depth == 0:
                            indent = tail[:len(tail) // depth]
                if last == "," and comma_space is None and "\n" not in run:
                    comma_space = run != ""
            elif last == ":" and colon_space is None:
                colon_space = run != ""
        default = cls()
        return cls(default.newline if newline is None else newline,
                   indent if indent is not None else default.indent,
                   default.colon_space if colon_space is None else colon_space,
                   bool(comma_space))

    def after(self, position: Position) -> str | None:
        """The whitespace this layout writes at ``position`` before the next member, item or
        value (``None`` inside a string or before the first character)."""
        if position.in_string or not position.last:
            return None
        if position.last == ":":
            return " " if self.colon_space else ""
        if position.last in _OPENERS or position.last == ",":
            if self.newline:
                return "\n" + self.indent * position.depth
            return " " if position.last == "," and self.comma_space else ""
        return ""  # after a value: the comma follows it directly

    def before_close(self, position: Position) -> str:
        """The whitespace this layout writes before the ``}``/``]`` that closes the container
        open at ``position``."""
        return "\n" + self.indent * max(position.depth - 1, 0) if self.newline else ""


def position(text: str) -> Position:
    """Where the JSON prefix ``text`` ends (strings and escapes skipped)."""
    scan = _Scan()
    for _ in scan.tokens(text):
        pass
    return Position(scan.in_string, scan.depth, scan.last, scan.run)
