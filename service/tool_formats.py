"""How a model family writes tool calls: a registry of formats, and which one a chat template uses.

Every family's chat template shows the model past calls in its own syntax, and the model was
trained to write new ones the same way. A :class:`ToolFormat` is one family: the
:class:`~stencil.grammar.call_syntax.CallSyntax` its calls are written in (the grammar,
``stencil.grammar.tool_calls.tool_regex``, and the reader, ``stencil.service.tool_parser``, both
work from it), a detector over the template's text, and how earlier calls go back through that
template (``stencil.service.tools.template_messages``). The answer the client sees is OpenAI's
wire format whatever the syntax.

The families, each read from the real template (``tests/real_templates.py``), compact JSON inside:

============== =================================================================================
hermes         ``<tool_call>{"name":"f","arguments":{...}}</tool_call>`` (Hermes 2/3, Qwen2.5,
               Qwen3; and any template that shows no syntax of its own)
llama3_json    ``{"name":"f","parameters":{...}}``, one call per answer (Llama 3.1-3.3: their
               templates refuse several; ``<|python_tag|>`` is only for their built-in tools'
               Python calls, which are not served)
mistral_nemo   ``[TOOL_CALLS][{"name":"f","arguments":{...}},...]`` (Mistral Nemo, 7B v0.3)
mistral        ``[TOOL_CALLS]f[ARGS]{...}`` per call (Mistral Small 3.2 2506, Devstral)
deepseek_r1    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f`` + a json fence
               around the arguments (DeepSeek R1 and its distills)
deepseek_v3_1  ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...``
granite        ``<|tool_call|>[{"name":"f","arguments":{...}},...]`` (Granite 3.x)
functionary_v3_2
               ``f\\n{...}>>>g\\n{...}`` after the prompt's ``>>>``; a text answer is ``all\\n...``
               (functionary medium/small v3.2)
gpt_oss        ``<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>``,
               one call per answer (harmony; its template renders one per message)
============== =================================================================================

Known limit: the markers are written by the grammar as TEXT. The grammar's alphabet leaves a
model's added and special tokens out (``stencil.grammar.vocab``), so a model spells
``[TOOL_CALLS]`` or ``<｜tool▁sep｜>`` with ordinary tokens, not with the one control token its
training used (and a family's detector reads only the template, so a syntax the registry lacks,
Qwen3-Coder's XML calls inside ``<tool_call>`` say, is served as the nearest entry's). How much
a real model's calls suffer from the spelled markers is not measured here: the tests use tiny
random models.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from stencil.service.chat_formats import check_known, first_detected, has
from stencil.grammar.call_syntax import HERMES, CallSyntax


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's tool-call syntax and template habits.

    Attributes:
        syntax: how the model writes its calls (``syntax.name`` is the format's name:
            ``--tool-call-format``, ``/v1/models``' ``chat_format.tool_calls``).
        detect: whether a chat template's text is this family's.
        native_calls: the template renders an assistant message's ``tool_calls`` (False: they go
            into the message's content, written in ``syntax``; Granite 3.3's template drops them).
        arguments_as_text: the template wants a past call's ``arguments`` as the JSON string
            (functionary), not as an object.
        call_id: what a past call's id becomes for the template (Mistral's templates refuse ids
            that are not 9 letters and digits), or ``None`` to pass ids as they are.
        families: the models it was read from, for the docs.
    """

    syntax: CallSyntax
    detect: Callable[[str], bool]
    native_calls: bool = True
    arguments_as_text: bool = False
    call_id: Callable[[str], str] | None = None
    families: str = ""

    @property
    def name(self) -> str:
        return self.syntax.name


_MISTRAL_ID = re.compile(r"^[a-zA-Z0-9]{9}$")


def mistral_call_id(call_id: str) -> str:
    """``call_id`` as 9 letters and digits (Mistral's templates refuse other ids): kept when it
    is one already, else the first 9 hex digits of its SHA-256, so a call and its result agree."""
    if _MISTRAL_ID.match(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


_DS_CALLS, _DS_CALL, _DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
_DS_CALL_END, _DS_CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"

HERMES_FORMAT = ToolFormat(HERMES, has("<tool_call>"), families="Hermes 2 Pro / 3, Qwen2.5, Qwen3")

# Most specific first: ``detect`` returns the first entry that matches.
FORMATS: tuple[ToolFormat, ...] = (
    ToolFormat(CallSyntax("gpt_oss", "<|channel|>commentary to=functions.", " <|constrain|>json<|message|>",
                          "<|call|>", text_prefix="<|channel|>final<|message|>", parallel=False),
               has("<|channel|>", "<|call|>"), families="gpt-oss (harmony)"),
    ToolFormat(CallSyntax("deepseek_r1", _DS_CALL + "function" + _DS_SEP, "\n```json\n", "\n```" + _DS_CALL_END,
                          begin=_DS_CALLS, sep="\n", end=_DS_CALLS_END),
               has(_DS_CALLS, "```json"), families="DeepSeek R1 and its distills"),
    ToolFormat(CallSyntax("deepseek_v3_1", _DS_CALL, _DS_SEP, _DS_CALL_END, begin=_DS_CALLS, end=_DS_CALLS_END),
               has(_DS_CALLS, _DS_SEP), families="DeepSeek V3.1"),
    ToolFormat(CallSyntax("mistral", "[TOOL_CALLS]", "[ARGS]", ""),
               has("[TOOL_CALLS]", "[ARGS]"), call_id=mistral_call_id,
               families="Mistral Small 3.2 (2506), Devstral"),
    ToolFormat(CallSyntax("mistral_nemo", '{"name":"', '","arguments":', "}", begin="[TOOL_CALLS][", sep=",",
                          end="]", marker="[TOOL_CALLS]"),
               has("[TOOL_CALLS]"), call_id=mistral_call_id, families="Mistral Nemo, Mistral 7B v0.3"),
    ToolFormat(CallSyntax("granite", '{"name":"', '","arguments":', "}", begin="<|tool_call|>[", sep=",", end="]",
                          marker="<|tool_call|>"),
               has("<|tool_call|>"), native_calls=False, families="Granite 3.x"),
    ToolFormat(CallSyntax("functionary_v3_2", "", "\n", "", sep=">>>", text_prefix="all\n"),
               has(">>>all"), arguments_as_text=True, families="functionary v3.2"),
    ToolFormat(CallSyntax("llama3_json", '{"name":"', '","parameters":', "}", parallel=False),
               has('"parameters": ', "<|start_header_id|>"), families="Llama 3.1, 3.2, 3.3"),
    HERMES_FORMAT,
)

BY_NAME: dict[str, ToolFormat] = {f.name: f for f in FORMATS}
AUTO = "auto"


def detect(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template writes, or ``None`` (no template, or one that shows
    no tool-call syntax Stencil knows)."""
    return first_detected(FORMATS, template)


def check_name(name: str | None) -> None:
    """Accept ``None``, ``"auto"`` or a registered name.

    Raises:
        ConfigError: an unknown name, listing the known ones (one line).
    """
    check_known("tool_call_format", name, BY_NAME, (AUTO,))


def resolve(name: str | None, template: str | None) -> tuple[ToolFormat, bool]:
    """The format a server uses and whether it was chosen for a reason: the named one, or for
    ``None``/``"auto"`` the one ``template`` writes; Hermes, with ``False``, for a template that
    shows none (``check_name`` first)."""
    check_name(name)
    if name is not None and name != AUTO:
        return BY_NAME[name], True
    found = detect(template)
    return (found, True) if found is not None else (HERMES_FORMAT, False)
