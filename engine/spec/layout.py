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
"""

from __future__ import annotations

from dataclasses import dataclass

_OPENERS = frozenset("{[")
_CLOSERS = frozenset("}]")
_WS = frozenset(" \t\r\n")


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
        depth, in_string, escape, last, run = 0, False, False, "", ""
        for ch in text:
            if in_string:
                if escape:
                    escape = False
                elif ch == "\\":
                    escape = True
                elif ch == '"':
                    in_string, last = False, '"'
                continue
            if ch in _WS:
                run += ch
                continue
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
            run = ""
            if ch == '"':
                in_string = True
            elif ch in _OPENERS:
                depth += 1
            elif ch in _CLOSERS:
                depth = max(depth - 1, 0)
            last = ch
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
    depth, in_string, escape, last, run = 0, False, False, "", ""
    for ch in text:
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string, last, run = False, '"', ""
            continue
        if ch in _WS:
            run += ch
            continue
        run = ""
        if ch == '"':
            in_string = True
        elif ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth = max(depth - 1, 0)
        last = ch
    return Position(in_string, depth, last, run)
