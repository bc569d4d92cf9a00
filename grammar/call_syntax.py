"""How a model family writes its tool calls, as text: the syntax the grammar
(``stencil.grammar.tool_calls``) and the reader (``stencil.service.tool_parser``) share.

Apart from ``tool_calls`` so that the registry of families (``stencil.service.tool_formats``) and
the command line's list of their names import nothing heavy (the grammar's modules load torch).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CALL_CLOSE", "CALL_OPEN", "CALL_SEP", "HERMES", "NAME_CHARS", "CallSyntax"]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_SEP = ""  # between Hermes blocks (stencil.grammar.tool_calls says why: no newline)
NAME_CHARS = "A-Za-z0-9_-"  # OpenAI's function names (stencil.service.tools.NAME_PATTERN)


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """How a model family writes its tool calls, as text.

    The calls of one answer read ``begin`` + call + (``sep`` + call)* + ``end``, each call
    ``call_open`` + NAME + ``name_close`` + ARGUMENTS (compact JSON) + ``call_close``. NAME is
    written bare: a function name is ``[A-Za-z0-9_-]`` only, so in the JSON families
    (``call_open`` ending in ``"name":"``) it is its own JSON string's content, and
    ``name_close`` must start with a character no name has.

    Attributes:
        name: the family's name (``"hermes"``, ``"mistral"``, ...).
        begin, end: around all the calls of an answer.
        call_open, name_close, call_close: around each call's name and arguments.
        sep: between two calls.
        text_prefix: what a text answer starts with (functionary's ``"all\n"``); empty: a text
            answer is any text that does not start with ``marker``.
        marker: what no text answer starts with (empty: the first call's opener; Hermes: the
            ``<tool_call>`` tag alone).
        parallel: the family's template shows several calls in one assistant message (False:
            one call per answer, whatever ``parallel_tool_calls`` says).
        example: how a system message written for a template without tools shows a call
            (``stencil.service.tools.tools_system_text``); empty: one call with placeholders.
    """

    name: str
    call_open: str
    name_close: str
    call_close: str
    begin: str = ""
    sep: str = ""
    end: str = ""
    text_prefix: str = ""
    marker: str = ""
    parallel: bool = True
    example: str = ""

    @property
    def opener(self) -> str:
        """What the first call of an answer starts with (before its name)."""
        return self.begin + self.call_open

    @property
    def call_marker(self) -> str:
        """What no text answer starts with (without a ``text_prefix``): it starts the calls."""
        return self.marker or self.opener

    def call_text(self, name: str, arguments_json: str) -> str:
        """One call as the model writes it (``arguments_json``: compact JSON text)."""
        return self.call_open + name + self.name_close + arguments_json + self.call_close

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """An answer of ``(name, arguments_json)`` calls as the model writes it."""
        return self.begin + self.sep.join(self.call_text(n, a) for n, a in calls) + self.end


HERMES = CallSyntax("hermes", CALL_OPEN + '{"name":"', '","arguments":', "}" + CALL_CLOSE, sep=CALL_SEP,
                    marker=CALL_OPEN,
                    example=CALL_OPEN + '{"name": <function name>, "arguments": <arguments as a JSON object>}'
                    + CALL_CLOSE)
