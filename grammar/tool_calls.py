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

Agents send 50-500 tools, so the answer is assembled from parts: each function's call regex is
compiled once and kept in :class:`CallParts` (a bounded LRU keyed by the function's canonical
definition: name, parameters as compact JSON in their own key order, ``strict``, syntax), so a
repeated or extended tool list translates only the functions it has not seen. An answer whose call
regexes sum to more than :data:`LARK_FROM_CHARS` characters is written as a Lark grammar, one
terminal per call (``C0: /<tool_call>...<\/tool_call>/``), not as one regex: the same language,
but the front end then checks each terminal instead of handing ~170 KB of regex to Python's ``re``
parser (≈ 0.5 s for 100 BFCL functions on a 2-core machine, against ≈ 0.06 s for the Lark form,
``stencil bench tools``), and the service checks an answer by replaying its tokens, not with a
second regex engine. Free-form values (``{}``, an object without properties) are the same regex
in every function that has one: each call keeps them as terminal references
(``CallPart.text``), and the Lark form writes each such piece once, as a terminal the calls
name (``T<n>``), which llguidance reads once: it reads ~0.2 us a character of regex, so the
duplicated text was half its build time at 100 BFCL functions. Each call terminal ends where
its JSON arguments close, so no call is a prefix of another and llguidance's greedy lexer reads
the same calls the regex does. Small
answers stay regexes: those alone get an eager index (outlines-core) under the ``auto`` policy.

The service turns OpenAI's ``tools`` / ``tool_choice`` into :class:`ToolCalls`
(``stencil.service.tools.ToolPlan.calls``) and asks :func:`tool_call_spec` for the constraint; it
reads the calls back with ``stencil.service.tool_parser``, which shares the markers below.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.call_syntax import CALL_CLOSE, CALL_OPEN, CALL_SEP, HERMES, CallSyntax  # noqa: F401 (re-exported)
from stencil.grammar.json_schema.keywords import unknown_keywords
from stencil.grammar.json_schema.schema_compiler import schema_to_program, schema_to_regex
from stencil.grammar.program import expand, lark_terminals, renumbered
from stencil.grammar.regex_tools import MAX_LARK_DEFINITIONS, MAX_TERMINAL_CHARS

ANY_TEXT = r"[\s\S]*"
NO_ARGUMENTS: dict = {"type": "object", "properties": {}, "additionalProperties": False}
PARTS_MAX_ENTRIES = 4096  # call regexes kept by the default CallParts (functions x syntaxes)
PARTS_MAX_CHARS = 32 << 20  # ... and at most this many regex characters in all (≈ 32-64 MB)
LARK_FROM_CHARS = 16_000  # answers whose call regexes sum to more are written as Lark (module docstring)
ANSWERS_KEPT = 32  # Lark answers a CallParts keeps (CallParts.lark_answer)


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


@dataclass(frozen=True, slots=True)
class CallPart:
    """One function's call, compiled: its regex in a syntax and the keywords it relaxed.

    Attributes:
        regex: what one call of the function matches (:func:`call_regex`).
        notes: the relaxed keywords, each ``"tool NAME: ..."``.
        text: ``regex`` with its free-form values' pieces as terminal references to
            ``terminals`` (``stencil.grammar.program.term_ref``): what the Lark form writes, each
            piece once for the whole answer (``""``: ``regex`` itself, without references).
        terminals: the pieces ``text`` refers to, numbered from 0 for this call.
    """

    regex: str
    notes: tuple[str, ...]
    text: str = ""
    terminals: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """Characters held (what :class:`CallParts` counts)."""
        return len(self.regex) + len(self.text) + sum(map(len, self.terminals))


class CallParts:
    """A bounded LRU of compiled calls, keyed by the function's canonical definition: its name,
    its parameters as compact JSON (keys in their own order, which is the order the arguments
    are written in), ``strict`` and the syntax. Thread-safe; a failed compile is not kept.

    Args:
        max_entries: most calls kept.
        max_chars: most regex characters kept, all calls together.

    Also keeps the last :data:`ANSWERS_KEPT` Lark answers written from its calls
    (:meth:`lark_answer`), so a repeated list skips the writing too.

    Attributes:
        compiles: calls compiled (cache misses, refused ones included), since construction.
        hits: calls served from the cache.
    """

    def __init__(self, max_entries: int = PARTS_MAX_ENTRIES, max_chars: int = PARTS_MAX_CHARS):
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.compiles = 0
        self.hits = 0
        self._parts: OrderedDict[tuple, CallPart] = OrderedDict()
        self._chars = 0
        self._answers: OrderedDict[tuple, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._parts)

    def call(self, fn: ToolFunction, syntax: CallSyntax) -> CallPart:
        """The compiled call of ``fn`` in ``syntax``, from the cache or compiled now.

        Raises:
            stencil.grammar.base.GrammarError: ``fn``'s parameters cannot be enforced (its
                ``field`` is ``fn.field``).
        """
        key = _definition(fn, syntax)
        if key is not None:
            with self._lock:
                hit = self._parts.get(key)
                if hit is not None:
                    self._parts.move_to_end(key)
                    self.hits += 1
                    return hit
                self.compiles += 1
        else:
            with self._lock:
                self.compiles += 1
        try:
            schema = arguments_schema(fn.parameters)
            program = schema_to_program(schema, strict=fn.strict, grammar=False, share_terminals=True)
        except GrammarError as e:
            raise e.copy(field=fn.field) from None
        notes = [*unknown_keywords(schema), *program.warnings]  # (a typo such as "proprties" constrains nothing: said)
        text = call_regex(fn.name, program.text, syntax)
        part = CallPart(expand(text, program.terminals) if program.terminals else text,
                        tuple(f"tool {fn.name}: {n}" for n in notes),
                        text if program.terminals else "", program.terminals)
        with self._lock:
            if key is not None and key not in self._parts and part.size <= self.max_chars:
                self._parts[key] = part
                self._chars += part.size
                while len(self._parts) > self.max_entries or self._chars > self.max_chars:
                    _, old = self._parts.popitem(last=False)
                    self._chars -= old.size
        return part

    def lark_answer(self, calls: ToolCalls, compiled: list[CallPart], text_regex: str | None) -> str | None:
        """:func:`answer_lark` of ``compiled`` (the parts of ``calls.functions``, in order) with
        the pieces they share written once (:func:`_shared_terminals`); ``None`` where that would
        define more than ``MAX_LARK_DEFINITIONS`` names. Kept for a repeated list: the key holds
        the parts themselves (equal parts: the same call regexes) and the answer's shape."""
        key = (tuple(compiled), calls.required, calls.parallel, calls.max_calls, calls.syntax, text_regex)
        with self._lock:
            if key in self._answers:
                self._answers.move_to_end(key)
                return self._answers[key]
        shared, terminals = _shared_terminals(compiled)
        lark = (answer_lark(calls, shared, text_regex, terminals)
                if len(compiled) + len(terminals) + 4 <= MAX_LARK_DEFINITIONS else None)
        with self._lock:
            self._answers[key] = lark
            while len(self._answers) > ANSWERS_KEPT:
                self._answers.popitem(last=False)
        return lark

    def clear(self) -> None:
        with self._lock:
            self._parts.clear()
            self._answers.clear()
            self._chars = 0


def _definition(fn: ToolFunction, syntax: CallSyntax) -> tuple | None:
    """The cache key of ``fn``'s call in ``syntax``, or None when its parameters are not JSON
    (an in-process caller's own objects: compiled every time, never kept)."""
    try:
        params = json.dumps(fn.parameters, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return fn.name, params, bool(fn.strict), syntax


CALL_PARTS = CallParts()  # the process's calls (the service's requests share them)


def tool_call_spec(calls: ToolCalls, text_schema: Any = None, *, text_strict: bool = True,
                   text_field: str | None = None, parts: CallParts | None = None,
                   lark_from_chars: int = LARK_FROM_CHARS) -> tuple[GrammarSpec, list[str]]:
    """The constraint of a whole answer under ``calls``: a regex or Lark spec, and the relaxed
    keywords.

    Args:
        calls: the functions and the shape of the answer.
        text_schema: the JSON Schema a text answer must follow (not ``required`` only), or
            ``None`` for any text not starting a call (``calls.syntax``).
        text_strict: fail closed on ``text_schema``'s keywords the grammar cannot enforce.
        text_field: the request field holding ``text_schema``, for errors.
        parts: where compiled calls are kept (``None``: :data:`CALL_PARTS`, the process's).
        lark_from_chars: above this many characters of call regexes the answer is a Lark
            grammar (:func:`tool_lark`), else a regex (:func:`tool_regex`); the same language.

    Returns:
        ``(GrammarSpec("regex" or "lark", ...), warnings)``; warnings read ``"tool NAME: ..."``
        or ``"response format: ..."``, one per relaxed keyword.

    Raises:
        stencil.grammar.base.GrammarError: a schema the grammar cannot enforce (its ``field`` the
            function's ``field`` or ``text_field``). Runs the schema compiler for the functions
            ``parts`` has not seen: seconds for a large schema, so callers on an event loop run
            it in a thread.
    """
    parts = CALL_PARTS if parts is None else parts
    warnings: list[str] = []
    text = None
    if text_schema is not None:
        try:
            text, notes = schema_to_regex(text_schema, strict=text_strict)
        except GrammarError as e:
            raise e.copy(field=text_field) from None
        warnings.extend(f"response format: {n}" for n in notes)
    compiled = []
    for fn in calls.functions:
        part = parts.call(fn, calls.syntax)
        compiled.append(part)
        warnings.extend(part.notes)
    branches = [part.regex for part in compiled]
    if _as_lark(calls, branches, lark_from_chars):
        lark = parts.lark_answer(calls, compiled, text)
        if lark is not None:
            return GrammarSpec("lark", lark), warnings
    return GrammarSpec("regex", answer_regex(calls, branches, text)), warnings


def _shared_terminals(compiled: list[CallPart]) -> tuple[list[str], list[str]]:
    """The calls' texts with their terminal references numbered for the whole answer, and those
    terminals: pieces with the same text (the free-form values every function writes alike)
    are one terminal, which llguidance reads once (100 BFCL functions: 96 KB of regex, ~55%
    of it free-form values, 20 -> 11 ms to build, ``stencil bench tools``)."""
    numbers: dict[str, int] = {}
    terminals: list[str] = []
    texts = []
    for part in compiled:
        if not part.terminals:
            texts.append(part.regex)
            continue
        local: list[int] = []
        for piece in part.terminals:  # (a piece refers only to pieces numbered before it)
            piece = renumbered(piece, local)
            n = numbers.get(piece)
            if n is None:
                n = numbers[piece] = len(terminals)
                terminals.append(piece)
            local.append(n)
        texts.append(renumbered(part.text, local))
    return texts, terminals


def _as_lark(calls: ToolCalls, branches: list[str], lark_from_chars: int) -> bool:
    """Whether the answer is written as Lark: large enough, within the Lark front end's limits,
    and lexed as the regex reads it. A syntax with a ``begin`` (DeepSeek's, Granite's) stays a
    regex where a text answer is allowed: its ``begin`` would be a lexeme that a text answer may
    go on from, which a greedy lexer cannot take back."""
    if sum(map(len, branches)) <= lark_from_chars or (calls.syntax.begin and not calls.required):
        return False
    return len(branches) + 4 <= MAX_LARK_DEFINITIONS and all(
        len(b) + b.count("/") <= MAX_TERMINAL_CHARS for b in branches)


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
    return answer_regex(calls, [call_regex(fn.name, arguments_regex(fn), calls.syntax) for fn in calls.functions],
                        text_regex)


def answer_regex(calls: ToolCalls, branches: list[str], text_regex: str | None) -> str:
    """The regex of the whole answer from the regexes of its calls (``branches``, one per
    function of ``calls``); ``text_regex`` as :func:`tool_regex`'s. Without a separator the
    calls repeat as ``(?:...)+`` (or ``{1,max_calls}``): the alternation is written once."""
    syntax = calls.syntax
    one = "(?:" + "|".join(branches) + ")"
    if not calls.parallel or calls.max_calls == 1:
        answer = one
    elif not syntax.sep:
        answer = one + ("+" if calls.max_calls is None else f"{{1,{calls.max_calls}}}")
    elif calls.max_calls is None:
        answer = f"{one}(?:{literal(syntax.sep)}{one})*"
    else:
        answer = f"{one}(?:{literal(syntax.sep)}{one}){{0,{calls.max_calls - 1}}}"
    answer = literal(syntax.begin) + answer + literal(syntax.end)
    if calls.required:
        return answer
    return f"(?:{answer}|{_text_regex(syntax, text_regex)})"


def _text_regex(syntax: CallSyntax, text_regex: str | None) -> str:
    """What a text answer matches (the empty text included where it is one)."""
    if syntax.text_prefix:
        return literal(syntax.text_prefix) + "(?:" + (text_regex if text_regex is not None else ANY_TEXT) + ")"
    return text_regex if text_regex is not None else not_starting_with(syntax.call_marker)


def tool_lark(calls: ToolCalls, arguments_regex: ArgumentsRegex, text_regex: str | None) -> str:
    """The Lark grammar of the whole answer under ``calls``: the language of :func:`tool_regex`
    with the same arguments."""
    return answer_lark(calls, [call_regex(fn.name, arguments_regex(fn), calls.syntax) for fn in calls.functions],
                       text_regex)


def answer_lark(calls: ToolCalls, branches: list[str], text_regex: str | None,
                terminals: list[str] | tuple[str, ...] = ()) -> str:
    """The Lark grammar of the whole answer from the regexes of its calls: one terminal per
    call (``C<i>``), literal terminals for the syntax's ``begin``, ``sep`` and ``end``, and one
    for a text answer (``TEXT``, never empty: the empty answer is the start rule's empty
    alternative where it is one). ``branches`` may refer to ``terminals``
    (``stencil.grammar.program.term_ref``), each then a terminal of its own (``T<n>``) that the
    calls name: still one lexeme a call.

    Each call terminal ends where its arguments' JSON object closes, so none is a proper prefix
    of another match and llguidance's greedy lexer cannot cut a call short; ``TEXT`` never
    starts like a call (it starts with the syntax's ``text_prefix``, or not with its marker).
    """
    syntax = calls.syntax
    bodies, defs = lark_terminals(branches, terminals)
    lines = ["call: " + " | ".join(f"C{i}" for i in range(len(branches)))]
    lines += [f"C{i}: {body}" for i, body in enumerate(bodies)] + defs
    sep = ""
    if syntax.sep:
        lines.append(f"SEP: {_terminal(literal(syntax.sep))}")
        sep = "SEP "
    if not calls.parallel or calls.max_calls == 1:
        seq = "call"
    elif not sep:
        seq = "call+" if calls.max_calls is None else f"call ~ 1..{calls.max_calls}"
    elif calls.max_calls is None:
        seq = f"call ({sep}call)*"
    else:
        seq = f"call ({sep}call) ~ 0..{calls.max_calls - 1}"
    for name, text in (("BEGIN", syntax.begin), ("END", syntax.end)):
        if text:
            lines.append(f"{name}: {_terminal(literal(text))}")
    answer = ("BEGIN " if syntax.begin else "") + seq + (" END" if syntax.end else "")
    if calls.required:
        start = answer
    elif syntax.text_prefix or text_regex is not None:
        # (a JSON value or the prefix: never empty)
        lines.append(f"TEXT: {_terminal(_text_regex(syntax, text_regex))}")
        start = f"{answer} | TEXT"
    else:
        lines.append(f"TEXT: {_terminal(not_starting_with(syntax.call_marker, empty=False))}")
        start = f"{answer} | TEXT | "
    return "\n".join([f"start: {start}"] + lines) + "\n"


def _terminal(regex: str) -> str:
    """``regex`` as a Lark regex terminal (``/`` escaped; our regexes are written for both
    Python's and Rust's dialects, which llguidance's terminals are)."""
    return "/" + regex.replace("/", "\\/") + "/"


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


def not_starting_with(marker: str, *, empty: bool = True) -> str:
    """Regex of every string (empty included) that does not start with ``marker`` (non-empty).

    Such a string is a proper prefix of the marker, or agrees with it on some first ``i``
    characters, then differs, then goes on freely. Both parts are written as nested groups with
    one shared free tail: the flat alternation (one ``[\\s\\S]*`` per ``i``) made outlines-core's
    index build run past a minute on a 49k vocabulary, the nested form takes ~0.25 s. No
    lookahead, which outlines-core's regex dialect lacks. ``empty=False``: the same strings but
    the empty one (a Lark terminal must not match nothing).
    """
    diverge, prefixes = "", ""
    for i in range(len(marker) - 1, -1, -1):
        ch = literal(marker[i])
        other = f"[^{ch}]"  # a lone '-' right after '^' is literal in both dialects
        diverge = other if i == len(marker) - 1 else f"{other}|{ch}(?:{diverge})"
        if i < len(marker) - 1:
            prefixes = f"(?:{ch}{prefixes})?"
    if not empty:  # (the outermost ``?`` dropped: at least the marker's first character)
        prefixes = prefixes[3:-2] if prefixes else ""
        return f"(?:(?:{diverge}){ANY_TEXT}" + (f"|{prefixes}" if prefixes else "") + ")"
    return f"(?:(?:{diverge}){ANY_TEXT}|{prefixes})"
