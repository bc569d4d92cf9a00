"""OpenAI-compatible wire types (msgspec Structs): chat completions, completions, models, errors.

Field names and shapes follow OpenAI's API reference (platform.openai.com/docs/api-reference,
"Chat", "Completions (legacy)", "Models"). Every request field of the reference is modelled, and
nothing is accepted and ignored: a field Stencil serves is honoured; a field it cannot serve is
refused with a 400 naming it when it is set to anything but its neutral value (the handlers' tables,
``stencil.service.openai_api.UNSERVED_CHAT`` and ``stencil.service.responses_api.UNSERVED``, say
which and why); a field the reference does not have is refused as unknown
(``forbid_unknown_fields``), so a typo or another server's extension is never silently dropped.
Stencil's own extensions: ``top_k``, ``min_p``, ``repetition_penalty``,
``close_on_budget``, ``soft_limits``; answers carry ``valid`` and ``closed_by_budget`` (per choice)
and ``warnings``. From vLLM: ``chat_template_kwargs`` in, ``reasoning_content`` out (a reasoning
model's thoughts, apart from ``content``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

# OpenAI documents ``seed`` as an int64; a torch generator takes no more (a larger one failed in
# the engine's sampler, after admission).
Seed = Annotated[int, msgspec.Meta(ge=-2**63, le=2**63 - 1)]

# -- requests ------------------------------------------------------------------------------------


class FunctionName(Struct):
    name: str


class ToolChoiceFunction(Struct):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this function."""

    function: FunctionName
    type: Literal["function"] = "function"


class FunctionDefinition(Struct):
    """A callable the model may name; ``parameters`` is a JSON Schema (``None``: no arguments).

    ``strict``: ``true`` refuses parameter keywords the grammar cannot enforce exactly; omitted
    or ``false`` (OpenAI's default) relaxes them (named in ``warnings``).
    """

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionCall(Struct):
    """``arguments`` is JSON text, as OpenAI sends and expects it."""

    name: str
    arguments: str


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ContentPart(Struct):
    """One part of a multi-part message; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None


class ChatMessage(Struct, omit_defaults=True):
    """A message of the conversation sent by the client (any role).

    An assistant message sent back as history may carry what the API returned with it
    (``refusal``, ``annotations``, ``audio``, ``function_call``, ...): output metadata, not
    instructions, so unknown fields of a message are not refused.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class JsonSchemaFormat(Struct):
    """``response_format.json_schema``: ``{name, schema, strict, description}``."""

    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Struct, forbid_unknown_fields=True):
    """Stencil (and vLLM) extension: a constraint other than a response format. Exactly one of
    ``json`` (a JSON Schema, failed closed), ``regex``, ``choice`` or ``grammar`` (Lark,
    llguidance's dialect; a bad grammar is a 400 naming line and column)."""

    json: dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StreamOptions(Struct, forbid_unknown_fields=True):
    """``include_usage``: a last chunk with the totals. ``include_obfuscation`` pads events
    against size side channels; Stencil sends none (true is refused)."""

    include_usage: bool = False
    include_obfuscation: bool | None = None


class ChatCompletionRequest(Struct, forbid_unknown_fields=True):
    """Body of ``POST /v1/chat/completions``.

    ``max_completion_tokens`` (current name) wins over ``max_tokens`` (deprecated name) when both
    are given. ``temperature`` defaults to 1.0 and takes 0..2, as in OpenAI's API. ``logit_bias``
    maps token ids (as strings) to -100..100. The fields after ``user`` are in the reference but not served
    (see ``stencil.service.openai_api.UNSERVED_CHAT``).
    """

    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    # Stencil extensions (as in vLLM): the k most likely tokens only (0 = all); tokens at least
    # min_p times as likely as the most likely (0 = all); CTRL's penalty.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # Stencil extension: close a constrained answer within max tokens (False: cut it there, as
    # OpenAI does), and the run-on guard's bounds (stencil.grammar.budget.SoftLimits; False: off).
    close_on_budget: bool | None = None
    soft_limits: dict[str, int] | bool | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: extra keywords for the chat template ({"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    # none / minimal / low / medium / high: a cap on reasoning tokens (stencil.service.reasoning).
    reasoning_effort: str | None = None
    # In the reference, not served: refused unless absent/null (or their neutral value).
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: str | None = None
    web_search_options: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None


class CompletionRequest(Struct, forbid_unknown_fields=True):
    """Body of ``POST /v1/completions`` (OpenAI's legacy text completion).

    ``prompt`` is one string, a list of strings (one choice group each), a list of token ids or
    a list of such lists. ``logprobs`` is the number of alternatives per position (0..5, as
    OpenAI). ``response_format`` is a Stencil extension with the chat endpoint's meaning.
    Text that spells a control token is plain text unless ``parse_special_tokens`` (Stencil
    extension, default false); token ids are taken as given.
    """

    prompt: str | list[str | int | list[int]]  # checked further by the handler (one shape at a time)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # Stencil extension: close a constrained answer within max tokens (False: cut it there, as
    # OpenAI does), and the run-on guard's bounds (stencil.grammar.budget.SoftLimits; False: off).
    close_on_budget: bool | None = None
    soft_limits: dict[str, int] | bool | None = None
    structured_outputs: StructuredOutputs | None = None
    parse_special_tokens: bool | None = None


# -- responses -----------------------------------------------------------------------------------


class CompletionTokensDetails(Struct):
    """``reasoning_tokens``: of ``completion_tokens``, those of the reasoning (markers included)."""

    reasoning_tokens: int = 0


class Usage(Struct):
    """Token counts; ``completion_tokens_details`` comes with a reasoning model's chat answers."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


class TopLogprob(Struct):
    """An alternative at one position: its text, natural-log probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    """One chosen token: its text, natural-log probability, UTF-8 bytes, and the
    ``top_logprobs`` most likely tokens at its position (best first; fewer where the grammar
    allowed fewer; empty unless asked)."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(Struct):
    """The answer. ``reasoning_content`` (vLLM's and DeepSeek's field; a reasoning model's
    only): its reasoning, markers excluded; ``content`` and ``tool_calls`` hold the answer alone."""

    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET
    refusal: str | None = None
    reasoning_content: str | None | UnsetType = UNSET


class ChatChoice(Struct):
    """One choice. ``valid`` (Stencil extension, absent for unconstrained text): the answer was
    checked with jsonschema against the response format (or each call's arguments against their
    function's parameters) and passed, whatever stopped it; false when cut short before the text
    was complete, or relaxed keywords were broken. ``truncated_value`` (Stencil extension, absent
    unless true): valid, but ended at ``length`` where the constraint allowed more."""

    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    valid: bool | UnsetType = UNSET
    closed_by_budget: bool | UnsetType = UNSET
    truncated_value: bool | UnsetType = UNSET


class ChatCompletion(Struct):
    """A chat completion. ``warnings`` (Stencil extension, absent when empty): schema keywords
    relaxed under ``strict`` omitted/false (also in the ``X-Stencil-Warnings`` header), and why
    a choice is not ``valid``."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    service_tier: str | None = None
    warnings: list[str] | UnsetType = UNSET


class FunctionCallDelta(Struct, omit_defaults=True):
    """Part of a streamed call: the name in its first delta, then ``arguments`` fragments."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """A streamed tool call: the first delta has ``id``, ``type`` and ``function.name`` (and
    ``arguments: ""``), the next ones ``function.arguments`` fragments as they are written."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChoiceDelta(Struct, omit_defaults=True):
    """A streamed piece: ``reasoning_content`` deltas (a reasoning model's) come before the
    answer's ``content``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChunkChoice(Struct):
    """``valid`` / ``warnings`` / ``closed_by_budget`` (Stencil extensions) come with a constrained
    choice's last chunk, as on the whole answer's choice."""

    index: int
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    valid: bool | UnsetType = UNSET
    warnings: list[str] | UnsetType = UNSET
    closed_by_budget: bool | UnsetType = UNSET


class ChatCompletionChunk(Struct):
    """One SSE event of a streamed chat completion.

    ``usage`` is ``UNSET`` (absent) unless the client asked ``stream_options.include_usage``;
    then it is null on every chunk but the last, which has no choices and the totals.
    """

    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | None | UnsetType = UNSET


class CompletionLogprobs(Struct):
    """Legacy logprobs: per token its text, log-probability and character offset in the text."""

    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int]
    top_logprobs: list[dict[str, float]] | None = None


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    valid: bool | UnsetType = UNSET
    closed_by_budget: bool | UnsetType = UNSET
    truncated_value: bool | UnsetType = UNSET


class Completion(Struct):
    """A completion (``object: "text_completion"``), whole or as one streamed chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | None | UnsetType = UNSET
    warnings: list[str] | UnsetType = UNSET


class ChatFormat(Struct):
    """How the served model's chat template writes what the service reads back (Stencil
    extension): ``reasoning``, the reasoning format (``qwen3``, ``deepseek_r1``, ...;
    ``stencil.service.reasoning_formats``) or null when the model does not reason;
    ``tool_calls``, the syntax the model writes tool calls in (``hermes``, ``mistral``, ...;
    ``stencil.service.tool_formats``; the answers carry OpenAI's ``tool_calls`` whatever it is)."""

    reasoning: str | None = None
    tool_calls: str = "hermes"


class Model(Struct):
    id: str
    created: int
    owned_by: str = "stencil"
    object: Literal["model"] = "model"
    # null for a model without a chat template (a base model): the chat routes refuse it
    chat_format: ChatFormat | None = msgspec.field(default_factory=ChatFormat)


class ModelList(Struct):
    data: list[Model]
    object: Literal["list"] = "list"


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody
