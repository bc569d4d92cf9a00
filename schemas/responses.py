"""Wire types of OpenAI's Responses API (``POST /v1/responses``), the part Stencil serves.

Shapes follow OpenAI's API reference ("Responses": create, the response object, streaming
events). Stencil is stateless: nothing is stored, so ``store`` is false whatever the client
leaves out, and ``previous_response_id`` / ``conversation`` are refused. Request fields of the
reference that Stencil cannot serve are modelled and refused with a 400 naming them when set
(``stencil.service.responses_api``); unknown fields are refused. Input items may carry the output
metadata the SDK echoes back when a response's ``output`` is sent as the next ``input``
(``id``, ``status``, ``annotations``, ``logprobs``...): those are not instructions and are not
refused.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from stencil.schemas.openai import Seed

# -- requests ------------------------------------------------------------------------------------


class InputContent(Struct):
    """A content part of an input message: ``input_text`` / ``output_text`` / ``text`` (served),
    ``refusal`` (read as text); ``input_image`` / ``input_file`` / ``input_audio`` are refused."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(Struct):
    """One item of ``input``: a message (``type`` "message" or absent, with ``role`` and
    ``content``), a past ``function_call`` (``call_id``, ``name``, ``arguments``), or a
    ``function_call_output`` (``call_id``, ``output``)."""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContent] | None = None
    id: str | None = None


class FunctionTool(Struct, forbid_unknown_fields=True):
    """``{"type": "function", "name", "description", "parameters", "strict"}`` (``strict``
    omitted or false: keywords the grammar cannot enforce are relaxed and named in warnings)."""

    name: str
    type: Literal["function"] = "function"
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Struct, forbid_unknown_fields=True):
    """``tool_choice: {"type": "function", "name": ...}``."""

    name: str
    type: Literal["function"] = "function"


class TextFormat(Struct, forbid_unknown_fields=True):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "name", "schema", "strict", "description"}``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(Struct, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(Struct, forbid_unknown_fields=True):
    """``reasoning``: ``effort`` (none / minimal / low / medium / high: a cap on a reasoning
    model's reasoning tokens, ``stencil.service.reasoning``). ``summary`` / ``generate_summary``
    are OpenAI's summaries, not served (refused unless null)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponseStreamOptions(Struct, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(Struct, forbid_unknown_fields=True):
    """Body of ``POST /v1/responses``.

    Served: ``input`` (a string, or message / function_call / function_call_output items),
    ``instructions`` (a system message first), ``max_output_tokens``, ``temperature`` (default
    1, 0..2), ``top_p``, ``text.format``, function ``tools`` with ``tool_choice``,
    ``parallel_tool_calls`` and ``max_tool_calls``, ``stream``, ``top_logprobs`` with ``include:
    ["message.output_text.logprobs"]``, ``metadata`` (echoed), ``user`` / ``safety_identifier``
    / ``prompt_cache_key`` (echoed; the prefix cache needs no key). Stencil extensions: ``seed``,
    ``top_k``. ``reasoning.effort`` caps a reasoning model's thoughts (served as none, with a
    warning, on a model that does not reason). The fields after ``top_k`` are in the reference
    but refused unless absent or neutral (``stencil.service.responses_api``).
    """

    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    truncation: str | None = None
    seed: Seed | None = None
    top_k: int | None = None
    close_on_budget: bool | None = None  # Stencil extension (see stencil.schemas.openai)
    soft_limits: dict[str, int] | bool | None = None
    reasoning: ReasoningConfig | None = None
    # In the reference, not served.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    background_options: Any = None
    prompt: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None


# -- the response --------------------------------------------------------------------------------


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class OutputLogprob(Struct):
    """A chosen token of ``output_text`` with its alternatives (when asked)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class OutputText(Struct):
    text: str
    type: Literal["output_text"] = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[OutputLogprob] = msgspec.field(default_factory=list)


class OutputMessage(Struct, tag="message", tag_field="type"):
    """The assistant's text answer (one ``output_text`` part)."""

    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(Struct, tag="function_call", tag_field="type"):
    """A call the model made; ``arguments`` is its JSON text."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(Struct):
    text: str
    type: Literal["reasoning_text"] = "reasoning_text"


class ReasoningItem(Struct, tag="reasoning", tag_field="type"):
    """A reasoning model's thoughts before its answer (markers excluded), whole in ``content``
    (``summary`` is always empty: Stencil writes no summaries)."""

    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens"]


class ResponseError(Struct):
    code: str
    message: str


class Response(Struct):
    """The response object (``object: "response"``).

    ``valid`` and ``warnings`` are Stencil extensions: whether the output passed jsonschema
    against ``text.format`` (or each call's arguments against their function's parameters;
    absent for unconstrained text), and the keywords relaxed under ``strict`` omitted/false.
    """

    id: str
    created_at: float
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[FunctionTool]
    object: Literal["response"] = "response"
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    completed_at: float | None = None
    previous_response_id: None = None
    store: bool = False
    truncation: Literal["disabled"] = "disabled"
    service_tier: str = "default"
    background: bool = False
    valid: bool | UnsetType = UNSET
    closed_by_budget: bool | UnsetType = UNSET
    warnings: list[str] | UnsetType = UNSET
