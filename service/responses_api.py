"""OpenAI's Responses API for what Stencil does: ``POST /v1/responses``, whole or streamed.

The request becomes a chat (``instructions`` as the first system message, ``input`` items as
messages, past ``function_call`` / ``function_call_output`` items as the assistant's calls and
the tool's results), then runs through the same constraint, engine and checks as chat
completions (``stencil.service.openai_common``): ``text.format`` is ``response_format`` (``strict``
omitted or false relaxes only what the grammar cannot enforce, reported in ``warnings``, the
``X-Stencil-Warnings`` header and ``valid``); function ``tools`` are the chat endpoint's tools,
``max_tool_calls`` bounds the calls in the grammar itself.

Stateless: nothing is stored (``store`` true is refused, an omitted ``store`` means false), so
``previous_response_id``, ``conversation`` and ``GET /v1/responses/{id}`` get clear errors.
Streams are typed events (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
/ ``.done``, ``response.function_call_arguments.delta`` / ``.done``,
``response.output_item.done``, then ``response.completed`` or ``response.incomplete``; ``error``
and ``response.failed`` when the request fails after the stream began), each with a
``sequence_number``; a call's arguments stream as they are written. A reasoning model's thoughts
come first, as a ``reasoning`` item (``response.reasoning_text.delta`` / ``.done``;
``reasoning.effort`` caps them: ``stencil.service.reasoning``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, get, post
from litestar.openapi import ResponseSpec
from litestar.openapi.spec import Link

from stencil.schemas.openai import ChatMessage, ErrorResponse, FunctionCall, FunctionDefinition, ToolCall
from stencil.schemas.responses import (
    FunctionCallItem, FunctionTool, IncompleteDetails, InputContent, InputTokensDetails, NamedFunction, OutputItem,
    OutputLogprob, OutputMessage, OutputText, OutputTokensDetails, ReasoningItem, ReasoningText,
    Response as ResponseObject, ResponseError, ResponsesRequest, ResponseUsage, TextConfig, TextFormat, TopLogprob,
)
from stencil.service import generation as gen
from stencil.service import reasoning
from stencil.service.errors import InputError
from stencil.service.openai_common import (
    GENERATION_ERRORS, NotFound, check_model, constraint, error_fields, refuse_unserved, sse, token_bytes, token_text,
    verdict,
)
from stencil.service.openai_serving import OpenAIJob, chat_prompt, sampling_params, serve
from stencil.service.openapi_docs import RefusedOperation, StreamableOperation, error_responses, with_links
from stencil.service.state import ServiceState
from stencil.service.tool_parser import ToolCallParser, ToolEvent
from stencil.service.tools import ToolPlan
from stencil.service.wire import strict_body

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")
# The generation core's fields as this API names them, for errors (``stencil.service.errors.named_as``).
NAMES = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens", "response_schema": "text.format"}

UNSERVED: dict[str, tuple[tuple, str]] = {
    "previous_response_id": ((), "Stencil stores no responses; send the whole conversation as input"),
    "conversation": ((), "Stencil stores no conversations; send the whole conversation as input"),
    "background": ((False,), "responses run in the foreground only"),
    "background_options": ((), "responses run in the foreground only"),
    "prompt": ((), "stored prompt templates are not served"),
    "prompt_cache_options": ((), "the prefix cache is automatic and takes no options"),
    "prompt_cache_retention": ((), "the prefix cache is automatic and takes no options"),
    "context_management": ((), "the conversation is used as sent"),
    "moderation": ((), "Stencil runs no moderation"),
    "image": ((), "Stencil generates text only"),
    "access_programs": ((), "not served"),
    "store": ((False,), "Stencil is stateless and stores nothing"),
    "service_tier": (("auto", "default"), "Stencil has one service tier"),
    "truncation": (("disabled",), "the conversation is used as sent (a prompt too long is a 400)"),
}


# -- the request ---------------------------------------------------------------------------------


def _text(content: str | list[InputContent] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS and part.text is not None:
            parts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            parts.append(part.refusal)
        else:
            raise InputError(f"{where}[{j}]: content of type {part.type!r} is not supported (only text)",
                             field=f"{where}[{j}].type")
    return "".join(parts)


def input_messages(data: ResponsesRequest) -> list[ChatMessage]:
    """``instructions`` + ``input`` as chat messages (past calls and their outputs included).

    Raises:
        InputError: an item type Stencil does not serve (``item_reference``, built-in tools'
            calls; a ``reasoning`` item, a past turn's thoughts, is taken and dropped), a message
            without role or content, or content that is not text; the field names the item.
    """
    out: list[ChatMessage] = []
    if data.instructions:
        out.append(ChatMessage(role="system", content=data.instructions))
    if isinstance(data.input, str):
        if not data.input:
            raise InputError("input is empty", field="input")  # as an empty list is
        out.append(ChatMessage(role="user", content=data.input))
        return out
    for i, item in enumerate(data.input):
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise InputError(f"input[{i}]: a message needs a role", field=f"input[{i}].role")
            if item.content is None:
                raise InputError(f"input[{i}]: a message needs content", field=f"input[{i}].content")
            out.append(ChatMessage(role=item.role, content=_text(item.content, f"input[{i}].content")))
        elif kind == "function_call":
            if item.call_id is None or item.name is None:
                raise InputError(f"input[{i}]: a function_call needs call_id and name", field=f"input[{i}]")
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments or "{}"))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls and not last.content:
                last.tool_calls.append(call)  # parallel calls of one turn
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "reasoning":
            continue  # a past turn's thoughts, sent back with its output: the templates drop them
        elif kind == "function_call_output":
            if item.call_id is None:
                raise InputError(f"input[{i}]: a function_call_output needs call_id", field=f"input[{i}].call_id")
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                   content=_text(item.output, f"input[{i}].output")))
        else:
            raise InputError(f"input[{i}]: items of type {kind!r} are not supported (message, function_call and "
                             "function_call_output are)", field=f"input[{i}].type")
    return out


def _format(text: TextConfig | None) -> tuple[Any, bool]:
    fmt = text.format if text is not None else None
    if text is not None and text.verbosity not in (None, "medium"):
        raise InputError("text.verbosity is not supported: the served model has no verbosity control",
                         field="text.verbosity")
    if fmt is None or fmt.type == "text":
        return None, True
    if fmt.type == "json_object":
        return {"type": "object"}, True
    if fmt.schema is None:
        raise InputError("text.format of type 'json_schema' needs a schema", field="text.format.schema")
    return fmt.schema, fmt.strict is True


@dataclass(slots=True, kw_only=True)
class _Job(OpenAIJob):
    """A checked Responses request: one run."""

    want_logprobs: bool
    data: ResponsesRequest

    @property
    def prompt_ids(self) -> list[int]:
        return self.runs[0][0]


class Responses:
    """``POST /v1/responses`` as an ``openai_serving.Endpoint``: one run of a chat-templated
    prompt, its output as typed items (messages, function calls)."""

    def names(self, data: ResponsesRequest) -> dict[str, str]:
        return NAMES

    async def prepare(self, service: ServiceState, data: ResponsesRequest) -> _Job:
        model = check_model(service, data.model)
        refuse_unserved(data, UNSERVED)
        if data.stream_options is not None and data.stream_options.include_obfuscation:
            raise InputError("stream_options.include_obfuscation is not supported: Stencil pads no events",
                             field="stream_options")
        include = list(data.include or [])
        unknown = [x for x in include if x != LOGPROBS_INCLUDE]
        if unknown:
            raise InputError(f"include {unknown[0]!r} is not supported (only {LOGPROBS_INCLUDE!r})", field="include")
        functions = [FunctionDefinition(name=t.name, description=t.description, parameters=t.parameters,
                                        strict=t.strict) for t in data.tools or []]
        named = data.tool_choice.name if isinstance(data.tool_choice, NamedFunction) else None
        choice = None if named is not None else data.tool_choice
        effort = data.reasoning.effort if data.reasoning is not None else None
        if data.reasoning is not None and (data.reasoning.summary or data.reasoning.generate_summary):
            raise InputError("reasoning.summary is not served: the reasoning comes whole, as a reasoning item's "
                             "reasoning_text", field="reasoning.summary")
        thinking = reasoning.plan(service, effort, None, effort_field="reasoning.effort")
        plan, prompt_ids = await chat_prompt(service, input_messages(data), functions, choice, named,
                                             data.parallel_tool_calls, data.max_tool_calls,
                                             template_kwargs=thinking.kwargs)
        region = thinking.params(service.engine.tokenizer, prompt_ids, tools=plan.active)
        schema, strict = _format(data.text)
        c = await constraint(service, schema, strict, plan, parameters_field="tools[{i}].parameters",
                             format_field="text.format")
        want_logprobs = LOGPROBS_INCLUDE in include or bool(data.top_logprobs)
        params = sampling_params(service, data, max_tokens=data.max_output_tokens, seed=data.seed,
                                 logprobs=want_logprobs, top_logprobs=data.top_logprobs or 0, reasoning=region)
        return _Job(rid=f"resp_{uuid.uuid4().hex}", model=model, constraint=c, format_field="text.format",
                    runs=[(prompt_ids, params)], want_logprobs=want_logprobs, data=data,
                    notes=thinking.warnings)

    def events(self, service: ServiceState, job: _Job, streams: list[gen.GenerationStream],
               warnings: list[str]) -> AsyncIterator[bytes]:
        return _events(service, job, streams[0], warnings, job.created)

    def body(self, service: ServiceState, job: _Job, results: list[gen.GenerationResult],
             warnings: list[str]) -> ResponseObject:
        r = results[0]
        out = _Output(service, _parser(job.constraint.plan))
        if r.reasoning:  # as streamed: an item once there is reasoning text
            out.think(r.reasoning)
        out.feed(r.text, out.logprob_items(r.token_ids, r.logprobs, r.top_logprobs))
        body, _ = _final(service, job, out, r, warnings, job.created)
        return body


RESPONSES = Responses()


# -- the output ----------------------------------------------------------------------------------


def _parser(plan: ToolPlan) -> ToolCallParser | None:
    """The reader of an answer's calls under ``plan`` (``None``: no tools)."""
    return ToolCallParser(plan.mode == "auto", plan.syntax) if plan.active else None


@dataclass(slots=True)
class _Output:
    """The response's output items, built from the answer's text as it arrives.

    ``feed`` / ``finish`` return the stream events due (dicts without ``sequence_number``);
    a whole answer is fed at once and the events dropped.
    """

    service: ServiceState
    parser: ToolCallParser | None
    items: list[OutputItem] = field(default_factory=list)
    message: OutputMessage | None = None  # the text answer, while it is being written
    thought: ReasoningItem | None = None  # the reasoning, while it is being written
    calls: dict[int, FunctionCallItem] = field(default_factory=dict)
    pending: list[OutputLogprob] = field(default_factory=list)

    def think(self, text: str) -> list[dict]:
        """Reasoning text: into the reasoning item (the output's first), opened on first use."""
        events: list[dict] = []
        if self.thought is None:
            self.thought = ReasoningItem(id=f"rs_{uuid.uuid4().hex}", content=[ReasoningText("")])
            self.items.append(self.thought)
            events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                           "item": self.thought})
        if text:
            self.thought.content[0].text += text
            events.append({"type": "response.reasoning_text.delta", "item_id": self.thought.id,
                           "output_index": self.items.index(self.thought), "content_index": 0, "delta": text})
        return events

    def _close_thought(self, status: str) -> list[dict]:
        item = self.thought
        if item is None or item.status != "in_progress":
            return []
        item.status = "completed" if status == "completed" else "incomplete"
        index = self.items.index(item)
        return [{"type": "response.reasoning_text.done", "item_id": item.id, "output_index": index,
                 "content_index": 0, "text": item.content[0].text},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def feed(self, text: str, logprobs: list[OutputLogprob]) -> list[dict]:
        self.pending += logprobs
        events = self._close_thought("completed") if text else []  # the answer has begun
        if self.parser is None:
            return events + self._text(text) if text else events
        for ev in self.parser.feed(text):
            events += self._event(ev)
        return events

    def finish(self, status: str) -> list[dict]:
        # A reasoning that max_output_tokens cut before any answer is incomplete.
        events: list[dict] = self._close_thought(status if len(self.items) == 1 else "completed")
        for ev in (self.parser.finish() if self.parser is not None else []):
            events += self._event(ev)
        if self.message is None and all(isinstance(i, ReasoningItem) for i in self.items):
            events += self._open_message()  # an empty answer is still a message
        if self.message is not None:
            events += self._close_message(status)
        for index in sorted(self.calls):
            events += self._close_call(index, status)
        return events

    def _event(self, ev: ToolEvent) -> list[dict]:
        if ev.kind == "text":
            return self._text(ev.text) if ev.text else []
        if ev.kind == "start":
            item = FunctionCallItem(id=f"fc_{uuid.uuid4().hex}", call_id=f"call_{uuid.uuid4().hex[:24]}",
                                    name=ev.name, arguments="", status="in_progress")
            self.calls[ev.index] = item
            self.items.append(item)
            return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": item}]
        if ev.kind == "arguments":
            item = self.calls[ev.index]
            item.arguments += ev.text
            return [{"type": "response.function_call_arguments.delta", "item_id": item.id,
                     "output_index": self.items.index(item), "delta": ev.text}]
        return self._close_call(ev.index, "completed")

    def _open_message(self) -> list[dict]:
        self.message = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[OutputText("")])
        self.items.append(self.message)
        index = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": index, "item": self.message},
                {"type": "response.content_part.added", "item_id": self.message.id, "output_index": index,
                 "content_index": 0, "part": OutputText("")}]

    def _text(self, text: str) -> list[dict]:
        events = self._open_message() if self.message is None else []
        part = self.message.content[0]
        part.text += text
        lps, self.pending = self.pending, []
        part.logprobs += lps
        events.append({"type": "response.output_text.delta", "item_id": self.message.id,
                       "output_index": self.items.index(self.message), "content_index": 0, "delta": text,
                       "logprobs": lps})
        return events

    def _close_message(self, status: str) -> list[dict]:
        msg, self.message = self.message, None
        part = msg.content[0]
        part.logprobs += self.pending
        self.pending = []
        msg.status = "completed" if status == "completed" else "incomplete"
        index = self.items.index(msg)
        return [{"type": "response.output_text.done", "item_id": msg.id, "output_index": index, "content_index": 0,
                 "text": part.text, "logprobs": part.logprobs},
                {"type": "response.content_part.done", "item_id": msg.id, "output_index": index, "content_index": 0,
                 "part": part},
                {"type": "response.output_item.done", "output_index": index, "item": msg}]

    def _close_call(self, key: int, status: str) -> list[dict]:
        item = self.calls.pop(key, None)
        if item is None:
            return []
        item.status = "completed" if status == "completed" else "incomplete"
        index = self.items.index(item)
        return [{"type": "response.function_call_arguments.done", "item_id": item.id, "output_index": index,
                 "arguments": item.arguments, "name": item.name},
                {"type": "response.output_item.done", "output_index": index, "item": item}]

    def logprob_items(self, ids: list[int], lps: list[float] | None,
                      tops: list[list[tuple[int, float]]] | None) -> list[OutputLogprob]:
        """Logprob entries of ``output_text`` for these tokens (``[]`` when not asked)."""
        if lps is None:
            return []
        out = []
        for k, (t, lp) in enumerate(zip(ids, lps)):
            raw = token_bytes(self.service, t)
            alts = [TopLogprob(token=token_text(token_bytes(self.service, a)), logprob=alp,
                               bytes=list(token_bytes(self.service, a))) for a, alp in (tops[k] if tops else [])]
            out.append(OutputLogprob(token=token_text(raw), logprob=lp, bytes=list(raw), top_logprobs=alts))
        return out


def _tools(data: ResponsesRequest) -> list[FunctionTool]:
    return list(data.tools or [])


def _response(job: _Job, status: str, output: list[OutputItem], created: float, *, usage: ResponseUsage | None = None,
              incomplete: bool = False, error: ResponseError | None = None, valid: bool | None = None,
              warnings: list[str] | None = None, closed_by_budget: bool = False) -> ResponseObject:
    d = job.data
    tool_choice = d.tool_choice if d.tool_choice is not None else ("auto" if d.tools else "none")
    text = d.text if d.text is not None else TextConfig(format=TextFormat(type="text"))
    return ResponseObject(
        id=job.rid, created_at=created, model=job.model, status=status, output=output,  # type: ignore[arg-type]
        parallel_tool_calls=d.parallel_tool_calls is not False,
        tool_choice=tool_choice, tools=_tools(d), instructions=d.instructions, max_output_tokens=d.max_output_tokens,
        max_tool_calls=d.max_tool_calls, temperature=1.0 if d.temperature is None else d.temperature,
        top_p=1.0 if d.top_p is None else d.top_p, top_logprobs=d.top_logprobs, text=text, metadata=d.metadata,
        user=d.user, safety_identifier=d.safety_identifier, prompt_cache_key=d.prompt_cache_key, usage=usage,
        incomplete_details=IncompleteDetails("max_output_tokens") if incomplete else None, error=error,
        completed_at=time.time() if status in ("completed", "incomplete") else None,
        valid=msgspec.UNSET if valid is None else valid, warnings=warnings or msgspec.UNSET,
        closed_by_budget=True if closed_by_budget else msgspec.UNSET)


def _usage(job: _Job, r: gen.GenerationResult) -> ResponseUsage:
    return ResponseUsage(input_tokens=len(job.prompt_ids), output_tokens=r.usage.completion_tokens,
                         total_tokens=len(job.prompt_ids) + r.usage.completion_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=r.usage.cached_tokens),
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=r.usage.reasoning_tokens))


def _final(service: ServiceState, job: _Job, out: _Output, r: gen.GenerationResult, relaxed_warnings: list[str],
           created: float) -> tuple[ResponseObject, list[dict]]:
    """The finished response and the events that close its items."""
    v = verdict(service, job.constraint, r, relaxed_warnings)
    status = "incomplete" if r.finish_reason == "length" else "completed"
    events = out.finish(status)
    warnings = list(relaxed_warnings) + v.problems
    body = _response(job, status, out.items, created, usage=_usage(job, r), incomplete=status == "incomplete",
                     valid=v.valid, warnings=warnings, closed_by_budget=r.closed_by_budget)
    return body, events


# -- the routes ----------------------------------------------------------------------------------


async def _events(service: ServiceState, job: _Job, stream: gen.GenerationStream, relaxed_warnings: list[str],
                  created: float) -> AsyncIterator[bytes]:
    seq = 0

    def emit(event: dict) -> bytes:
        nonlocal seq
        event["sequence_number"] = seq
        seq += 1
        return sse(event, event["type"])

    out = _Output(service, _parser(job.constraint.plan))
    started = _response(job, "in_progress", [], created)
    yield emit({"type": "response.created", "response": started})
    yield emit({"type": "response.in_progress", "response": started})
    try:
        async for item in stream:
            if isinstance(item, gen.GenerationDelta):
                if item.reasoning:
                    for ev in out.think(item.reasoning):
                        yield emit(ev)
                lps = out.logprob_items(item.token_ids, item.logprobs, item.top_logprobs)
                for ev in out.feed(item.text, lps):
                    yield emit(ev)
                continue
            body, closing = _final(service, job, out, item, relaxed_warnings, created)
            for ev in closing:
                yield emit(ev)
            yield emit({"type": f"response.{body.status}", "response": body})
    except Exception as e:  # noqa: BLE001 - the stream has begun: report in-band
        err = error_fields(e)
        yield emit({"type": "error", "code": err.code or err.type, "message": err.message, "param": err.param})
        yield emit({"type": "response.failed",
                    "response": _response(job, "failed", out.items, created,
                                          error=ResponseError(code=err.type, message=err.message))})


# Stateless, the API's way to go on is to send the answer back: the output items are input items
# (an OpenAPI link, which schemathesis's stateful tests follow).
_CONTINUE = {"200": {"ContinueConversation": Link(
    operation_id="createResponse", request_body={"input": "$response.body#/output"},
    description="the next turn: this response's output items sent back as input")}}


@post("/responses", status_code=200, summary="OpenAI-compatible response (Responses API)",
      responses={200: ResponseSpec(ResponseObject, description="the response, or its typed events as server-sent "
                                   "events with `\"stream\": true`"), **GENERATION_ERRORS},
      operation_class=with_links(StreamableOperation, _CONTINUE), guards=[strict_body(ResponsesRequest)],
      operation_id="createResponse")
async def create_response(data: ResponsesRequest, service: ServiceState, request: Request) -> Any:
    """Create a model response (OpenAI ``POST /v1/responses``), whole or streamed.

    Raises (answered in OpenAI's error shape, ``param`` naming this API's field: ``input``,
    ``max_output_tokens``, ``text.format``): the errors of ``stencil.service.generation``,
    ``stencil.service.tools`` and ``input_messages``.
    """
    return await serve(RESPONSES, data, service, request)


@get("/responses/{response_id:str}", summary="Retrieve a response (not served: Stencil stores none)",
     operation_id="getResponse", operation_class=RefusedOperation,
     responses={**error_responses(ErrorResponse, "application/json", (400, 401)),
                404: ResponseSpec(ErrorResponse, description="no response is stored", media_type="application/json")},
     description="Always 404 in OpenAI's error shape: Stencil is stateless and stores no response.")
async def get_response(response_id: str) -> None:
    """Always 404: Stencil is stateless and keeps no responses."""
    raise NotFound(f"response {response_id!r} was not stored: Stencil is stateless (store is always false)",
                   field="response_id")


responses_route_handlers = [create_response, get_response]
