"""The grammar of a tool-calling answer: call blocks of the allowed functions, or a text answer.

A :class:`~stencil.grammar.call_syntax.CallSyntax` says how a model family writes its calls
(``stencil.service.tool_formats`` is the registry of families). The default, :data:`HERMES` (the Hermes / Qwen convention, compact JSON
inside), reads

    <tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>

and, say, Mistral's 2506 templates ``[TOOL_CALLS]get_weather[ARGS]{"city":"Paris"}``: every
syntax is ``begin``, then calls (``call_open`` NAME ``name_close`` ARGUMENTS ``call_close``)
separated by ``sep``, then ``end``.

With ``parallel`` one or more such calls follow each other (at most ``max_calls`` when
given); without it exactly one. (With a newline allowed between Hermes blocks, SmolLM2-135M chose
the newline over EOS and repeated its call until ``max_tokens``; right after ``</tool_call>`` it
prefers EOS to ``<``, so Hermes' ``sep`` is empty.)

Each block is the regex alternation over the allowed functions of
``{"name":"<f>","arguments":`` + the regex of ``f``'s ``parameters`` + ``}``, disjoint by the name.
Each function's parameters are compiled as a schema document of their own, so their ``$defs``,
``$ref``s (``#/$defs/Role``, ``#``) and ``$id``s resolve exactly as in the document the client
wrote (pydantic writes ``$defs`` for every nested model and Enum). A function without
``parameters`` takes ``{}`` exactly. A ``strict`` function fails closed on keywords the grammar
cannot enforce; otherwise only those are relaxed, and named in the warnings.

``required`` answers are call blocks only; otherwise (OpenAI's ``tool_choice: "auto"``) either call
blocks or a text answer, which is any text not starting with the first call's opening marker
(``<tool_call>``) or, given a ``text_schema``, that JSON (after the syntax's ``text_prefix``, where
it has one: functionary's ``all\n``). The grammar is the regex alternation of both, so the model picks with
its first tokens.

The service turns OpenAI's ``tools`` / ``tool_choice`` into :class:`ToolCalls`
(``stencil.service.tools.ToolPlan.calls``) and asks :func:`tool_call_spec` for the constraint; it
reads the calls back with ``stencil.service.tool_parser``, which shares the markers below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.call_syntax import CALL_CLOSE, CALL_OPEN, CALL_SEP, HERMES, CallSyntax  # noqa: F401 (re-exported)
from stencil.grammar.json_schema.schema_compiler import schema_to_regex

ANY_TEXT = r"[\s\S]*"
NO_ARGUMENTS: dict = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolFunction:
    """A function a call may name.

    Attributes:
        name: the function's name (written as a JSON string in the call).
        parameters: the JSON Schema of its arguments; ``None`` or empty: ``{}`` exactly.
        strict: refuse keywords the grammar cannot enforce (False: relax them and warn).
        field: the request field holding ``parameters``, set on a ``GrammarError`` they raise
            (``None``: unnamed).
    """

    name: str
    parameters: Any = None
    strict: bool = False
    field: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCalls:
    """What a tool-calling answer may be.

    Attributes:
        functions: the functions a call may name, in order (at least one).
        required: calls only (False: calls or a text answer).
        parallel: one or more calls (False: exactly one).
        max_calls: most calls when ``parallel`` (``None``: no limit).
        syntax: how the calls are written.
    """

    functions: tuple[ToolFunction, ...]
    required: bool
    parallel: bool
    max_calls: int | None = None
    syntax: CallSyntax = HERMES


ArgumentsRegex = Callable[[ToolFunction], str]


def arguments_schema(parameters: Any) -> dict:
    """The JSON Schema a call's ``arguments`` must satisfy: ``parameters``, or ``{}`` only
    (:data:`NO_ARGUMENTS`) when they are absent or empty."""
    return parameters if parameters else NO_ARGUMENTS


def tool_call_spec(calls: ToolCalls, text_schema: Any = None, *, text_strict: bool = True,
                   text_field: str | None = None) -> tuple[GrammarSpec, list[str]]:
    """The constraint of a whole answer under ``calls``: a regex spec, and the relaxed keywords.

    Args:
        calls: the functions and the shape of the answer.
        text_schema: the JSON Schema a text answer must follow (not ``required`` only), or
            ``None`` for any text not starting a call (``calls.syntax``).
        text_strict: fail closed on ``text_schema``'s keywords the grammar cannot enforce.
        text_field: the request field holding ``text_schema``, for errors.

    Returns:
        ``(GrammarSpec("regex", ...), warnings)``; warnings read ``"tool NAME: ..."`` or
        ``"response format: ..."``, one per relaxed keyword.

    Raises:
        stencil.grammar.base.GrammarError: a schema the grammar cannot enforce (its ``field`` the
            function's ``field`` or ``text_field``). Runs the schema compiler: seconds for a
            large schema, so callers on an event loop run it in a thread.
    """
    warnings: list[str] = []

    def compiled(schema: Any, strict: bool, field: str | None, label: str) -> str:
        try:
            regex, notes = schema_to_regex(schema, strict=strict)
        except GrammarError as e:
            raise e.copy(field=field) from None
        warnings.extend(f"{label}: {n}" for n in notes)
        return regex

    text = None
    if text_schema is not None:
        text = compiled(text_schema, text_strict, text_field, "response format")
    regex = tool_regex(calls, lambda fn: compiled(arguments_schema(fn.parameters), fn.strict, fn.field,
                                                  f"tool {fn.name}"), text)
    return GrammarSpec("regex", regex), warnings


def tool_regex(calls: ToolCalls, arguments_regex: ArgumentsRegex, text_regex: str | None) -> str:
    """The regex the whole answer must match under ``calls``.

    Args:
        calls: the functions and the shape of the answer.
        arguments_regex: a function → the regex of its arguments' compact JSON.
        text_regex: what a text answer must match when not ``required`` (``None``: any text not
            starting a call; after ``calls.syntax.text_prefix`` where it has one).

    Raises:
        stencil.grammar.base.GrammarError: from ``arguments_regex``.
    """
    syntax = calls.syntax
    branches = [call_regex(fn.name, arguments_regex(fn), syntax) for fn in calls.functions]
    one = "(?:" + "|".join(branches) + ")"
    if not calls.parallel:
        answer = one
    elif calls.max_calls is None:
        answer = f"{one}(?:{literal(syntax.sep)}{one})*"
    else:
        answer = f"{one}(?:{literal(syntax.sep)}{one}){{0,{calls.max_calls - 1}}}"
    answer = literal(syntax.begin) + answer + literal(syntax.end)
    if calls.required:
        return answer
    if syntax.text_prefix:
        text = literal(syntax.text_prefix) + "(?:" + (text_regex if text_regex is not None else ANY_TEXT) + ")"
    else:
        text = text_regex if text_regex is not None else not_starting_with(syntax.call_marker)
    return f"(?:{answer}|{text})"


def call_regex(name: str, arguments_regex: str, syntax: CallSyntax = HERMES) -> str:
    """Regex of one call of ``name`` in ``syntax`` (Hermes:
    ``<tool_call>{"name":"<name>","arguments":<arguments>}</tool_call>``)."""
    return (literal(syntax.call_open + name + syntax.name_close) + "(?:" + arguments_regex + ")"
            + literal(syntax.call_close))


def literal(text: str) -> str:
    """Regex matching ``text`` exactly; escapes only the metacharacters of both Python ``re`` and
    Rust ``regex`` (escaping ``<`` would mean a word boundary to Rust's regex 1.10+)."""
    return "".join("\\" + ch if ch in _META else ch for ch in text)


_META = frozenset("\\.^$|?*+()[]{}")


def not_starting_with(marker: str) -> str:
    """Regex of every string (empty included) that does not start with ``marker`` (non-empty).

    Such a string is a proper prefix of the marker, or agrees with it on some first ``i``
    characters, then differs, then goes on freely. Both parts are written as nested groups with
    one shared free tail: the flat alternation (one ``[\\s\\S]*`` per ``i``) made outlines-core's
    index build run past a minute on a 49k vocabulary, the nested form takes ~0.25 s. No
    lookahead, which outlines-core's regex dialect lacks.
    """
    diverge, prefixes = "", ""
    for i in range(len(marker) - 1, -1, -1):
        ch = literal(marker[i])
        other = f"[^{ch}]"  # a lone '-' right after '^' is literal in both dialects
        diverge = other if i == len(marker) - 1 else f"{other}|{ch}(?:{diverge})"
        if i < len(marker) - 1:
            prefixes = f"(?:{ch}{prefixes})?"
    return f"(?:(?:{diverge}){ANY_TEXT}|{prefixes})"
