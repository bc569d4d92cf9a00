"""OpenAI-compatible wire types (msgspec Structs): chat completions, completions, models, errors.

Field names and shapes follow OpenAI's API reference (platform.openai.com/docs/api-reference,
"Chat", "Completions (legacy)", "Models"). Unknown request fields are ignored, as OpenAI's own
SDKs send fields we do not model; fields we model but cannot honour are refused by the handlers
(``service/openai_api.py``) rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

# -- requests ------------------------------------------------------------------------------------


class FunctionName(Struct):
    name: str


class ToolChoiceFunction(Struct):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this function."""

    function: FunctionName
    type: Literal["function"] = "function"


class FunctionDefinition(Struct):
    """A callable the model may name; ``parameters`` is a JSON Schema (``None``: no arguments)."""

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
    """A message of the conversation sent by the client (any role)."""

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


class StreamOptions(Struct):
    include_usage: bool = False


class ChatCompletionRequest(Struct):
    """Body of ``POST /v1/chat/completions``.

    ``max_completion_tokens`` (current name) wins over ``max_tokens`` (deprecated name) when both
    are given. ``temperature`` defaults to 1.0 as in OpenAI's API.
    """

    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # Stencil extension, as in vLLM: sample only among the k most likely tokens (0 = all).
    top_k: int | None = None


class CompletionRequest(Struct):
    """Body of ``POST /v1/completions`` (OpenAI's legacy text completion).

    ``prompt`` is one string or a list of strings (one choice group each). ``logprobs`` is the
    number of alternatives per position (only 0 is served). ``response_format`` is a Stencil
    extension with the chat endpoint's meaning.
    """

    prompt: str | list[str]
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    top_k: int | None = None


# -- responses -----------------------------------------------------------------------------------


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenLogprob(Struct):
    """One chosen token: its text, natural-log probability and UTF-8 bytes.

    ``top_logprobs`` is always empty: the engine reports the chosen token only.
    """

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[Any] = msgspec.field(default_factory=list)


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET
    refusal: str | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """A streamed tool call; Stencil sends each call whole, in one delta."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class ChoiceDelta(Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Struct):
    index: int
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


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


class Completion(Struct):
    """A completion (``object: "text_completion"``), whole or as one streamed chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | None | UnsetType = UNSET


class Model(Struct):
    id: str
    created: int
    owned_by: str = "stencil"
    object: Literal["model"] = "model"


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
