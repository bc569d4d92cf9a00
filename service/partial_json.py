"""Where a JSON document that is still being written stands: the values complete so far at any
depth, the members of the top-level object that are complete, the path of the value being written,
and the items of a chosen list as each one ends.

Stencil's grammar makes a streamed answer a prefix of a document that validates, so the values
this reads as complete are final: they will not change when more text arrives. Pure Python, no
dependency (the client, ``stencil.service.client``, uses it for ``stream_extract`` and
``extract_iter``). One ``JsonScanner`` (``stencil.service.json_scan``) does the reading; this module
only keeps what its begin and end events say.

    >>> progress('{"name":"Ann","home":{"city":"Os')
    Progress(done={'name': 'Ann'}, writing='home.city', complete=False, value={'name': 'Ann', 'home': {}})
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stencil.service.json_scan import Frame, JsonScanner

# Where the items of a list stand in a document: one entry per enclosing container, outermost first,
# a member name for an object, None for an array (any element). ``("lines", None)``: the elements of
# the top-level object's ``lines``; ``(None,)``: of a top-level array; ``("sections", None, "lines",
# None)``: the lines of every section.
ItemPath = tuple[str | None, ...]

_NOTHING = object()  # the view before any value has begun (a document may be ``null``)


@dataclass(slots=True)
class Progress:
    """Attributes:
        done: the top-level object's complete members, decoded (``json.loads``), in order.
        writing: the path of the value being written (``"home.city"``, ``"tags[1]"``), or
            ``None`` between values or once the document is complete.
        complete: the whole document has been read.
        value: the document so far (``PartialDocument.value``): every value complete at any depth,
            inside the objects and arrays still open; ``None`` before any has begun.
    """

    done: dict[str, Any] = field(default_factory=dict)
    writing: str | None = None
    complete: bool = False
    value: Any = None


class PartialDocument:
    """A JSON document read fragment by fragment, as a stream writes it.

    The view (``value``) holds every value that has ended, at any depth, decoded, inside the
    objects and arrays still open (which show the members and elements complete so far). A string
    or number being written is left out until it ends: a string at its closing quote, a number,
    ``true``, ``false`` or ``null`` at the delimiter after it (``12`` may still become ``123``).
    So the view only grows: a later view holds every member and element an earlier one held,
    equal where they were complete, and an open container gains members at its end.

    ``items`` names a list (``ItemPath``) whose elements ``feed`` returns, decoded, as each ends.

    Attributes:
        done: the top-level object's complete members (``Progress.done``).
    """

    __slots__ = ("done", "_items", "_ended", "_root", "_open", "_view", "_scanner")

    def __init__(self, items: ItemPath | None = None) -> None:
        self.done: dict[str, Any] = {}
        self._items = items
        self._ended: list[Any] = []
        self._root: Any = _NOTHING
        self._open: list[dict | list] = []  # the view's open containers, one per scanner frame
        self._view: Any = _NOTHING  # a copy of _root, made when asked and kept until _root changes
        self._scanner = JsonScanner(self._begins, self._ends)

    def feed(self, fragment: str) -> list[Any]:
        """Read the next characters of the text; returns the ``items`` elements that ended in them,
        decoded, in order (``[]`` without ``items``). Text after the document's end is not read;
        text that is not a JSON prefix leaves the view as it was before the fault."""
        self._ended = []
        self._scanner.feed(fragment)
        return self._ended

    @property
    def text(self) -> str:
        """Everything fed so far."""
        return self._scanner.text

    @property
    def complete(self) -> bool:
        """The document has ended."""
        return self._scanner.end is not None

    @property
    def writing(self) -> str | None:
        """The path of the value being written (``Progress.writing``)."""
        return _path(self._scanner.stack)

    @property
    def value(self) -> Any:
        """The document so far as JSON values (dicts, lists, str, int, float, bool, None); ``None``
        before any value has begun. A copy, shared by the reads between two changes: do not change it."""
        if self._view is _NOTHING:
            self._view = None if self._root is _NOTHING else _copy(self._root)
        return self._view

    def _begins(self, start: int) -> None:
        opener = self._scanner.text[start]
        if opener in "{[":
            node: dict | list = {} if opener == "{" else []
            self._attach(node)
            self._open.append(node)

    def _ends(self, start: int, end: int) -> None:
        scanner = self._scanner
        text, stack = scanner.text, scanner.stack
        if text[start] in "{[":
            self._open.pop()  # its view already holds every member: nothing to add
        else:
            try:
                self._attach(json.loads(text[start:end]))
            except ValueError:  # not JSON (no grammar shaped it): leave it out
                pass
        if self._items is not None and _at(stack, self._items):
            try:
                self._ended.append(json.loads(text[start:end]))
            except ValueError:
                pass
        if len(stack) == 1 and stack[0].is_object and stack[0].key is not None:
            try:
                self.done[stack[0].key] = json.loads(text[start:end])
            except ValueError:
                pass

    def _attach(self, node: Any) -> None:
        """Put a value that began (a container) or ended (a scalar) where the scanner stands."""
        self._view = _NOTHING
        stack = self._scanner.stack
        if not stack:
            self._root = node
            return
        parent, frame = self._open[-1], stack[-1]
        if isinstance(parent, dict):
            if frame.key is not None:
                parent[frame.key] = node
        else:
            parent.append(node)


def progress(text: str) -> Progress:
    """Read a prefix of a JSON document (compact or not; ``stencil.service.json_scan`` reads it).

    Only a top-level object has members; for any other document ``done`` stays empty and
    ``complete`` says whether it has ended. Text that is not a JSON prefix gives what was read
    before the fault. To follow a stream, feed a ``PartialDocument`` its deltas instead: this
    reads the whole text again each time.
    """
    doc = PartialDocument()
    doc.feed(text)
    return Progress(dict(doc.done), doc.writing, doc.complete, doc.value)


def _at(stack: list[Frame], path: ItemPath) -> bool:
    """The scanner stands in an element of the list ``path`` names."""
    return len(stack) == len(path) and all(
        (not f.is_object) if name is None else (f.is_object and f.key == name) for f, name in zip(stack, path))


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _path(stack: list[Frame]) -> str | None:
    parts: list[str] = []
    for frame in stack:
        if frame.value_done:
            break
        if frame.is_object:
            if frame.key is None:
                break
            parts.append(("." if parts else "") + frame.key)
        else:
            if not frame.in_value:
                break
            parts.append(f"[{frame.index}]")
        if not frame.in_value:
            break
    return "".join(parts) or None


__all__ = ["ItemPath", "PartialDocument", "Progress", "progress"]
