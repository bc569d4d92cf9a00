"""Reads tool calls out of a model's output as it streams, one text fragment at a time.

The grammar (``stencil.grammar.tool_calls``, the syntaxes' home) makes the model write its calls in
its family's :class:`~stencil.grammar.call_syntax.CallSyntax`, by default (Hermes)

    <tool_call>{"name":"NAME","arguments":ARGUMENTS}</tool_call>   (one or more blocks)

with ARGUMENTS compact JSON, or (``tool_choice: "auto"``) a text answer that does not start a
call (or that starts with the syntax's ``text_prefix``). ``ToolCallParser.feed`` turns each new
piece of text into events: text, a call that starts (its name is known), a fragment of its
arguments (as soon as the characters arrive), a call that ends. Both the streamed answers
(OpenAI's tool-call deltas, the Responses API's ``function_call_arguments.delta`` events) and the
whole answers use it, so a call's arguments are the same characters either way: the model's own
JSON text.

The end of ARGUMENTS is found by the service's JSON scanner (``stencil.service.json_scan``): a container
ends at its closing bracket, a string at its closing quote, a bare scalar at the ``}`` that
closes a JSON family's call object (a bare scalar is not ended by the other families' markers:
functions' ``parameters`` are objects in practice).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Literal

from stencil.grammar.call_syntax import HERMES, NAME_CHARS, CallSyntax
from stencil.service.json_scan import JsonScanner

_NAME = re.compile(f"[{NAME_CHARS}]*")


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
    HEADER = "header"  # the opener (begin or sep, then call_open), the name, name_close
    ARGUMENTS = "arguments"
    TRAILER = "trailer"  # call_close
    BETWEEN = "between"  # after a call: sep and another one, or end
    DONE = "done"  # after end
    BROKEN = "broken"  # the text left the format (only possible when cut short)


@dataclass(slots=True)
class ToolCallParser:
    """Incremental parser of one answer (see the module docstring).

    Args:
        may_be_text: ``tool_choice: "auto"`` (the answer may be text instead of calls).
        syntax: how the calls are written (Hermes by default).

    Attributes:
        calls: the calls read so far.
        text: the text answer read so far (auto mode; without the syntax's ``text_prefix``).
    """

    may_be_text: bool
    syntax: CallSyntax = HERMES
    calls: list[ParsedCall] = field(default_factory=list)
    text: str = ""
    _state: _State = _State.HEADER
    _buf: str = ""
    _opener: str = ""  # what the call being read starts with
    _scan: JsonScanner = field(default_factory=JsonScanner)

    def __post_init__(self) -> None:
        self._state = _State.DECIDE if self.may_be_text else _State.HEADER
        self._opener = self.syntax.opener

    @property
    def complete(self) -> bool:
        """What was fed so far is a whole answer: text, or one or more complete calls."""
        if self._state is _State.TEXT:
            return True
        if self._state is _State.DECIDE:
            # a proper prefix of the call marker (or nothing) is text, unless text has a prefix of its own
            return not self.syntax.text_prefix
        if self._state is _State.DONE:
            return True
        return self._state is _State.BETWEEN and not self._buf and not self.syntax.end and bool(self.calls)

    def feed(self, text: str) -> list[ToolEvent]:
        """Events carried by the next piece of output text (possibly none yet)."""
        events: list[ToolEvent] = []
        pending = text
        while pending:
            pending = self._step(pending, events)
        return events

    def finish(self) -> list[ToolEvent]:
        """Events due at the end of the output: a held-back text prefix in auto mode."""
        if self._state is _State.DECIDE and self._buf and not self.syntax.text_prefix:
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
        if st in (_State.BROKEN, _State.DONE):
            if st is _State.DONE:
                self._state = _State.BROKEN  # nothing may follow the calls' end
            return ""
        if st is _State.ARGUMENTS:
            return self._arguments(text, events)
        self._buf += text
        if st is _State.DECIDE:
            return self._decide(events)
        if st is _State.HEADER:
            return self._header(events)
        if st is _State.TRAILER:
            close = self.syntax.call_close
            if self._buf.startswith(close):
                rest = self._buf[len(close):]
                self._buf = ""
                self._end_call(events)
                return rest
            if not close.startswith(self._buf):
                self._state = _State.BROKEN
            return ""
        # BETWEEN: another call (sep, then its opener), or the end
        again, end = self.syntax.sep + self.syntax.call_open, self.syntax.end
        if end and self._buf.startswith(end):
            self._state = _State.DONE
            return self._take_buf()[len(end):]
        if self._buf.startswith(again):  # every family's sep + call_open is non-empty
            self._state, self._opener = _State.HEADER, again
            return self._take_buf()
        if not again.startswith(self._buf) and not end.startswith(self._buf):
            self._state = _State.BROKEN
        return ""

    def _decide(self, events: list[ToolEvent]) -> str:
        prefix = self.syntax.text_prefix
        if prefix:
            if self._buf.startswith(prefix):
                self._state = _State.TEXT
                rest = self._take_buf()[len(prefix):]
                return rest
            if prefix.startswith(self._buf):
                return ""
            self._state = _State.HEADER
            return self._take_buf()
        marker = self.syntax.call_marker
        if self._buf.startswith(marker):
            self._state = _State.HEADER
            return self._take_buf()
        if not marker.startswith(self._buf):
            return self._become_text(events)
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
        opener, close = self._opener, self.syntax.name_close
        if len(self._buf) < len(opener):
            if not opener.startswith(self._buf):
                self._state = _State.BROKEN
            return ""
        if not self._buf.startswith(opener):
            self._state = _State.BROKEN
            return ""
        after = self._buf[len(opener):]
        name = _NAME.match(after).group()
        tail = after[len(name):]
        if not tail.startswith(close):
            if not close.startswith(tail):
                self._state = _State.BROKEN
            return ""
        if not name:
            self._state = _State.BROKEN
            return ""
        rest = tail[len(close):]
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
        if self.syntax.call_close:
            self._state = _State.TRAILER
        else:  # nothing closes a call but its arguments (functionary, Mistral's [ARGS] form)
            self._end_call(events)
        return text[end:]

    def _end_call(self, events: list[ToolEvent]) -> None:
        self.calls[-1].complete = True
        events.append(ToolEvent("end", index=len(self.calls) - 1))
        self._state = _State.BETWEEN

    def _emit_arguments(self, call: ParsedCall, fragment: str, events: list[ToolEvent]) -> None:
        if fragment:
            call.arguments += fragment
            events.append(ToolEvent("arguments", index=len(self.calls) - 1, text=fragment))


def parse_answer(text: str, may_be_text: bool,
                 syntax: CallSyntax = HERMES) -> tuple[str | None, list[ParsedCall]] | None:
    """A whole answer as ``(text, [])`` or ``(None, calls)``; ``None`` if it is not a complete
    answer in ``syntax`` (cut short)."""
    p = ToolCallParser(may_be_text, syntax)
    p.feed(text)
    p.finish()
    if not p.complete:
        return None
    if p.calls:
        return None, p.calls
    return p.text, []
