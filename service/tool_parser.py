"""Reads tool calls out of a model's output as it streams, one text fragment at a time.

The grammar (``stencil.grammar.tool_calls``, the markers' home) makes the model write exactly

    <tool_call>{"name":"NAME","arguments":ARGUMENTS}</tool_call>   (one or more blocks)

with ARGUMENTS compact JSON, or (``tool_choice: "auto"``) a text answer that does not start with
``<tool_call>``. ``ToolCallParser.feed`` turns each new piece of text into events: text, a call
that starts (its name is known), a fragment of its arguments (as soon as the characters arrive),
a call that ends. Both the streamed answers (OpenAI's tool-call deltas, the Responses API's
``function_call_arguments.delta`` events) and the whole answers use it, so a call's arguments are
the same characters either way: the model's own JSON text.

The end of ARGUMENTS is found by the service's JSON scanner (``stencil.service.json_scan``): a container
ends at its closing bracket, a string at its closing quote, a bare scalar at the ``}`` that
closes the call object.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Literal

from stencil.grammar.tool_calls import CALL_CLOSE, CALL_OPEN
from stencil.service.json_scan import JsonScanner

_HEADER_START = CALL_OPEN + '{"name":"'
_HEADER = re.compile(re.escape(CALL_OPEN) + r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":')
_TRAILER = "}" + CALL_CLOSE


@dataclass(slots=True)
class ToolEvent:
    """One thing the output said.

    Attributes:
        kind: "text" (answer text), "start" (call ``index`` named ``name`` begins), "arguments"
            (``text`` continues call ``index``'s arguments), "end" (call ``index`` is complete).
        index: the call's position among the answer's calls (0-based); 0 for text.
        text: the text or arguments fragment.
        name: the function's name ("start" only).
    """

    kind: Literal["text", "start", "arguments", "end"]
    index: int = 0
    text: str = ""
    name: str = ""


@dataclass(slots=True)
class ParsedCall:
    """A call read so far: its function's name and the arguments' JSON text."""

    name: str
    arguments: str = ""
    complete: bool = False


class _State(enum.Enum):
    DECIDE = "decide"  # auto mode: text or calls, not known yet
    TEXT = "text"
    HEADER = "header"  # inside <tool_call>{"name":"...","arguments":
    ARGUMENTS = "arguments"
    TRAILER = "trailer"  # }</tool_call>
    BETWEEN = "between"  # after a call: another one, or the end
    BROKEN = "broken"  # the text left the format (only possible when cut short)


@dataclass(slots=True)
class ToolCallParser:
    """Incremental parser of one answer (see the module docstring).

    Args:
        may_be_text: ``tool_choice: "auto"`` (the answer may be text instead of calls).

    Attributes:
        calls: the calls read so far.
        text: the text answer read so far (auto mode).
    """

    may_be_text: bool
    calls: list[ParsedCall] = field(default_factory=list)
    text: str = ""
    _state: _State = _State.HEADER
    _buf: str = ""
    _scan: JsonScanner = field(default_factory=JsonScanner)

    def __post_init__(self) -> None:
        self._state = _State.DECIDE if self.may_be_text else _State.HEADER

    @property
    def complete(self) -> bool:
        """What was fed so far is a whole answer: text, or one or more complete calls."""
        if self._state is _State.TEXT:
            return True
        if self._state is _State.DECIDE:
            return True  # a proper prefix of "<tool_call>" (or nothing) is text
        return self._state is _State.BETWEEN and not self._buf and bool(self.calls)

    def feed(self, text: str) -> list[ToolEvent]:
        """Events carried by the next piece of output text (possibly none yet)."""
        events: list[ToolEvent] = []
        pending = text
        while pending:
            pending = self._step(pending, events)
        return events

    def finish(self) -> list[ToolEvent]:
        """Events due at the end of the output: a held-back text prefix in auto mode."""
        if self._state is _State.DECIDE and self._buf:
            self._state = _State.TEXT
            out, self._buf = self._buf, ""
            self.text += out
            return [ToolEvent("text", text=out)]
        return []

    def _step(self, text: str, events: list[ToolEvent]) -> str:
        """Consume a prefix of ``text`` in the current state; return the rest."""
        st = self._state
        if st is _State.TEXT:
            self.text += text
            events.append(ToolEvent("text", text=text))
            return ""
        if st is _State.BROKEN:
            return ""
        if st is _State.ARGUMENTS:
            return self._arguments(text, events)
        self._buf += text
        if st is _State.DECIDE:
            if self._buf.startswith(CALL_OPEN):
                self._state = _State.HEADER
                return self._take_buf()
            if not CALL_OPEN.startswith(self._buf):
                return self._become_text(events)
            return ""
        if st is _State.HEADER:
            return self._header(events)
        if st is _State.TRAILER:
            if self._buf.startswith(_TRAILER):
                rest = self._buf[len(_TRAILER):]
                self._buf = ""
                self.calls[-1].complete = True
                events.append(ToolEvent("end", index=len(self.calls) - 1))
                self._state = _State.BETWEEN
                return rest
            if not _TRAILER.startswith(self._buf):
                self._state = _State.BROKEN
            return ""
        # BETWEEN: another call, or nothing
        if self._buf.startswith(CALL_OPEN):
            self._state = _State.HEADER
            return self._take_buf()
        if not CALL_OPEN.startswith(self._buf):
            self._state = _State.BROKEN
        return ""

    def _take_buf(self) -> str:
        out, self._buf = self._buf, ""
        return out

    def _become_text(self, events: list[ToolEvent]) -> str:
        self._state = _State.TEXT
        out = self._take_buf()
        self.text += out
        events.append(ToolEvent("text", text=out))
        return ""

    def _header(self, events: list[ToolEvent]) -> str:
        m = _HEADER.match(self._buf)
        if m is None:
            head = self._buf[:len(_HEADER_START)]
            if not _HEADER_START.startswith(head):
                self._state = _State.BROKEN
            return ""
        name = json.loads(m.group(1))
        rest = self._buf[m.end():]
        self._buf = ""
        self.calls.append(ParsedCall(name))
        events.append(ToolEvent("start", index=len(self.calls) - 1, name=name))
        self._state = _State.ARGUMENTS
        self._scan = JsonScanner()
        return rest

    def _arguments(self, text: str, events: list[ToolEvent]) -> str:
        call = self.calls[-1]
        end = self._scan.feed(text)
        if end is None:
            self._emit_arguments(call, text, events)
            return ""
        self._emit_arguments(call, text[:end], events)
        self._state = _State.TRAILER
        return text[end:]

    def _emit_arguments(self, call: ParsedCall, fragment: str, events: list[ToolEvent]) -> None:
        if fragment:
            call.arguments += fragment
            events.append(ToolEvent("arguments", index=len(self.calls) - 1, text=fragment))


def parse_answer(text: str, may_be_text: bool) -> tuple[str | None, list[ParsedCall]] | None:
    """A whole answer as ``(text, [])`` or ``(None, calls)``; ``None`` if it is not a complete
    answer in the format (cut short)."""
    p = ToolCallParser(may_be_text)
    p.feed(text)
    p.finish()
    if not p.complete:
        return None
    if p.calls:
        return None, p.calls
    return p.text, []
