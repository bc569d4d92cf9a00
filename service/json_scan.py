"""The service's incremental scanner for JSON text as it is written: where each value starts and ends.

Three readers of the service follow a JSON text character by character and need the same facts
(which containers are open, which member or element is being read, where a value began and where
it ended): a streamed answer's progress (``stencil.service.partial_json``: the values complete at any
depth, the items of a list as each ends, the path being written), the JSON pointers of the values a budget cut short (``stencil.service.json_paths``), and
the end of a tool call's arguments in a stream (``stencil.service.tool_parser``). ``JsonScanner`` is that
reading, once: lexical (containers, strings and their escapes, bare scalars), fed any number of
fragments, reporting each value's start and end to the reader's callbacks. It does not validate:
a reader that needs a valid document checks it whole (``json.loads``) or relies on the grammar.

The layers below keep scanners of their own, which this one would not serve: the run-on guard
(``stencil.grammar.budget``) reads bytes per token inside the engine's step and rolls back with
rejected drafts, counting characters, digits and items; the drafter's layout
(``stencil.engine.speculative.layout``) reads the whitespace between tokens. Neither needs the
text, the offsets or the keys kept here, and neither may import service/.

Why not a library: jiter's partial mode and ijson parse a prefix into values or events but give
no offsets of the values in the text, which ``shortened`` pointers and the arguments' end need;
the scanner is ~100 lines of the standard library, so the typed client (``stencil.service.client``,
which imports ``partial_json``) stays free of dependencies.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
_SCALAR_END = ",]}" + WHITESPACE


@dataclass(slots=True)
class Frame:
    """An open container.

    Attributes:
        is_object: an object (members) or an array (elements).
        key: the decoded key of the member being read (objects; None before its key is read).
        index: the position of the element being read (arrays).
        in_value: a member value / element has started and not ended.
        value_done: ... and has ended (until the next comma).
        value_start: where that value started (an offset into the text fed).
    """

    is_object: bool
    key: str | None = None
    index: int = 0
    in_value: bool = False
    value_done: bool = False
    value_start: int = 0


class JsonScanner:
    """Reads one JSON value from text fed in fragments.

    ``on_begin(start)`` is called as each value begins (the stack then shows where it stands: the
    top frame's ``key`` or ``index`` names it; empty for the top-level value) and ``on_end(start,
    end)`` as it ends (the value's own frame already popped). Offsets count characters from the
    first one fed. A string ends after its closing quote, a container after its closing bracket,
    a bare scalar (number, true, false, null) at the first delimiter after it (``,]}`` or
    whitespace), which is then read as usual.

    Attributes:
        stack: the open containers, outermost first.
        text: everything fed so far.
        end: where the top-level value ended (None while it goes on); later text is not read.
    """

    __slots__ = ("stack", "text", "end", "root_start", "_in_string", "_escaped", "_string_is_key",
                 "_string_start", "_scalar_start", "_on_begin", "_on_end")

    def __init__(self, on_begin: Callable[[int], None] | None = None,
                 on_end: Callable[[int, int], None] | None = None) -> None:
        self.stack: list[Frame] = []
        self.text = ""
        self.end: int | None = None
        self.root_start: int | None = None
        self._in_string = self._escaped = self._string_is_key = False
        self._string_start = 0
        self._scalar_start: int | None = None
        self._on_begin, self._on_end = on_begin, on_end

    @property
    def in_scalar(self) -> bool:
        """A bare scalar is being read (it may still grow: ``12`` -> ``123``)."""
        return self._scalar_start is not None

    def feed(self, fragment: str) -> int | None:
        """Read the next characters; returns the offset in ``fragment`` just after the top-level
        value once it ends there (a bare scalar: the offset of the delimiter that ended it), else
        None. Nothing is read after the top-level value's end."""
        if self.end is not None:
            return None
        base = len(self.text)
        self.text += fragment
        text, stack = self.text, self.stack
        i, n = base, len(text)
        while i < n:
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._string_is_key:
                        stack[-1].key = _key(text[self._string_start:i + 1])
                    elif self._value_ends(i + 1):
                        return i + 1 - base
                i += 1
                continue
            if self._scalar_start is not None:
                if ch not in _SCALAR_END:
                    i += 1
                    continue
                self._scalar_start = None
                if self._value_ends(i):
                    return i - base  # the delimiter is not part of the value
            if ch in WHITESPACE:
                i += 1
                continue
            top = stack[-1] if stack else None
            if ch == '"':
                self._in_string = True
                self._string_start = i
                self._string_is_key = top is not None and top.is_object and not top.in_value and top.key is None
                if not self._string_is_key:
                    self._value_begins(i)
            elif ch in "{[":
                self._value_begins(i)
                stack.append(Frame(is_object=ch == "{"))
            elif ch in "}]":
                if top is None:
                    return None
                stack.pop()
                if self._value_ends(i + 1):
                    return i + 1 - base
            elif ch == ",":
                if top is None:
                    return None
                top.value_done = False
                if top.is_object:
                    top.key = None
                else:
                    top.index += 1
            elif ch != ":":  # a number, true, false or null begins
                self._value_begins(i)
                self._scalar_start = i
            i += 1
        return None

    def pointer(self) -> str:
        """The RFC 6901 pointer of the value the stack stands in (``/home/city``, ``/tags/3``;
        ``""`` at the top level)."""
        return "".join("/" + (f.key.replace("~", "~0").replace("/", "~1") if f.is_object else str(f.index))
                       for f in self.stack if not f.is_object or f.key is not None)

    def _value_begins(self, at: int) -> None:
        if self.stack:
            top = self.stack[-1]
            top.in_value = True
            top.value_start = at
        else:
            self.root_start = at
        if self._on_begin is not None:
            self._on_begin(at)

    def _value_ends(self, end: int) -> bool:
        """Account a value that ends at ``end``; True when it is the top-level one."""
        if not self.stack:
            if self._on_end is not None:
                self._on_end(self.root_start or 0, end)
            self.end = end
            return True
        top = self.stack[-1]
        if self._on_end is not None:
            self._on_end(top.value_start, end)
        top.in_value = False
        top.value_done = True
        return False


def _key(quoted: str) -> str:
    """A member's key from its quoted text; text that is not a JSON string (no grammar shaped
    it) stands as it is, without its quotes."""
    try:
        key = json.loads(quoted)
    except ValueError:
        return quoted[1:-1]
    return key if isinstance(key, str) else quoted[1:-1]


__all__ = ["Frame", "JsonScanner", "WHITESPACE"]
