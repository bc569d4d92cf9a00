"""Tool calls for the OpenAI-compatible endpoints: the plan, the grammar, the parse, the prompt.

Wire format the model writes (the Hermes / Qwen convention, compact JSON inside):

    <tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>

With ``parallel_tool_calls`` (OpenAI's default) one or more such blocks follow each other
directly (at most ``max_calls`` when given); with ``parallel_tool_calls: false`` exactly one.
(With a newline allowed between blocks, SmolLM2-135M chose the newline over EOS and repeated its
call until ``max_tokens``; right after ``</tool_call>`` it prefers EOS to ``<``.)

Each block is the regex alternation over the allowed functions of
``{"name":"<f>","arguments":`` + the regex of ``f``'s ``parameters`` + ``}``, disjoint by the name.
Each function's parameters are compiled as a schema document of their own, so their ``$defs``,
``$ref``s (``#/$defs/Role``, ``#``) and ``$id``s resolve exactly as in the document the client
wrote (pydantic writes ``$defs`` for every nested model and Enum). A function without
``parameters`` takes ``{}`` exactly. ``strict: true`` on a function fails closed on keywords the
grammar cannot enforce; omitted or false (OpenAI's default) relaxes only those, names them in
the warnings, and the arguments are checked with jsonschema afterwards.

``tool_choice``:
- ``"none"``: no call; tools are left out of the prompt and the output is unconstrained by them.
- ``"required"``: the whole output is one (or, in parallel, several) call blocks.
- a named function: exactly one block calling it.
- ``"auto"`` (default when tools are given): either call blocks, or a text answer, which is any
  text not starting with ``<tool_call>`` (or, with a JSON ``response_format``, that JSON). The
  grammar is the regex alternation of both, so the model picks with its first tokens.

Reading calls back (whole or streamed) is ``stencil.service.tool_parser``. Tools reach the prompt
through the chat template's ``tools=`` argument when the template uses it, else through a
system message written here.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from stencil.schemas.openai import ChatMessage, FunctionCall, FunctionDefinition, ToolCall
from stencil.service.tool_parser import CALL_CLOSE, CALL_OPEN, parse_answer

CALL_SEP = ""
ANY_TEXT = r"[\s\S]*"

NO_ARGUMENTS: dict = {"type": "object", "properties": {}, "additionalProperties": False}
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names

ArgumentsRegex = Callable[[FunctionDefinition], str]


class ToolError(ValueError):
    """A ``tools`` / ``tool_choice`` / tool message combination that cannot be served.

    Attributes:
        param: the request field at fault (``"tool_choice"``, ``"tools"``, ``"messages"``).
    """

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request uses its tools.

    Attributes:
        mode: "none" (no call possible), "auto" (text or calls), "required" (calls only).
        functions: the functions a call may name (one, for a named ``tool_choice``).
        parallel: several calls allowed in one answer.
        max_calls: most calls in one answer when ``parallel`` (None: no limit).
    """

    mode: Literal["none", "auto", "required"]
    functions: tuple[FunctionDefinition, ...]
    parallel: bool
    max_calls: int | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def function(self, name: str) -> FunctionDefinition | None:
        return next((fn for fn in self.functions if fn.name == name), None)


def is_strict(fn: FunctionDefinition) -> bool:
    """OpenAI's meaning: only ``strict: true`` fails closed (omitted = false)."""
    return fn.strict is True


def plan_tools(functions: Sequence[FunctionDefinition], tool_choice: str | None, named: str | None = None,
               parallel_tool_calls: bool | None = None, max_calls: int | None = None,
               param: str = "tools") -> ToolPlan:
    """Resolve OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` into a plan.

    Args:
        functions: the request's function tools, in order.
        tool_choice: "none", "auto", "required", or ``None`` (auto with tools, else none);
            ignored when ``named`` is given.
        named: the function a named ``tool_choice`` asks for.
        parallel_tool_calls: ``None`` = true (OpenAI's default).
        max_calls: most calls per answer (the Responses API's ``max_tool_calls``).
        param: how the request calls its tool list (for errors).

    Raises:
        ToolError: duplicate or malformed function names, an unknown named function, a
            ``tool_choice`` other than ``none`` without tools, ``max_calls`` below 1.
    """
    names = [fn.name for fn in functions]
    for i, n in enumerate(names):
        if not NAME_PATTERN.match(n):
            raise ToolError(f"{param}[{i}]: function name {n!r} must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
                            param)
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ToolError(f"function names must be unique; repeated: {', '.join(dupes)}", param)
    if max_calls is not None and max_calls < 1:
        raise ToolError(f"max_tool_calls must be at least 1, got {max_calls}", "max_tool_calls")
    if named is not None:
        chosen = [fn for fn in functions if fn.name == named]
        if not chosen:
            raise ToolError(f"tool_choice names function {named!r}, which is not among the tools "
                            f"({', '.join(names) or 'none given'})", "tool_choice")
        return ToolPlan("required", (chosen[0],), False)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ToolPlan("none", (), False)
    if not functions:
        raise ToolError(f"tool_choice {tool_choice!r} needs at least one tool in '{param}'", "tool_choice")
    parallel = (True if parallel_tool_calls is None else parallel_tool_calls) and max_calls != 1
    return ToolPlan(tool_choice, tuple(functions), parallel, max_calls if parallel else None)  # type: ignore[arg-type]


def arguments_schema(fn: FunctionDefinition) -> dict:
    """The JSON Schema a call's ``arguments`` must satisfy (``{}`` only, without parameters)."""
    return fn.parameters if fn.parameters else NO_ARGUMENTS


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


def call_regex(fn: FunctionDefinition, arguments_regex: str) -> str:
    """Regex of one call object of ``fn``: ``{"name":"<fn>","arguments":<arguments>}``."""
    head = '{"name":' + json.dumps(fn.name) + ',"arguments":'
    return literal(head) + "(?:" + arguments_regex + ")" + literal("}")


def tool_regex(plan: ToolPlan, arguments_regex: ArgumentsRegex, text_regex: str | None) -> str:
    """The regex the whole assistant output must match under ``plan`` (mode not "none").

    Args:
        plan: an active plan.
        arguments_regex: a function → the regex of its arguments' compact JSON (the grammar's
            compiler run on ``arguments_schema(fn)`` as a document of its own).
        text_regex: what a text answer must match in "auto" mode (``None``: any text not
            starting with ``<tool_call>``).

    Raises:
        stencil.grammar.base.GrammarError: from ``arguments_regex`` on a schema it cannot enforce.
    """
    branches = [call_regex(fn, arguments_regex(fn)) for fn in plan.functions]
    one = literal(CALL_OPEN) + "(?:" + "|".join(branches) + ")" + literal(CALL_CLOSE)
    if not plan.parallel:
        calls = one
    elif plan.max_calls is None:
        calls = f"{one}(?:{literal(CALL_SEP)}{one})*"
    else:
        calls = f"{one}(?:{literal(CALL_SEP)}{one}){{0,{plan.max_calls - 1}}}"
    if plan.mode == "required":
        return calls
    text = text_regex if text_regex is not None else not_starting_with(CALL_OPEN)
    return f"(?:{calls}|{text})"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_output(text: str, plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """Split a finished output into ``(content, tool_calls)``.

    Output that starts with ``<tool_call>`` is read as call blocks (``content`` is ``None``);
    anything else is a text answer with no calls. Arguments are the model's own JSON text
    (compact, as the grammar wrote it), as streamed.

    Raises:
        ValueError: output that starts a call but is not complete call blocks (only possible
            when generation was cut short).
    """
    if not plan.active:
        return text, []
    parsed = parse_answer(text, plan.mode == "auto")
    if parsed is None:
        raise ValueError(f"output starts a tool call but holds no complete blocks: {text[:200]!r}")
    content, calls = parsed
    return content, [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                     for c in calls]


# -- prompt --------------------------------------------------------------------------------------


def template_supports_tools(chat_template: str | None) -> bool:
    """True when a Jinja chat template reads a ``tools`` variable (then it renders them itself)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def tools_system_text(plan: ToolPlan) -> str:
    """The system-message description of the callable functions and the call format."""
    lines = ["You can call the following functions. Each is given as JSON with its name, "
             "description and JSON Schema parameters:"]
    for fn in plan.functions:
        lines.append(json.dumps({"name": fn.name, "description": fn.description or "",
                                 "parameters": arguments_schema(fn)}, ensure_ascii=False))
    lines.append(f'To call a function, write {CALL_OPEN}{{"name": <function name>, "arguments": '
                 f'<arguments as a JSON object>}}{CALL_CLOSE}'
                 + (" (one block per call)." if plan.parallel else "."))
    if plan.mode == "auto":
        lines.append("If no function is needed, answer in plain text instead.")
    return "\n".join(lines)


def _text_of(msg: ChatMessage, index: int) -> str:
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    parts = []
    for part in msg.content:
        if part.type != "text" or part.text is None:
            raise ToolError(f"messages[{index}]: content part of type {part.type!r} is not supported "
                            "(only 'text')", "messages")
        parts.append(part.text)
    return "".join(parts)


def _calls_text(calls: list[ToolCall]) -> str:
    blocks = []
    for c in calls:
        blocks.append(CALL_OPEN + json.dumps({"name": c.function.name, "arguments": _arguments(c)},
                                             separators=(",", ":"), ensure_ascii=False) + CALL_CLOSE)
    return CALL_SEP.join(blocks)


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments) if call.function.arguments else {}
    except ValueError:
        raise ToolError(f"tool call {call.id!r}: arguments are not JSON: {call.function.arguments[:100]!r}",
                        "messages") from None


def template_messages(messages: list[ChatMessage], plan: ToolPlan,
                      native_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """OpenAI messages → (messages for ``apply_chat_template``, its ``tools=`` argument or None).

    With ``native_tools`` the template sees assistant ``tool_calls`` (arguments as objects) and
    ``tool`` messages as they are. Otherwise past calls become their ``<tool_call>`` text, tool
    results become user messages naming the function, and the tool description goes into the
    system message (prepended to the first system message, or as a new first message).
    ``developer`` messages are treated as ``system``.

    Raises:
        ToolError: non-text content parts, or arguments of a past call that are not JSON.
    """
    names: dict[str, str] = {}
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        text = _text_of(m, i)
        if role == "assistant" and m.tool_calls:
            for c in m.tool_calls:
                names[c.id] = c.function.name
            if native_tools:
                out.append({"role": "assistant", "content": text, "tool_calls": [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": _arguments(c)}} for c in m.tool_calls]})
            else:
                out.append({"role": "assistant", "content": (text + "\n" if text else "") + _calls_text(m.tool_calls)})
        elif role == "tool" and not native_tools:
            name = names.get(m.tool_call_id or "", m.name or "a function")
            out.append({"role": "user", "content": f"Result of calling {name}: {text}"})
        else:
            msg: dict = {"role": role, "content": text}
            if role == "tool" and m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
    if not plan.active:
        return out, None
    if native_tools:
        return out, [{"type": "function", "function": {k: v for k, v in (
            ("name", fn.name), ("description", fn.description), ("parameters", arguments_schema(fn)))
            if v is not None}} for fn in plan.functions]
    described = tools_system_text(plan)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": described + "\n\n" + out[0]["content"]}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out, None
