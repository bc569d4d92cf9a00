"""OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``
(the Responses API is ``stencil.service.responses_api``; both are mounted on one ``/v1`` router here).

They translate OpenAI's wire types (``schemas/openai.py``) to the shared generation core
(``service/generation.py``) and back, so limits, grammar, validation and metrics are those of
``POST /generate``. Every error under ``/v1``, an unknown route included, uses OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.

``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object), ``json_schema``
(``{name, schema, strict}``). As in OpenAI's API, ``strict`` omitted or false means: enforce
everything the grammar can enforce exactly, relax only the keywords it cannot (named in the
answer's ``warnings`` and the ``X-Stencil-Warnings`` header), then check the answer with
jsonschema and say so in each choice's ``valid``; ``strict: true`` refuses such keywords with a
400 (``POST /generate`` keeps that fail-closed default). Tools: see ``service/tools.py``;
streamed calls arrive as OpenAI's deltas, the name first, then the arguments as they are
written. ``n`` choices are independent requests with seeds ``seed, seed+1, ...``. Streams are
server-sent events ending ``data: [DONE]``. ``temperature`` defaults to 1 here and takes
OpenAI's 0..2 (``POST /generate`` defaults to greedy and takes up to 1e6). Errors name the
fields as the request sent them (``max_completion_tokens``, ``messages``; ``errors.named_as``).
``logit_bias``, ``presence_penalty``, ``frequency_penalty`` and the ``repetition_penalty``
extension are applied with the grammar mask
(``stencil.engine.logits_process``); logprobs are those of the distribution tokens are drawn from
(masked, penalized, biased, temperature 1). Legacy ``logprobs`` with ``echo`` cover the
generated tokens only. A reasoning model's thoughts come apart from the answer, in
``reasoning_content`` (``stencil.service.reasoning``: ``reasoning_effort`` and
``chat_template_kwargs``); ``content``, tool calls and ``valid`` are the answer's.

``stencil.service.app`` mounts ``openai_route_handlers`` (with ``stencil.service.responses_api``'s) under ``/v1``
and injects their dependency ``service: ServiceState``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, get, post
from litestar.openapi import ResponseSpec
from litestar.openapi.spec import Link, Operation

from stencil.schemas.openai import (
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatFormat, ChatMessage,
    ChoiceDelta, ChoiceLogprobs, ChunkChoice, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionTokensDetails, ErrorResponse, FunctionCall, FunctionCallDelta, Model, ModelList, ResponseFormat,
    StructuredOutputs, ToolCall, ToolCallDelta, ToolChoiceFunction, Usage,
)
from stencil.service import generation as gen
from stencil.service import inputs, reasoning
from stencil.service.errors import InputError, named_as
from stencil.service.openai_common import (
    GENERATION_ERRORS, Constraint, check_model, constraint, error_fields, grammar_field, logit_bias_ids, merged,
    refuse_unserved, sse, token_bytes, token_logprobs, token_text, verdict, vocab_size,
)
from stencil.service.openai_serving import OpenAIJob, chat_prompt, sampling_params, serve
from stencil.service.openapi_docs import StreamableOperation, error_responses, with_links
from stencil.service.state import ServiceState
from stencil.service.tool_parser import ToolCallParser, ToolEvent
from stencil.service.tools import ToolPlan, new_call_id
from stencil.service.wire import strict_body

log = logging.getLogger("stencil.openai")

MAX_N = 16  # choices per request; each is a full request in the engine
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint
MAX_LEGACY_LOGPROBS = 5  # OpenAI's limit for the legacy endpoint

_LIST_ERRORS = error_responses(ErrorResponse, "application/json", (401, 503))
_LOOKUP_ERRORS = error_responses(ErrorResponse, "application/json", (400, 401, 404, 503))

# Chat fields of OpenAI's reference that Stencil does not serve: (neutral values, why).
UNSERVED_CHAT: dict[str, tuple[tuple, str]] = {
    "audio": ((), "Stencil generates text only"),
    "modalities": ((["text"],), "Stencil generates text only"),
    "prediction": ((), "predicted outputs are not served (Stencil drafts from the prompt by itself)"),
    "functions": ((), "the deprecated functions API is not served; use tools"),
    "function_call": ((), "the deprecated functions API is not served; use tool_choice"),
    "verbosity": ((), "the served model has no verbosity control"),
    "web_search_options": ((), "Stencil has no web search"),
    "moderation": ((), "Stencil runs no moderation"),
    "prompt_cache_options": ((), "the prefix cache is automatic and takes no options"),
    "prompt_cache_retention": ((), "the prefix cache is automatic and takes no options"),
    "store": ((False,), "Stencil is stateless and stores nothing"),
    "service_tier": (("auto", "default"), "Stencil has one service tier"),
}


def format_schema(fmt: ResponseFormat | None) -> tuple[Any, bool]:
    """(JSON Schema or None, strict) of a ``response_format`` (``strict`` only when true)."""
    if fmt is None or fmt.type == "text":
        return None, True
    if fmt.type == "json_object":
        return {"type": "object"}, True
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise InputError("response_format of type 'json_schema' needs json_schema.schema", field="response_format")
    return fmt.json_schema.schema, fmt.json_schema.strict is True


def check_contents(messages: list[ChatMessage]) -> None:
    """Every message has ``content``, except an assistant message with ``tool_calls``, and every
    ``tool`` message its ``tool_call_id`` (OpenAI's rules).

    Raises:
        InputError: naming ``messages[i].content`` or ``messages[i].tool_call_id`` of the first
            message without it.
    """
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise InputError(f"messages[{i}].content is required (only an assistant message with tool_calls "
                             "may omit it)", field=f"messages[{i}].content")
        if m.role == "tool" and not m.tool_call_id:
            raise InputError(f"messages[{i}].tool_call_id is required: a tool message answers the assistant's "
                             "call with that id", field=f"messages[{i}].tool_call_id")


def chat_names(data: ChatCompletionRequest) -> dict[str, str]:
    """The chat request's names of the generation core's fields, for its errors (``named_as``)."""
    return {"prompt": "messages", "response_schema": "response_format",
            "max_tokens": "max_completion_tokens" if data.max_completion_tokens is not None else "max_tokens"}


def _check_common(n: int, stream: bool, stream_options: Any) -> None:
    if not 1 <= n <= MAX_N:
        raise InputError(f"n must be between 1 and {MAX_N}, got {n}", field="n")
    if stream_options is not None and not stream:
        raise InputError("stream_options is only allowed with stream: true", field="stream_options")
    if stream_options is not None and stream_options.include_obfuscation:
        raise InputError("stream_options.include_obfuscation is not supported: Stencil pads no events",
                         field="stream_options")


def _seeds(seed: int | None, n: int) -> list[int | None]:
    return [None if seed is None else seed + i for i in range(n)]


def _usage(results: list[gen.GenerationResult], prompt_counts: list[int], reasons: bool = False) -> Usage:
    """Totals; ``prompt_counts`` has one entry per distinct prompt (``n`` choices of one prompt
    count it once, as OpenAI does); ``reasons``: with ``completion_tokens_details``."""
    prompt = sum(prompt_counts)
    completion = sum(r.usage.completion_tokens for r in results)
    details = CompletionTokensDetails(sum(r.usage.reasoning_tokens for r in results)) if reasons else msgspec.UNSET
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 completion_tokens_details=details)


def chat_logprobs(service: ServiceState, token_ids: list[int], logprobs: list[float] | None,
                  tops: list[list[tuple[int, float]]] | None = None) -> ChoiceLogprobs | None:
    """OpenAI chat logprobs of the chosen tokens (with ``top_logprobs`` when asked)."""
    items = token_logprobs(service, token_ids, logprobs, tops)
    return None if items is None else ChoiceLogprobs(content=items)


def completion_logprobs(service: ServiceState, token_ids: list[int], logprobs: list[float] | None, offset: int,
                        tops: list[list[tuple[int, float]]] | None = None) -> CompletionLogprobs | None:
    """Legacy logprobs; ``text_offset`` counts characters from ``offset`` (the echoed prompt);
    ``top_logprobs`` maps each alternative's text to its logprob."""
    if logprobs is None:
        return None
    tokens, offsets, pos, pending = [], [], offset, b""
    for t in token_ids:
        raw = token_bytes(service, t)
        tokens.append(token_text(raw))
        offsets.append(pos)
        pending += raw
        try:  # characters are only counted once their last byte arrives
            pos += len(pending.decode())
            pending = b""
        except UnicodeDecodeError:
            pass
    top = None
    if tops is not None:
        top = [{token_text(token_bytes(service, a)): lp for a, lp in row} for row in tops]
    return CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), text_offset=offsets, top_logprobs=top)


# -- chat ----------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class _ChatJob(OpenAIJob):
    """A checked chat request: one run per choice, all of one prompt."""

    prompt_ids: list[int]
    include_usage: bool
    service_tier: str | None
    reasons: bool = False  # the runs have a reasoning region (reasoning_content is sent)

    @property
    def plan(self) -> ToolPlan:
        return self.constraint.plan


def _format_field(so: StructuredOutputs | None) -> str:
    """Where the request holds its constraint, for the errors of compiling it: the key of
    ``structured_outputs`` given (``structured_outputs.regex``), else ``response_format``."""
    if so is None:
        return "response_format"
    given = [k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None]
    return f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"


async def _structured_outputs(service: ServiceState, so, response_format, plan) -> Constraint:
    """The constraint of ``structured_outputs`` (json, regex, choice or Lark grammar).

    Raises:
        InputError: together with a response format or tools, or not exactly one key given.
    """
    if response_format is not None and response_format.type != "text":
        raise InputError("give either response_format or structured_outputs, not both", field="structured_outputs")
    if plan is not None and plan.active:
        raise InputError("structured_outputs cannot be combined with tools", field="structured_outputs")
    given = [k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None]
    if len(given) != 1:
        raise InputError("structured_outputs takes exactly one of json, regex, choice and grammar",
                         field="structured_outputs")
    names = {"response_schema": "structured_outputs.json", "regex": "structured_outputs.regex",
             "choice": "structured_outputs.choice", "grammar": "structured_outputs.grammar"}
    with grammar_field(_format_field(so)), named_as(names):
        spec = await inputs.checked_grammar_spec(service, response_schema=so.json, regex=so.regex, choice=so.choice,
                                              grammar=so.grammar)
    return Constraint(spec, so.json, plan if plan is not None else ToolPlan("none", (), False))


def _tool_calls(calls) -> list[ToolCall]:
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def _chat_choice(service: ServiceState, job: _ChatJob, index: int, r: gen.GenerationResult,
                 relaxed_warnings: list[str]) -> tuple[ChatChoice, list[str]]:
    v = verdict(service, job.constraint, r, relaxed_warnings)
    msg = AssistantMessage(content=v.text)
    if job.reasons:
        msg.reasoning_content = r.reasoning
    if v.calls:
        msg.tool_calls = _tool_calls(v.calls)
    choice = ChatChoice(index=index, message=msg, finish_reason=v.finish_reason,
                        logprobs=chat_logprobs(service, r.token_ids, r.logprobs, r.top_logprobs),
                        valid=msgspec.UNSET if v.valid is None else v.valid,
                        closed_by_budget=True if r.closed_by_budget else msgspec.UNSET,
                        truncated_value=True if v.valid and r.truncated_value else msgspec.UNSET)
    return choice, v.problems


@dataclass(slots=True)
class _Pending:
    """Logprobs of tokens whose text has not been sent yet (held back by the tool parser)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    asked: bool = False

    def add(self, d: gen.GenerationDelta) -> None:
        self.ids += d.token_ids
        if d.logprobs is not None:
            self.asked = True
            self.logprobs += d.logprobs
        self.tops += d.top_logprobs or []

    def take(self, service: ServiceState) -> ChoiceLogprobs | None:
        if not self.asked or not self.ids:
            return None
        out = chat_logprobs(service, self.ids, self.logprobs, self.tops)
        self.ids, self.logprobs, self.tops = [], [], []
        return out


def _event_delta(ev: ToolEvent, ids: dict[int, str]) -> ChoiceDelta | None:
    if ev.kind == "text":
        return ChoiceDelta(content=ev.text) if ev.text else None
    if ev.kind == "start":
        ids[ev.index] = new_call_id()
        return ChoiceDelta(tool_calls=[ToolCallDelta(index=ev.index, id=ids[ev.index], type="function",
                                                     function=FunctionCallDelta(name=ev.name, arguments=""))])
    if ev.kind == "arguments":
        return ChoiceDelta(tool_calls=[ToolCallDelta(index=ev.index, function=FunctionCallDelta(arguments=ev.text))])
    return None


async def _chat_events(service: ServiceState, job: _ChatJob, streams: list[gen.GenerationStream], rid: str,
                       include_usage: bool, relaxed_warnings: list[str]) -> AsyncIterator[bytes]:
    created = int(time.time())
    usage_field: Any = None if include_usage else msgspec.UNSET

    def chunk(index: int, delta: ChoiceDelta, finish: str | None = None, logprobs=None, **extra) -> bytes:
        return sse(ChatCompletionChunk(id=rid, created=created, model=job.model, usage=usage_field,
                                       choices=[ChunkChoice(index, delta, finish, logprobs, **extra)]))

    # Under tools, text is held back while it could still be the start of a call; calls stream
    # as the parser reads them: the name, then the arguments as they are written.
    plan = job.plan
    parsers = [ToolCallParser(plan.mode == "auto", plan.syntax) if plan.active else None for _ in streams]
    call_ids: list[dict[int, str]] = [{} for _ in streams]
    pending = [_Pending() for _ in streams]
    results: list[gen.GenerationResult | None] = [None] * len(streams)
    for i in range(len(streams)):
        yield chunk(i, ChoiceDelta(role="assistant", content=""))
    try:
        async for i, item in merged(streams):
            p = parsers[i]
            if isinstance(item, gen.GenerationDelta):
                pending[i].add(item)
                if item.reasoning:  # before the answer; its tokens' logprobs go with the answer's first
                    yield chunk(i, ChoiceDelta(reasoning_content=item.reasoning))
                if p is None:
                    if item.text or (item.token_ids and not item.reasoning):
                        yield chunk(i, ChoiceDelta(content=item.text), logprobs=pending[i].take(service))
                    continue
                for ev in p.feed(item.text):
                    delta = _event_delta(ev, call_ids[i])
                    if delta is not None:
                        yield chunk(i, delta, logprobs=pending[i].take(service))
                continue
            results[i] = item
            for ev in (p.finish() if p is not None else []):
                delta = _event_delta(ev, call_ids[i])
                if delta is not None:
                    yield chunk(i, delta, logprobs=pending[i].take(service))
            v = verdict(service, job.constraint, item, relaxed_warnings)
            extra: dict[str, Any] = {}
            if v.valid is not None:
                extra["valid"] = v.valid
            if v.problems:
                extra["warnings"] = v.problems
            if item.closed_by_budget:
                extra["closed_by_budget"] = True
            yield chunk(i, ChoiceDelta(), v.finish_reason, logprobs=pending[i].take(service), **extra)
        if include_usage:
            done = [r for r in results if r is not None]
            yield sse(ChatCompletionChunk(id=rid, created=created, model=job.model, choices=[],
                                          usage=_usage(done, [len(job.prompt_ids)], job.reasons)))
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI does
        yield sse({"error": msgspec.to_builtins(error_fields(e))})
    yield b"data: [DONE]\n\n"


@post("/chat/completions", status_code=200, summary="OpenAI-compatible chat completion",
      responses={200: ResponseSpec(ChatCompletion, description="the completion, or its chunks as server-sent "
                                   "events with `\"stream\": true`"), **GENERATION_ERRORS},
      operation_class=StreamableOperation, guards=[strict_body(ChatCompletionRequest)],
      operation_id="createChatCompletion")
async def chat_completions(data: ChatCompletionRequest, service: ServiceState, request: Request) -> Any:
    """Create a chat completion (OpenAI ``POST /v1/chat/completions``), whole or streamed.

    Raises (answered in OpenAI's error shape, ``param`` naming the field as sent): the errors of
    ``stencil.service.generation`` and ``stencil.service.tools``; ``InputError`` for a message without content.
    """
    return await serve(CHAT_COMPLETIONS, data, service, request)


class ChatCompletions:
    """``POST /v1/chat/completions`` as an ``openai_serving.Endpoint``: ``n`` runs of one
    chat-templated prompt, tool calls parsed from the text."""

    def names(self, data: ChatCompletionRequest) -> dict[str, str]:
        return chat_names(data)

    async def prepare(self, service: ServiceState, data: ChatCompletionRequest) -> _ChatJob:
        model = check_model(service, data.model)
        refuse_unserved(data, UNSERVED_CHAT)
        check_contents(data.messages)
        n = 1 if data.n is None else data.n
        _check_common(n, bool(data.stream), data.stream_options)
        if data.top_logprobs and not data.logprobs:
            raise InputError("top_logprobs needs logprobs: true", field="top_logprobs")
        if data.max_tokens is not None and data.max_completion_tokens not in (None, data.max_tokens):
            # (one is the other's older name: two different limits would leave one ignored)
            raise InputError(f"max_tokens ({data.max_tokens}) and max_completion_tokens "
                             f"({data.max_completion_tokens}) differ: give one (max_tokens is the older name "
                             "of max_completion_tokens)", field="max_completion_tokens")
        named = data.tool_choice.function.name if isinstance(data.tool_choice, ToolChoiceFunction) else None
        choice = None if isinstance(data.tool_choice, ToolChoiceFunction) else data.tool_choice
        thinking = reasoning.plan(service, data.reasoning_effort, data.chat_template_kwargs)
        plan, prompt_ids = await chat_prompt(service, data.messages, [t.function for t in data.tools or []], choice,
                                             named, data.parallel_tool_calls, template_kwargs=thinking.kwargs)
        region = thinking.params(service.engine.tokenizer, prompt_ids, tools=plan.active)
        c = await _structured_outputs(service, data.structured_outputs, data.response_format, plan) \
            if data.structured_outputs is not None else await constraint(service, *format_schema(data.response_format), plan)
        max_tokens = data.max_completion_tokens if data.max_completion_tokens is not None else data.max_tokens
        bias = logit_bias_ids(data.logit_bias, vocab_size(service))
        params = [sampling_params(service, data, max_tokens=max_tokens, seed=s, logprobs=bool(data.logprobs),
                                  top_logprobs=data.top_logprobs or 0 if data.logprobs else 0, logit_bias=bias,
                                  reasoning=region)
                  for s in _seeds(data.seed, n)]
        return _ChatJob(rid=f"chatcmpl-{uuid.uuid4().hex}", model=model, constraint=c,
                        format_field=_format_field(data.structured_outputs),
                        runs=[(prompt_ids, p) for p in params], prompt_ids=prompt_ids,
                        include_usage=bool(data.stream_options and data.stream_options.include_usage),
                        service_tier=data.service_tier, reasons=region is not None, notes=thinking.warnings)

    def events(self, service: ServiceState, job: _ChatJob, streams: list[gen.GenerationStream],
               warnings: list[str]) -> AsyncIterator[bytes]:
        return _chat_events(service, job, streams, job.rid, job.include_usage, warnings)

    def body(self, service: ServiceState, job: _ChatJob, results: list[gen.GenerationResult],
             warnings: list[str]) -> ChatCompletion:
        choices, notes = [], list(warnings)
        for i, r in enumerate(results):
            choice, problems = _chat_choice(service, job, i, r, warnings)
            choices.append(choice)
            notes += [f"choice {i}: {w}" for w in problems]
        return ChatCompletion(id=job.rid, created=int(time.time()), model=job.model, choices=choices,
                              usage=_usage(results, [len(job.prompt_ids)], job.reasons),
                              service_tier=job.service_tier and "default", warnings=notes or msgspec.UNSET)


CHAT_COMPLETIONS = ChatCompletions()


# -- completions ---------------------------------------------------------------------------------


async def _completion_events(service: ServiceState, model: str, streams: list[gen.GenerationStream],
                             prompts: list[str], prompt_counts: list[int], n: int, echo: bool, rid: str,
                             include_usage: bool, want_logprobs: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    usage_field: Any = None if include_usage else msgspec.UNSET
    offsets = [len(prompts[i // n]) if echo else 0 for i in range(len(streams))]
    results: list[gen.GenerationResult] = []

    def chunk(index: int, text: str, finish: str | None = None, lps=None, **extra) -> bytes:
        return sse(Completion(id=rid, created=created, model=model, usage=usage_field,
                              choices=[CompletionChoice(index, text, finish, lps, **extra)]))

    try:
        if echo:
            for i in range(len(streams)):
                yield chunk(i, prompts[i // n])
        async for i, item in merged(streams):
            if isinstance(item, gen.GenerationResult):
                results.append(item)
                extra = {"valid": item.valid} if streams[i].spec is not None else {}
                yield chunk(i, "", item.finish_reason, **extra)
                continue
            lps = completion_logprobs(service, item.token_ids, item.logprobs, offsets[i],
                                      item.top_logprobs) if want_logprobs else None
            offsets[i] += len(item.text)
            yield chunk(i, item.text, None, lps)
        if include_usage:
            yield sse(Completion(id=rid, created=created, model=model, choices=[],
                                 usage=_usage(results, prompt_counts)))
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
        yield sse({"error": msgspec.to_builtins(error_fields(e))})
    yield b"data: [DONE]\n\n"


def _prompts(service: ServiceState, prompt: Any) -> list[str | list[int]]:
    """One string or token-id list per choice group (OpenAI's four shapes of ``prompt``)."""
    if isinstance(prompt, str):
        groups: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        groups = [list(prompt)]
    elif all(isinstance(t, str) for t in prompt) or all(isinstance(t, list) for t in prompt):
        groups = list(prompt)
    else:
        raise InputError("prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                         field="prompt", lead=True)
    if not groups or any(not g for g in groups if isinstance(g, list)):
        raise InputError("prompt is empty", field="prompt", lead=True)
    vocab = vocab_size(service)
    for g in groups:
        if isinstance(g, list) and any(not 0 <= t < vocab for t in g):
            raise InputError(f"prompt: token ids must be in 0..{vocab - 1}", field="prompt", lead=True)
    return groups


@post("/completions", status_code=200, summary="OpenAI-compatible text completion (legacy)",
      responses={200: ResponseSpec(Completion, description="the completion, or its chunks as server-sent "
                                   "events with `\"stream\": true`"), **GENERATION_ERRORS},
      operation_class=StreamableOperation, guards=[strict_body(CompletionRequest)],
      operation_id="createCompletion")
async def completions(data: CompletionRequest, service: ServiceState, request: Request) -> Any:
    """Create a text completion (OpenAI ``POST /v1/completions``), whole or streamed."""
    return await serve(COMPLETIONS, data, service, request)


@dataclass(slots=True, kw_only=True)
class _CompletionJob(OpenAIJob):
    """A checked completion request: ``n`` runs of each prompt, prompt by prompt."""

    prompts: list[str]  # each prompt's text (what ``echo`` sends back)
    counts: list[int]  # each prompt's tokens
    n: int
    echo: bool
    include_usage: bool
    want_logprobs: bool


class Completions:
    """``POST /v1/completions`` (legacy) as an ``openai_serving.Endpoint``."""

    def names(self, data: CompletionRequest) -> dict[str, str]:
        return {}

    async def prepare(self, service: ServiceState, data: CompletionRequest) -> _CompletionJob:
        model = check_model(service, data.model)
        n = 1 if data.n is None else data.n
        _check_common(n, bool(data.stream), data.stream_options)
        if data.logprobs is not None and not 0 <= data.logprobs <= MAX_LEGACY_LOGPROBS:
            raise InputError(f"logprobs must be between 0 and {MAX_LEGACY_LOGPROBS}, got {data.logprobs}",
                             field="logprobs")
        if data.suffix:
            raise InputError("suffix is not supported: the served model does not fill in the middle", field="suffix")
        if data.best_of not in (None, 1):
            raise InputError("best_of is not supported (only 1); ask n choices instead", field="best_of")
        groups = _prompts(service, data.prompt)
        schema, strict = format_schema(data.response_format)
        with named_as({"response_schema": "response_format"}):
            spec = await inputs.checked_grammar_spec(service, response_schema=schema, strict=strict)
        c = Constraint(spec, schema, ToolPlan("none", (), False))
        if data.structured_outputs is not None:
            c = await _structured_outputs(service, data.structured_outputs, data.response_format, None)
        want_logprobs = data.logprobs is not None
        bias = logit_bias_ids(data.logit_bias, vocab_size(service))
        params = [sampling_params(service, data, max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS if data.max_tokens is None
                                  else data.max_tokens, seed=s, logprobs=want_logprobs,
                                  top_logprobs=data.logprobs or 0, logit_bias=bias)
                  for s in _seeds(data.seed, n)]
        parse = bool(data.parse_special_tokens)
        prompt_ids = [g if isinstance(g, list) else await inputs.tokenize(service, prompt=g, parse_special_tokens=parse)
                      for g in groups]
        return _CompletionJob(rid=f"cmpl-{uuid.uuid4().hex}", model=model, constraint=c,
                              format_field=_format_field(data.structured_outputs),
                              runs=[(ids, p) for ids in prompt_ids for p in params],
                              prompts=[g if isinstance(g, str) else service.engine.tokenizer.decode(g) for g in groups],
                              counts=[len(ids) for ids in prompt_ids], n=n, echo=bool(data.echo),
                              include_usage=bool(data.stream_options and data.stream_options.include_usage),
                              want_logprobs=want_logprobs)

    def events(self, service: ServiceState, job: _CompletionJob, streams: list[gen.GenerationStream],
               warnings: list[str]) -> AsyncIterator[bytes]:
        return _completion_events(service, job.model, streams, job.prompts, job.counts, job.n, job.echo, job.rid,
                                  job.include_usage, job.want_logprobs)

    def body(self, service: ServiceState, job: _CompletionJob, results: list[gen.GenerationResult],
             warnings: list[str]) -> Completion:
        constrained = job.constraint.spec is not None
        choices, notes = [], list(warnings)
        for k, r in enumerate(results):
            prefix = job.prompts[k // job.n] if job.echo else ""
            choices.append(CompletionChoice(
                index=k, text=prefix + r.text, finish_reason=r.finish_reason,
                logprobs=completion_logprobs(service, r.token_ids, r.logprobs, len(prefix),
                                             r.top_logprobs if job.want_logprobs else None),
                valid=r.valid if constrained else msgspec.UNSET,
                closed_by_budget=True if r.closed_by_budget else msgspec.UNSET,
                truncated_value=True if constrained and r.truncated_value else msgspec.UNSET))
            notes += [f"choice {k}: {w}" for w in r.warnings if w not in warnings]
        return Completion(id=job.rid, created=int(time.time()), model=job.model, choices=choices,
                          usage=_usage(results, job.counts), warnings=notes or msgspec.UNSET)


COMPLETIONS = Completions()


# -- models --------------------------------------------------------------------------------------


def _model(service: ServiceState) -> Model:
    # ``created``: when the model directory was written, the nearest thing to a creation date.
    try:
        created = int(Path(service.engine.model_path).stat().st_mtime)
    except (AttributeError, OSError):
        created = 0
    chat = None
    if getattr(service.engine.tokenizer, "chat_template", None):  # (a base model: no chat format)
        chat = ChatFormat(reasoning=service.reasoning.name if service.reasoning is not None else None,
                          tool_calls=service.tool_format.name)
    return Model(id=service.model_name, created=created, chat_format=chat)


# The served model's id, as every other /v1 operation takes it (OpenAPI links: clients and
# schemathesis's stateful tests follow them from the list to the model and to generation).
_MODEL_ID = "$response.body#/data/0/id"
_MODEL_LINKS = {"200": {
    "RetrieveModel": Link(operation_id="retrieveModel", parameters={"model_id": _MODEL_ID},
                          description="the listed model, by id"),
    "CreateChatCompletion": Link(operation_id="createChatCompletion", request_body={"model": _MODEL_ID},
                                 description="a chat completion with the listed model"),
    "CreateCompletion": Link(operation_id="createCompletion", request_body={"model": _MODEL_ID},
                             description="a text completion with the listed model"),
    "CreateResponse": Link(operation_id="createResponse", request_body={"model": _MODEL_ID},
                           description="a response with the listed model"),
}}


@get("/models", summary="Models served (OpenAI-compatible)", responses=_LIST_ERRORS, operation_id="listModels",
     operation_class=with_links(Operation, _MODEL_LINKS))
async def list_models(service: ServiceState) -> ModelList:
    """The one model this server serves."""
    return ModelList(data=[_model(service)])


@get("/models/{model_id:path}", summary="One model (OpenAI-compatible)", responses=_LOOKUP_ERRORS,
     operation_id="retrieveModel")
async def get_model(model_id: str, service: ServiceState) -> Model:
    """The served model by id; 404 for any other id."""
    check_model(service, model_id.lstrip("/"))
    return _model(service)


# The /v1 router is assembled by ``stencil.service.app``.
openai_route_handlers: list = [chat_completions, completions, list_models, get_model]
