"""Where a JSON document that is still being written stands: which members of the top-level
object are complete, and the path of the value being written now.

Stencil's grammar makes a streamed answer a prefix of a document that validates, so the members
this reads as complete are final: they will not change when more text arrives. Pure Python, no
dependency (the client, ``stencil.service.client``, uses it for ``stream_extract``).

    >>> progress('{"name":"Ann","home":{"city":"Os')
    Progress(done={'name': 'Ann'}, writing='home.city', complete=False)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stencil.service.json_scan import Frame, JsonScanner


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
    """Read a prefix of a JSON document (compact or not; ``stencil.service.json_scan`` reads it).

    Only a top-level object has members; for any other document ``done`` stays empty and
    ``complete`` says whether it has ended. Text that is not a JSON prefix gives what was read
    before the fault.
    """
    out = Progress()

    def member_ends(start: int, end: int) -> None:
        stack = scanner.stack
        if len(stack) == 1 and stack[0].is_object and stack[0].key is not None:
            try:
                out.done[stack[0].key] = json.loads(scanner.text[start:end])
            except ValueError:
                pass

    scanner = JsonScanner(on_end=member_ends)
    scanner.feed(text)
    out.complete = scanner.end is not None
    out.writing = _path(scanner.stack)
    return out


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
