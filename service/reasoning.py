"""A chat request's reasoning: the template keywords it renders with, then its ``ReasoningParams``.

Two steps around the prompt's render (``stencil.service.openai_serving.chat_prompt``, ``POST
/generate`` with messages):

1. ``plan(service, effort, kwargs)``: before the render. Checks ``reasoning_effort`` and turns
   it into a cap on reasoning tokens and the template keywords (``enable_thinking: false`` for
   ``none`` where the format has that switch; gpt-oss's own ``reasoning_effort``). The
   request's ``chat_template_kwargs`` win over what the plan would set.
2. ``ReasoningPlan.params(tokenizer, prompt_ids)``: after it. The rendered prompt's end says
   what the model does next: a prompt that ends with the end marker closed the region (thinking
   off: no reasoning); one that ends with the start marker opened it (the model thinks at once:
   nothing forced before); else the engine forces the start marker and its opening.

``reasoning_effort`` → most reasoning tokens (``EFFORT_TOKENS``): ``minimal`` 256, ``low`` 1,024,
``medium`` 4,096, ``high`` no cap of its own; ``none`` turns thinking off (the template's switch,
else an empty region). The server's ``reasoning_budget`` bounds every request further, and
``max_tokens`` bounds reasoning and answer together: the engine ends the reasoning early enough
for the answer to close (``stencil.engine.request.ReasoningParams``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stencil.engine.request import ReasoningParams
from stencil.service.errors import InputError
from stencil.service.reasoning_formats import ReasoningFormat
from stencil.service.state import ServiceState

EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's reasoning_effort values
EFFORT_TOKENS: dict[str, int | None] = {"minimal": 256, "low": 1024, "medium": 4096, "high": None}
_TAIL_TOKENS = 16  # prompt tokens decoded to read its end (the generation prompt's markers)


@dataclass(slots=True)
class ReasoningPlan:
    """What a chat request does about reasoning.

    Attributes:
        format: the served model's reasoning format, or ``None`` (it does not reason).
        kwargs: the chat template's extra keywords (the request's ``chat_template_kwargs`` and
            the ones the effort sets), or ``None``.
        cap: most reasoning tokens (``None``: only ``max_tokens`` bounds it; 0: an empty region).
        warnings: for the answer's ``warnings`` (an effort the model cannot take).
    """

    format: ReasoningFormat | None
    kwargs: dict[str, Any] | None = None
    cap: int | None = None
    warnings: list[str] = field(default_factory=list)

    def params(self, tokenizer, prompt_ids: list[int], tools: bool = False) -> ReasoningParams | None:
        """The engine's ``ReasoningParams`` for a prompt rendered with ``kwargs``, or ``None``
        (no format, or the prompt closed the region: thinking is off); ``tools``: the answer may
        be tool calls (the format's ``tool_separator`` then follows the end marker)."""
        fmt = self.format
        if fmt is None:
            return None
        tail = tokenizer.decode(prompt_ids[-_TAIL_TOKENS:], skip_special_tokens=False).rstrip()
        if tail.endswith(fmt.end):
            return None
        opened = tail.endswith(fmt.start)

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

        return ReasoningParams(end_text=fmt.end, end_ids=ids(fmt.end),
                               start_ids=() if opened else ids(fmt.start + fmt.opening),
                               after_ids=ids(fmt.tool_separator if tools and fmt.tool_separator is not None
                                             else fmt.separator),
                               max_reasoning_tokens=self.cap)


def _bound(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def plan(service: ServiceState, effort: str | None, kwargs: dict[str, Any] | None,
         effort_field: str = "reasoning_effort") -> ReasoningPlan:
    """A chat request's reasoning plan, before its prompt is rendered (see the module docstring).

    Args:
        service: the app's state (``reasoning``: the served format; the server's budget).
        effort: OpenAI's ``reasoning_effort`` (``None``: the template's default, no cap).
        kwargs: the request's ``chat_template_kwargs`` (checked at the render:
            ``stencil.service.prompts.render_messages``).
        effort_field: the request's name of the effort, for errors and warnings.

    Raises:
        InputError: an effort OpenAI does not name (field ``effort_field``).
    """
    if effort is not None and effort not in EFFORTS:
        raise InputError(f"{effort_field} must be one of {', '.join(EFFORTS)}, got {effort!r}", field=effort_field)
    fmt = service.reasoning
    kwargs = dict(kwargs) if kwargs else {}
    if fmt is None:
        warnings = [] if effort in (None, "none") else [
            f"{effort_field} {effort!r} was served as 'none': the served model does not reason (its chat template "
            "writes no reasoning; --reasoning-format names one)"]
        return ReasoningPlan(None, kwargs or None, None, warnings)
    template = getattr(service.engine.tokenizer, "chat_template", None) or ""
    cap = _bound(EFFORT_TOKENS.get(effort) if effort is not None else None, service.config.reasoning_budget)
    if fmt.switch is not None and fmt.switch in template:
        if effort is not None:
            kwargs.setdefault(fmt.switch, effort != "none")
        else:  # a template may default to off (DeepSeek's with the keyword): on unless the request says
            kwargs.setdefault(fmt.switch, True)
    elif effort == "none":
        cap = 0  # no switch: an empty region, the answer at once
    if fmt.effort_kwarg is not None and effort is not None and fmt.effort_kwarg in template:
        kwargs.setdefault(fmt.effort_kwarg, "low" if effort in ("none", "minimal") else effort)
    return ReasoningPlan(fmt, kwargs or None, cap)
