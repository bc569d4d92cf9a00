"""How a model family marks its reasoning: a registry of formats, and which one a chat template uses.

A reasoning model writes its thoughts between two markers, then the answer: Qwen3 writes
``<think>\\n...\\n</think>\\n\\n{answer}``. Each ``ReasoningFormat`` says what its family's
markers are, what its template writes after the end marker, and which template keyword turns
thinking off. ``detect`` picks the format a chat template uses by reading its text (the
markers it writes into past assistant turns); the service (``stencil.service.reasoning``) then
renders each request's prompt and looks at its end to see whether the region is already open
(DeepSeek-R1's prompt ends ``<think>\\n``), closed (Qwen3 with ``enable_thinking: false`` ends
``<think>\\n\\n</think>\\n\\n``), or left to the answer.

The entries were read from the families' real templates (``tests/real_templates.py``: Qwen3,
QwQ, Qwen3.5, DeepSeek-R1 distills, SmolLM3, Ministral 3 Reasoning, gpt-oss). Adding a family is
one entry; an entry's detector must not match another family's template (the tests check every
real template).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stencil.service.chat_formats import check_known, first_detected, has


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One family's reasoning markers.

    Attributes:
        name: the format's name (``--reasoning-format``, ``/v1/models``' ``chat_format.reasoning``).
        start: the marker that opens the region (``"<think>"``).
        end: the marker that closes it (``"</think>"``); the reasoning never contains it.
        opening: what the model writes right after ``start`` (``"\\n"``); forced with it when the
            prompt leaves the region to the model.
        separator: what the template writes between ``end`` and the answer (``"\\n\\n"``);
            forced after the end marker.
        tool_separator: the separator when the answer may be tool calls, where they need another
            (gpt-oss: a new ``<|start|>assistant`` message whose channel, ``final`` or
            ``commentary to=functions.f``, the tool grammar writes); ``None``: ``separator``.
        switch: the template keyword that turns thinking on and off (``enable_thinking``), or
            ``None`` where the template has none (thinking off is then an empty region).
        effort_kwarg: the template keyword that takes ``reasoning_effort`` itself (gpt-oss:
            ``reasoning_effort``), or ``None``.
        detect: whether a chat template's text is this family's.
        families: the models it was read from, for the docs and the logs.
    """

    name: str
    start: str
    end: str
    detect: Callable[[str], bool]
    opening: str = ""
    separator: str = ""
    tool_separator: str | None = None
    switch: str | None = None
    effort_kwarg: str | None = None
    families: str = ""


# Most specific first: ``detect`` returns the first entry that matches.
FORMATS: tuple[ReasoningFormat, ...] = (
    ReasoningFormat("gpt_oss", start="<|channel|>analysis<|message|>", end="<|end|>",
                    separator="<|start|>assistant<|channel|>final<|message|>", tool_separator="<|start|>assistant",
                    effort_kwarg="reasoning_effort",
                    detect=has("<|channel|>analysis<|message|>", "<|channel|>final<|message|>"),
                    families="gpt-oss (harmony's analysis channel)"),
    ReasoningFormat("deepseek_r1", start="<think>", end="</think>", opening="\n", separator="\n\n",
                    switch="enable_thinking", detect=has("<｜Assistant｜>", "</think>"),
                    families="DeepSeek-R1 and its distills (the prompt opens the region)"),
    ReasoningFormat("smollm3", start="<think>", end="</think>", opening="\n", separator="\n",
                    switch="enable_thinking", detect=has("<think>", "</think>", "/no_think"),
                    families="SmolLM3"),
    ReasoningFormat("qwen3", start="<think>", end="</think>", opening="\n", separator="\n\n",
                    switch="enable_thinking", detect=has("<|im_start|>", "<think>", "</think>"),
                    families="Qwen3, Qwen3.5, QwQ"),
    ReasoningFormat("mistral", start="[THINK]", end="[/THINK]", detect=has("[THINK]", "[/THINK]"),
                    families="Ministral 3 Reasoning, Magistral"),
)

BY_NAME: dict[str, ReasoningFormat] = {f.name: f for f in FORMATS}
AUTO, NONE = "auto", "none"


def detect(template: str | None) -> ReasoningFormat | None:
    """The reasoning format a chat template writes, or ``None`` (no template, or one that does
    not reason: Llama 3, Mistral Nemo, Granite 4, SmolLM2)."""
    return first_detected(FORMATS, template)


def check_name(name: str | None) -> None:
    """Accept ``None``, ``"auto"``, ``"none"`` or a registered name.

    Raises:
        ConfigError: an unknown name, listing the known ones (one line).
    """
    check_known("reasoning_format", name, BY_NAME, (AUTO, NONE))


def resolve(name: str | None, template: str | None) -> ReasoningFormat | None:
    """The format a server uses: detected from ``template`` for ``None``/``"auto"``, none for
    ``"none"``, else the named one (``check_name`` first)."""
    check_name(name)
    if name is None or name == AUTO:
        return detect(template)
    return None if name == NONE else BY_NAME[name]
