"""Where a JSON document that is still being written stands: which members of the top-level
object are complete, and the path of the value being written now.

Stencil's grammar makes a streamed answer a prefix of a document that validates, so the members
this reads as complete are final: they will not change when more text arrives. Pure Python, no
dependency (the client, ``service.client``, uses it for ``stream_extract``).

    >>> progress('{"name":"Ann","home":{"city":"Os')
    Progress(done={'name': 'Ann'}, writing='home.city', complete=False)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_WS = " \t\r\n"
_SCALAR_END = ",]}" + _WS


@dataclass(slots=True)
class _Frame:
    """An open container: an object (``key`` of the member being read) or an array (``index``)."""

    is_object: bool
    key: str | None = None
    index: int = 0
    in_value: bool = False  # a member value / element has started and not ended
    value_done: bool = False  # ... and has ended (until the next comma)
    value_start: int = 0


@dataclass(slots=True)
class Progress:
    """Attributes:
        done: the top-level object's complete members, decoded (``json.loads``), in order.
        writing: the path of the value being written (``"home.city"``, ``"tags[1]"``), or
            ``None`` between values or once the document is complete.
        complete: the whole document has been read.
    """

    done: dict[str, Any] = field(default_factory=dict)
    writing: str | None = None
    complete: bool = False


def progress(text: str) -> Progress:
    """Read a prefix of a JSON document (compact or not).

    Only a top-level object has members; for any other document ``done`` stays empty and
    ``complete`` says whether it has ended. Text that is not a JSON prefix gives what was read
    before the fault.
    """
    out = Progress()
    stack: list[_Frame] = []
    in_string = escaped = False
    string_is_key = False
    string_start = 0
    scalar_start: int | None = None
    i, n = 0, len(text)

    def value_begins(at: int) -> None:
        if stack:
            top = stack[-1]
            top.in_value = True
            top.value_start = at

    def value_ends(end: int) -> None:
        if not stack:
            out.complete = True
            return
        top = stack[-1]
        if top.is_object and len(stack) == 1 and top.key is not None:
            try:
                out.done[top.key] = json.loads(text[top.value_start:end])
            except ValueError:
                pass
        top.in_value = False
        top.value_done = True

    while i < n:
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if string_is_key:
                    stack[-1].key = json.loads(text[string_start:i + 1])
                else:
                    value_ends(i + 1)
            i += 1
            continue
        if scalar_start is not None:
            if ch not in _SCALAR_END:
                i += 1
                continue
            scalar_start = None
            value_ends(i)  # the delimiter is read below
        if ch in _WS:
            i += 1
            continue
        top = stack[-1] if stack else None
        if ch == '"':
            in_string = True
            string_start = i
            string_is_key = top is not None and top.is_object and not top.in_value and top.key is None
            if not string_is_key:
                value_begins(i)
        elif ch in "{[":
            value_begins(i)
            stack.append(_Frame(is_object=ch == "{"))
        elif ch in "}]":
            if top is None:
                break
            stack.pop()
            value_ends(i + 1)
        elif ch == ":":
            pass
        elif ch == ",":
            if top is None:
                break
            top.value_done = False
            if top.is_object:
                top.key = None
            else:
                top.index += 1
        else:  # a number, true, false or null begins
            value_begins(i)
            scalar_start = i
        i += 1
    if scalar_start is not None and not stack:
        # A bare scalar at the end may still grow ("12" -> "123"): complete only when delimited.
        out.complete = False
    out.writing = _path(stack)
    return out


def _path(stack: list[_Frame]) -> str | None:
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
