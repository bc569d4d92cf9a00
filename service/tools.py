"""Tool calls for the OpenAI-compatible endpoints: the plan, the parse, the prompt.

``plan_tools`` resolves OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` into a
:class:`ToolPlan`; the grammar of the answer is built in ``grammar/`` (``stencil.grammar.tool_calls``:
the wire format, the call regex), which the plan asks for through :meth:`ToolPlan.calls`.

``tool_choice``:
- ``"none"``: no call; tools are left out of the prompt and the output is unconstrained by them.
- ``"required"``: the whole output is one (or, in parallel, several) call blocks.
- a named function: exactly one block calling it.
- ``"auto"`` (default when tools are given): either call blocks, or a text answer (any text not
  starting a call, or, with a JSON ``response_format``, that JSON).

The calls are written in the served family's syntax (``stencil.service.tool_formats``: Hermes'
``<tool_call>`` blocks, Mistral's ``[TOOL_CALLS]``, ...), which the plan carries.

``strict: true`` on a function fails closed on keywords the grammar cannot enforce; omitted or
false (OpenAI's default) relaxes only those, names them in the warnings, and the arguments are
checked with jsonschema afterwards. Reading calls back (whole or streamed) is
``stencil.service.tool_parser``. Tools reach the prompt through the chat template's ``tools=``
argument when the template uses it, else through a system message written here.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from stencil.grammar import tool_calls
from stencil.grammar.call_syntax import HERMES, CallSyntax
from stencil.grammar.tool_calls import ToolCalls, ToolFunction
from stencil.schemas.openai import ChatMessage, FunctionCall, FunctionDefinition, ToolCall
from stencil.service.tool_formats import HERMES_FORMAT, ToolFormat
from stencil.service.tool_parser import parse_answer

NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


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
        syntax: how the model writes its calls (the served ``stencil.service.tool_formats`` entry's).
    """

    mode: Literal["none", "auto", "required"]
    functions: tuple[FunctionDefinition, ...]
    parallel: bool
    max_calls: int | None = None
    syntax: CallSyntax = HERMES

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def function(self, name: str) -> FunctionDefinition | None:
        return next((fn for fn in self.functions if fn.name == name), None)

    def calls(self, parameters_field: str = "tools[{i}].function.parameters") -> ToolCalls:
        """What the grammar admits under this active plan (``stencil.grammar.tool_calls``);
        ``parameters_field`` names where function ``i`` of the plan holds its parameters."""
        return ToolCalls(tuple(ToolFunction(fn.name, fn.parameters, is_strict(fn), parameters_field.format(i=i))
                               for i, fn in enumerate(self.functions)),
                         required=self.mode == "required", parallel=self.parallel, max_calls=self.max_calls,
                         syntax=self.syntax)


def is_strict(fn: FunctionDefinition) -> bool:
    """OpenAI's meaning: only ``strict: true`` fails closed (omitted = false)."""
    return fn.strict is True


def plan_tools(functions: Sequence[FunctionDefinition], tool_choice: str | None, named: str | None = None,
               parallel_tool_calls: bool | None = None, max_calls: int | None = None,
               param: str = "tools", syntax: CallSyntax = HERMES) -> ToolPlan:
    """Resolve OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` into a plan.

    Args:
        functions: the request's function tools, in order.
        tool_choice: "none", "auto", "required", or ``None`` (auto with tools, else none);
            ignored when ``named`` is given.
        named: the function a named ``tool_choice`` asks for.
        parallel_tool_calls: ``None`` = true (OpenAI's default).
        max_calls: most calls per answer (the Responses API's ``max_tool_calls``).
        param: how the request calls its tool list (for errors).
        syntax: how the served model writes calls; one whose template shows one call per
            message (``syntax.parallel`` false) makes every answer a single call.

    Raises:
        ToolError: duplicate or malformed function names, ``parameters`` of a type other than
            ``object``, an unknown named function, a ``tool_choice`` other than ``none`` without
            tools, ``max_calls`` below 1.
    """
    names = [fn.name for fn in functions]
    for i, n in enumerate(names):
        if not NAME_PATTERN.match(n):
            raise ToolError(f"{param}[{i}]: function name {n!r} must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
                            param)
    for i, fn in enumerate(functions):
        kind = fn.parameters.get("type") if isinstance(fn.parameters, dict) else None
        if kind is not None and kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
            # OpenAI's rule: arguments are a JSON object (clients read them into a dict)
            raise ToolError(f"{param}[{i}]: function {fn.name!r}: parameters must be the JSON Schema of an object "
                            f"(type \"object\"), not of type {json.dumps(kind)}", param)
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
        return ToolPlan("required", (chosen[0],), False, syntax=syntax)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ToolPlan("none", (), False, syntax=syntax)
    if not functions:
        raise ToolError(f"tool_choice {tool_choice!r} needs at least one tool in '{param}'", "tool_choice")
    parallel = (True if parallel_tool_calls is None else parallel_tool_calls) and max_calls != 1 and syntax.parallel
    return ToolPlan(tool_choice, tuple(functions), parallel, max_calls if parallel else None,  # type: ignore[arg-type]
                    syntax)


def arguments_schema(fn: FunctionDefinition) -> dict:
    """The JSON Schema a call's ``arguments`` must satisfy (``{}`` only, without parameters)."""
    return tool_calls.arguments_schema(fn.parameters)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_output(text: str, plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """Split a finished output into ``(content, tool_calls)``.

    Output that starts a call (in ``plan.syntax``) is read as calls (``content`` is ``None``);
    anything else is a text answer with no calls. Arguments are the model's own JSON text
    (compact, as the grammar wrote it), as streamed.

    Raises:
        ValueError: output that starts a call but is not complete call blocks (only possible
            when generation was cut short).
    """
    if not plan.active:
        return text, []
    parsed = parse_answer(text, plan.mode == "auto", plan.syntax)
    if parsed is None:
        raise ValueError(f"output starts a tool call but holds no complete blocks: {text[:200]!r}")
    content, calls = parsed
    return content, [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                     for c in calls]


# -- prompt --------------------------------------------------------------------------------------


def template_supports_tools(chat_template: str | None) -> bool:
    """True when a Jinja chat template reads a ``tools`` variable (then it renders them itself)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def template_renders_calls(chat_template: str | None) -> bool:
    """True when a Jinja chat template reads messages' ``tool_calls`` (then it renders past calls
    and, by the same token, tool results itself)."""
    return bool(chat_template) and re.search(r"\btool_calls\b", chat_template) is not None


def tools_system_text(plan: ToolPlan) -> str:
    """The system-message description of the callable functions and the call format."""
    lines = ["You can call the following functions. Each is given as JSON with its name, "
             "description and JSON Schema parameters:"]
    for fn in plan.functions:
        lines.append(json.dumps({"name": fn.name, "description": fn.description or "",
                                 "parameters": arguments_schema(fn)}, ensure_ascii=False))
    example = plan.syntax.example or plan.syntax.calls_text([("<function name>", "<arguments as a JSON object>")])
    lines.append(f"To call a function, write {example}" + (" (one block per call)." if plan.parallel else "."))
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


def _calls_text(calls: list[ToolCall], syntax: CallSyntax) -> str:
    return syntax.calls_text([(c.function.name, json.dumps(_arguments(c), separators=(",", ":"), ensure_ascii=False))
                              for c in calls])


def _template_id(call_id: str, fmt: ToolFormat) -> str:
    return fmt.call_id(call_id) if fmt.call_id is not None else call_id


def _template_arguments(call: ToolCall, fmt: ToolFormat) -> Any:
    args = _arguments(call)  # checked JSON either way
    return json.dumps(args, ensure_ascii=False) if fmt.arguments_as_text else args


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments) if call.function.arguments else {}
    except ValueError:
        raise ToolError(f"tool call {call.id!r}: arguments are not JSON: {call.function.arguments[:100]!r}",
                        "messages") from None


def template_messages(messages: list[ChatMessage], plan: ToolPlan, native_tools: bool,
                      fmt: ToolFormat = HERMES_FORMAT,
                      native_calls: bool | None = None) -> tuple[list[dict], list[dict] | None]:
    """OpenAI messages → (messages for ``apply_chat_template``, its ``tools=`` argument or None).

    With ``native_tools`` the template sees assistant ``tool_calls`` and ``tool`` messages as they
    are, as ``fmt`` (the served tool-call format) says its template reads them: arguments as
    objects (or JSON text), ids it accepts, or (a template that drops past calls) the calls
    written into the content in ``fmt``'s syntax. Otherwise past calls become their text in
    ``fmt``'s syntax, tool results become user messages naming the function, and the tool
    description goes into the system message (prepended to the first system message, or as a
    new first message). ``developer`` messages are treated as ``system``. ``native_calls``: the
    template renders past calls and results though it takes no ``tools`` (DeepSeek R1's);
    ``None``: as ``native_tools``.

    Raises:
        ToolError: non-text content parts, or arguments of a past call that are not JSON.
    """
    calls_native = native_tools if native_calls is None else native_calls
    names: dict[str, str] = {}
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        text = _text_of(m, i)
        if role == "assistant" and m.tool_calls:
            for c in m.tool_calls:
                names[c.id] = c.function.name
            if calls_native and fmt.native_calls:
                out.append({"role": "assistant", "content": text, "tool_calls": [
                    {"id": _template_id(c.id, fmt), "type": "function",
                     "function": {"name": c.function.name, "arguments": _template_arguments(c, fmt)}}
                    for c in m.tool_calls]})
            else:
                calls_text = _calls_text(m.tool_calls, fmt.syntax)
                out.append({"role": "assistant", "content": (text + "\n" if text else "") + calls_text})
        elif role == "tool" and not calls_native:
            name = names.get(m.tool_call_id or "", m.name or "a function")
            out.append({"role": "user", "content": f"Result of calling {name}: {text}"})
        else:
            msg: dict = {"role": role, "content": text}
            if role == "tool" and m.tool_call_id is not None:
                msg["tool_call_id"] = _template_id(m.tool_call_id, fmt)
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
