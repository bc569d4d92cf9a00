"""OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

They translate OpenAI's wire types (``schemas/openai.py``) to the shared generation core
(``service/generation.py``) and back, so limits, grammar, validation and metrics are those of
``POST /generate``. Errors raised under ``/v1`` use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` (the router's own exception handler); the
status codes are the ones ``service.errors.to_problem`` gives every route.

``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object: schema
``{"type": "object"}``), ``json_schema`` (``{name, schema, strict}``; ``strict: false`` lets
the grammar ignore keywords it cannot enforce, otherwise they are refused with 400). Tools:
see ``service/tools.py``. ``n`` choices are independent requests with seeds ``seed, seed+1,
...``. Streams are server-sent events ending ``data: [DONE]``. As in OpenAI's API,
``temperature`` defaults to 1 here (``POST /generate`` defaults to greedy). Legacy ``logprobs``
with ``echo`` cover the generated tokens only.

Register with ``create_app(..., route_handlers=openai_route_handlers)``; the handlers take the
dependency ``svc: ServiceState`` that ``service.app`` provides.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response, Router, get, post
from litestar.di import Provide
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from grammar.base import GrammarSpec
from schemas.openai import (
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChoiceDelta,
    ChoiceLogprobs, ChunkChoice, Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, ErrorBody,
    ErrorResponse, Model, ModelList, ResponseFormat, TokenLogprob, Tool, ToolCallDelta, Usage,
)
from service import generation as gen
from service.errors import ClientDisconnected, GenerationFailed, InputError, ServiceError, Unavailable, to_problem
from service.openapi_docs import StreamableOperation, error_responses
from service.state import ServiceState
from service.tools import (
    CALL_OPEN, ToolError, ToolPlan, arguments_schema, parse_tool_output, plan_tools, template_messages,
    template_supports_tools, tool_regex,
)
from service.validation import check_schema

MAX_N = 16  # choices per request; each is a full request in the engine
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy endpoint

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}
_FIELD_PARAM = {"response_schema": "response_format", "regex": "tools"}
# Statuses each route can answer with, in OpenAI's error shape (``openai_exception_handler``);
# body validation errors are 400 here, as in OpenAI's API.
_GENERATION_ERRORS = error_responses(ErrorResponse, "application/json", (400, 401, 404, 413, 429, 500, 503, 504))
_LIST_ERRORS = error_responses(ErrorResponse, "application/json", (401, 503))
_LOOKUP_ERRORS = error_responses(ErrorResponse, "application/json", (400, 401, 404, 503))


class NotFound(ServiceError):
    status = 404
    title = "Not Found"


# -- errors --------------------------------------------------------------------------------------


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> Response:
    """An OpenAI-shaped error response."""
    body = ErrorResponse(ErrorBody(message=message, type=_ERROR_TYPES.get(status, "server_error"),
                                   param=param, code=code))
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json",
                    headers=headers or {})


def openai_exception_handler(request: Request, exc: Exception) -> Response:
    """Map any exception raised under ``/v1`` to OpenAI's error shape (status as ``to_problem``)."""
    if isinstance(exc, ExceptionGroup):  # a TaskGroup of n choices: report the first failure
        exc = exc.exceptions[0]
    if isinstance(exc, ToolError):
        return openai_error(400, str(exc), exc.param)
    if isinstance(exc, ValidationException):
        extra = exc.extra if isinstance(exc.extra, list) else []
        details = "; ".join(f"{e.get('key', '')}: {e.get('message', '')}" if isinstance(e, dict) else str(e)
                            for e in extra)
        return openai_error(400, f"{exc.detail}{': ' + details if details else ''}")
    if isinstance(exc, HTTPException) and not isinstance(exc, ServiceError):
        return openai_error(exc.status_code, str(exc.detail), headers=exc.headers)
    from service.app import service_state

    state = service_state(request.app)
    problem, headers = to_problem(exc, request.scope.get("state", {}).get("request_id"),
                                  state.config.retry_after_s if state is not None else 1)
    param = _FIELD_PARAM.get(problem.field or "", problem.field)
    code = problem.keyword if problem.keyword is not None else None
    message = problem.detail if problem.path is None or problem.path in problem.detail else \
        f"{problem.detail} (at {problem.path})"
    return openai_error(problem.status, message, param, code, headers)


# -- request translation ---------------------------------------------------------------------------


def _check_model(svc: ServiceState, model: str | None) -> str:
    if model is not None and model != svc.model_name:
        raise NotFound(f"the model {model!r} does not exist; this server serves {svc.model_name!r}",
                       field="model")
    return svc.model_name


def _check_common(n: int, presence: float | None, frequency: float | None, stream: bool,
                  stream_options: Any) -> None:
    if not 1 <= n <= MAX_N:
        raise InputError(f"n must be between 1 and {MAX_N}, got {n}", field="n")
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if value not in (None, 0, 0.0):
            raise InputError(f"{name} is not supported (only 0)", field=name)
    if stream_options is not None and not stream:
        raise InputError("stream_options is only allowed with stream: true", field="stream_options")


def _format_schema(fmt: ResponseFormat | None) -> tuple[Any, bool]:
    """(JSON Schema or None, strict) of a ``response_format``."""
    if fmt is None or fmt.type == "text":
        return None, True
    if fmt.type == "json_object":
        return {"type": "object"}, True
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise InputError("response_format of type 'json_schema' needs json_schema.schema", field="response_format")
    return fmt.json_schema.schema, fmt.json_schema.strict is not False


async def _spec(svc: ServiceState, fmt: ResponseFormat | None, plan: ToolPlan,
                tools: list[Tool] | None) -> GrammarSpec | None:
    """The grammar of the whole output: the response format's, or the tool-call regex."""
    schema, strict = _format_schema(fmt)
    if not plan.active:
        return gen.grammar_spec(svc.config, response_schema=schema, strict=strict)
    cfg = svc.config
    for i, tool in enumerate(tools or []):
        params = tool.function.parameters
        if params is not None:
            try:
                check_schema(params, max_bytes=cfg.max_schema_bytes, max_depth=cfg.max_schema_depth)
            except InputError as e:
                e.field = f"tools[{i}].function.parameters"
                raise
    if schema is not None:
        check_schema(schema, max_bytes=cfg.max_schema_bytes, max_depth=cfg.max_schema_depth)
    from grammar.json_schema import schema_to_regex

    def build() -> str:
        text = schema_to_regex(schema, strict=strict)[0] if schema is not None else None
        return tool_regex(plan, lambda s: schema_to_regex(s, strict=plan.strict)[0], text)

    # A large schema can take a while to translate; keep the event loop serving others.
    return GrammarSpec("regex", await asyncio.to_thread(build))


def _max_tokens(*values: int | None) -> int | None:
    for v in values:
        if v is not None:
            return v
    return None


def _seeds(seed: int | None, n: int) -> list[int | None]:
    return [None if seed is None else seed + i for i in range(n)]


def _usage(results: list[gen.GenerationResult], prompt_counts: list[int]) -> Usage:
    prompt = sum(prompt_counts)
    completion = sum(r.usage.completion_tokens for r in results)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# -- logprobs ------------------------------------------------------------------------------------


def _token_bytes(svc: ServiceState, token_id: int) -> bytes:
    vocab = getattr(getattr(svc.engine.engine, "grammar", None), "vocab", None)
    raw = vocab.token_bytes.get(token_id) if vocab is not None else None
    if raw is None:
        raw = svc.engine.tokenizer.decode([token_id]).encode()
    return raw


def _token_text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:  # part of a multi-byte character: OpenAI's "bytes:" form
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(svc: ServiceState, token_ids: list[int], logprobs: list[float] | None) -> ChoiceLogprobs | None:
    """OpenAI chat logprobs of the chosen tokens (``top_logprobs`` always empty)."""
    if logprobs is None:
        return None
    items = []
    for t, lp in zip(token_ids, logprobs):
        raw = _token_bytes(svc, t)
        items.append(TokenLogprob(token=_token_text(raw), logprob=lp, bytes=list(raw)))
    return ChoiceLogprobs(content=items)


def completion_logprobs(svc: ServiceState, token_ids: list[int], logprobs: list[float] | None,
                        offset: int) -> CompletionLogprobs | None:
    """Legacy logprobs; ``text_offset`` counts characters from ``offset`` (the echoed prompt)."""
    if logprobs is None:
        return None
    tokens, offsets, pos, pending = [], [], offset, b""
    for t in token_ids:
        raw = _token_bytes(svc, t)
        tokens.append(_token_text(raw))
        offsets.append(pos)
        pending += raw
        try:  # characters are only counted once their last byte arrives
            pos += len(pending.decode())
            pending = b""
        except UnicodeDecodeError:
            pass
    return CompletionLogprobs(tokens=tokens, token_logprobs=list(logprobs), text_offset=offsets)


# -- chat ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _ChatJob:
    """A validated chat request, ready to run: one ``params`` entry per choice."""

    model: str
    plan: ToolPlan
    prompt_ids: list[int]
    params: list[Any]
    spec: GrammarSpec | None


async def _prepare_chat(svc: ServiceState, data: ChatCompletionRequest) -> _ChatJob:
    model = _check_model(svc, data.model)
    _check_common(data.n, data.presence_penalty, data.frequency_penalty, data.stream, data.stream_options)
    if data.top_logprobs not in (None, 0):
        raise InputError("top_logprobs > 0 is not supported: only the chosen token's logprob is reported",
                         field="top_logprobs")
    plan = plan_tools(data.tools, data.tool_choice, data.parallel_tool_calls)
    tok = svc.engine.tokenizer
    native = template_supports_tools(getattr(tok, "chat_template", None))
    messages, tools_arg = template_messages(data.messages, plan, native)
    prompt_ids = await gen.tokenize(svc, messages=messages, tools=tools_arg)
    spec = await _spec(svc, data.response_format, plan, data.tools)
    temperature = 1.0 if data.temperature is None else data.temperature
    params = [gen.sampling_params(svc.config, max_tokens=_max_tokens(data.max_completion_tokens, data.max_tokens),
                                  temperature=temperature, top_p=1.0 if data.top_p is None else data.top_p,
                                  top_k=data.top_k or 0, seed=s, stop=data.stop, logprobs=data.logprobs)
              for s in _seeds(data.seed, data.n)]
    return _ChatJob(model, plan, prompt_ids, params, spec)


def _chat_choice(svc: ServiceState, job: _ChatJob, index: int, r: gen.GenerationResult) -> ChatChoice:
    content, calls, finish = _split(svc, job.plan, r)
    msg = AssistantMessage(content=content)
    if calls:
        msg.tool_calls = calls
    return ChatChoice(index=index, message=msg, finish_reason=finish,
                      logprobs=chat_logprobs(svc, r.token_ids, r.logprobs))


def _split(svc: ServiceState, plan: ToolPlan, r: gen.GenerationResult):
    """(content, tool_calls, finish_reason) of one finished choice.

    Output cut short (``length``, or a stop string inside a call) comes back as plain text.

    Raises:
        GenerationFailed: a call's arguments fail their schema although the grammar was strict
            (a grammar defect: refuse rather than hand the client a bad call).
    """
    if not plan.active or r.finish_reason != "stop":
        return r.text, [], r.finish_reason
    try:
        content, calls = parse_tool_output(r.text, plan)
    except ValueError:
        return r.text, [], r.finish_reason
    if not calls:
        return content, [], r.finish_reason
    by_name = {fn.name: fn for fn in plan.functions}
    for c in calls:  # jsonschema confirms what the grammar enforced, as an independent oracle
        schema = arguments_schema(by_name[c.function.name])
        errors = list(svc.checker.validator(json.dumps(schema)).iter_errors(json.loads(c.function.arguments)))
        if errors and plan.strict:
            raise GenerationFailed(f"tool call arguments for {c.function.name!r} fail their schema: "
                                   f"{errors[0].message}")
    return None, calls, "tool_calls"


async def _run_all(svc: ServiceState, jobs: list[tuple[list[int], Any]], spec: GrammarSpec | None, base_id: str,
                   receive) -> list[gen.GenerationResult]:
    """Run one request per ``(prompt_ids, params)`` to the end, together.

    All are admitted first, so a refusal (400/429) comes before any work. A failure of one
    cancels the rest (raised as an ``ExceptionGroup``); the client hanging up (``http.disconnect``
    on the ASGI ``receive``) aborts all and raises ``ClientDisconnected``.
    """
    streams = await gen.start_many(svc, jobs, spec, base_id)

    async def results() -> list[gen.GenerationResult]:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(gen.collect(s)) for s in streams]
        return [t.result() for t in tasks]

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(results()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            t.cancel()  # cancelling ``work`` unwinds every stream, which aborts its engine request
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected(f"client closed the connection; {base_id} aborted")
    return work.result()


async def _merged(streams: list[gen.GenerationStream]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several streams as ``(index, item)``, in arrival order; exceptions re-raised."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: gen.GenerationStream) -> None:
        try:
            async for item in s:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # client gone or a failure: the streams abort their engine requests
        await asyncio.gather(*tasks, return_exceptions=True)


# The content type is repeated as a header: Litestar otherwise sends the route's default
# (application/json) even for a Stream whose media_type says text/event-stream.
_SSE_HEADERS = {"Cache-Control": "no-cache", "Content-Type": "text/event-stream; charset=utf-8"}


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _sse_error(exc: BaseException) -> bytes:
    problem, _ = to_problem(exc)
    body = ErrorBody(message=problem.detail, type=_ERROR_TYPES.get(problem.status, "server_error"),
                     param=_FIELD_PARAM.get(problem.field or "", problem.field))
    return _sse(ErrorResponse(body))


async def _chat_events(svc: ServiceState, job: _ChatJob, streams: list[gen.GenerationStream], rid: str,
                       include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    usage_field: Any = None if include_usage else msgspec.UNSET

    def chunk(index: int, delta: ChoiceDelta, finish: str | None = None, logprobs=None) -> bytes:
        return _sse(ChatCompletionChunk(id=rid, created=created, model=job.model, usage=usage_field,
                                        choices=[ChunkChoice(index, delta, finish, logprobs)]))

    # Under tools a choice is held back while it could still become a call (its text is a prefix
    # of the marker), then either streamed as text or sent as whole calls at its end.
    held: list[list[tuple[str, list[int], list[float] | None]]] = [[] for _ in streams]
    is_text = [not job.plan.active for _ in streams]
    results: list[gen.GenerationResult | None] = [None] * len(streams)
    for i in range(len(streams)):
        yield chunk(i, ChoiceDelta(role="assistant", content=""))
    try:
        async for i, item in _merged(streams):
            if isinstance(item, gen.GenerationResult):
                results[i] = item
                if is_text[i]:
                    yield chunk(i, ChoiceDelta(), item.finish_reason)
                    continue
                content, calls, finish = _split(svc, job.plan, item)
                if calls:
                    deltas = [ToolCallDelta(index=k, id=c.id, type="function", function=c.function)
                              for k, c in enumerate(calls)]
                    yield chunk(i, ChoiceDelta(tool_calls=deltas),
                                logprobs=chat_logprobs(svc, item.token_ids, item.logprobs))
                elif content:
                    yield chunk(i, ChoiceDelta(content=content),
                                logprobs=chat_logprobs(svc, item.token_ids, item.logprobs))
                yield chunk(i, ChoiceDelta(), finish)
                continue
            if is_text[i]:
                if item.text or item.token_ids:
                    yield chunk(i, ChoiceDelta(content=item.text),
                                logprobs=chat_logprobs(svc, item.token_ids, item.logprobs))
                continue
            held[i].append((item.text, item.token_ids, item.logprobs))
            so_far = "".join(t for t, _, _ in held[i])
            if job.plan.mode == "auto" and not CALL_OPEN.startswith(so_far[:len(CALL_OPEN)]):
                is_text[i] = True
                ids = [t for _, ts, _ in held[i] for t in ts]
                lps = None if item.logprobs is None else [x for _, _, ls in held[i] for x in (ls or [])]
                held[i] = []
                yield chunk(i, ChoiceDelta(content=so_far), logprobs=chat_logprobs(svc, ids, lps))
        if include_usage:
            done = [r for r in results if r is not None]
            yield _sse(ChatCompletionChunk(id=rid, created=created, model=job.model, choices=[],
                                           usage=_usage(done, [len(job.prompt_ids)])))
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI does
        yield _sse_error(e)
    yield b"data: [DONE]\n\n"


@post("/chat/completions", status_code=200, summary="OpenAI-compatible chat completion",
      responses={200: ResponseSpec(ChatCompletion, description="the completion, or its chunks as server-sent "
                                   "events with `\"stream\": true`"), **_GENERATION_ERRORS},
      operation_class=StreamableOperation)
async def chat_completions(data: ChatCompletionRequest, svc: ServiceState, request: Request) -> Any:
    """Create a chat completion (OpenAI ``POST /v1/chat/completions``), whole or streamed."""
    job = await _prepare_chat(svc, data)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if data.stream:
        streams = await gen.start_many(svc, [(job.prompt_ids, p) for p in job.params], job.spec, rid)
        include = bool(data.stream_options and data.stream_options.include_usage)
        return Stream(_chat_events(svc, job, streams, rid, include), media_type="text/event-stream",
                      headers=_SSE_HEADERS)
    results = await _run_all(svc, [(job.prompt_ids, p) for p in job.params], job.spec, rid, request.receive)
    choices = [_chat_choice(svc, job, i, r) for i, r in enumerate(results)]
    return ChatCompletion(id=rid, created=int(time.time()), model=job.model, choices=choices,
                          usage=_usage(results, [len(job.prompt_ids)]))


# -- completions ---------------------------------------------------------------------------------


async def _completion_events(svc: ServiceState, model: str, streams: list[gen.GenerationStream],
                             prompts: list[str], prompt_counts: list[int], n: int, echo: bool, rid: str,
                             include_usage: bool, want_logprobs: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    usage_field: Any = None if include_usage else msgspec.UNSET
    offsets = [len(prompts[i // n]) if echo else 0 for i in range(len(streams))]
    results: list[gen.GenerationResult] = []

    def chunk(index: int, text: str, finish: str | None = None, lps=None) -> bytes:
        return _sse(Completion(id=rid, created=created, model=model, usage=usage_field,
                               choices=[CompletionChoice(index, text, finish, lps)]))

    try:
        if echo:
            for i in range(len(streams)):
                yield chunk(i, prompts[i // n])
        async for i, item in _merged(streams):
            if isinstance(item, gen.GenerationResult):
                results.append(item)
                yield chunk(i, "", item.finish_reason)
                continue
            lps = completion_logprobs(svc, item.token_ids, item.logprobs, offsets[i]) if want_logprobs else None
            offsets[i] += len(item.text)
            yield chunk(i, item.text, None, lps)
        if include_usage:
            yield _sse(Completion(id=rid, created=created, model=model, choices=[],
                                  usage=_usage(results, prompt_counts)))
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
        yield _sse_error(e)
    yield b"data: [DONE]\n\n"


@post("/completions", status_code=200, summary="OpenAI-compatible text completion (legacy)",
      responses={200: ResponseSpec(Completion, description="the completion, or its chunks as server-sent "
                                   "events with `\"stream\": true`"), **_GENERATION_ERRORS},
      operation_class=StreamableOperation)
async def completions(data: CompletionRequest, svc: ServiceState, request: Request) -> Any:
    """Create a text completion (OpenAI ``POST /v1/completions``), whole or streamed."""
    model = _check_model(svc, data.model)
    _check_common(data.n, data.presence_penalty, data.frequency_penalty, data.stream, data.stream_options)
    if data.logprobs not in (None, 0):
        raise InputError("logprobs > 0 is not supported: only the chosen token's logprob is reported "
                         "(use logprobs: 0)", field="logprobs")
    if data.suffix:
        raise InputError("suffix is not supported", field="suffix")
    if data.best_of not in (None, 1):
        raise InputError("best_of is not supported (only 1)", field="best_of")
    prompts = [data.prompt] if isinstance(data.prompt, str) else list(data.prompt)
    if not prompts:
        raise InputError("prompt is empty", field="prompt")
    schema, strict = _format_schema(data.response_format)
    spec = gen.grammar_spec(svc.config, response_schema=schema, strict=strict)
    want_logprobs = data.logprobs is not None
    params = [gen.sampling_params(svc.config, max_tokens=_max_tokens(data.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS),
                                  temperature=1.0 if data.temperature is None else data.temperature,
                                  top_p=1.0 if data.top_p is None else data.top_p, top_k=data.top_k or 0,
                                  seed=s, stop=data.stop, logprobs=want_logprobs)
              for s in _seeds(data.seed, data.n)]
    prompt_ids = [await gen.tokenize(svc, prompt=p) for p in prompts]
    rid = f"cmpl-{uuid.uuid4().hex}"
    jobs = [(ids, p) for ids in prompt_ids for p in params]
    counts = [len(ids) for ids in prompt_ids]
    if data.stream:
        streams = await gen.start_many(svc, jobs, spec, rid)
        include = bool(data.stream_options and data.stream_options.include_usage)
        return Stream(_completion_events(svc, model, streams, prompts, counts, data.n, data.echo, rid, include,
                                         want_logprobs),
                      media_type="text/event-stream", headers=_SSE_HEADERS)
    results = await _run_all(svc, jobs, spec, rid, request.receive)
    choices = []
    for k, r in enumerate(results):
        prefix = prompts[k // data.n] if data.echo else ""
        choices.append(CompletionChoice(index=k, text=prefix + r.text, finish_reason=r.finish_reason,
                                        logprobs=completion_logprobs(svc, r.token_ids, r.logprobs, len(prefix))))
    return Completion(id=rid, created=int(time.time()), model=model, choices=choices, usage=_usage(results, counts))


# -- models --------------------------------------------------------------------------------------


def _model(svc: ServiceState) -> Model:
    # ``created``: when the model directory was written, the nearest thing to a creation date.
    try:
        created = int(Path(svc.engine.engine.config.model).stat().st_mtime)
    except (AttributeError, OSError):
        created = 0
    return Model(id=svc.model_name, created=created)


@get("/models", summary="Models served (OpenAI-compatible)", responses=_LIST_ERRORS)
async def list_models(svc: ServiceState) -> ModelList:
    """The one model this server serves."""
    return ModelList(data=[_model(svc)])


@get("/models/{model_id:path}", summary="One model (OpenAI-compatible)", responses=_LOOKUP_ERRORS)
async def get_model(model_id: str, svc: ServiceState) -> Model:
    """The served model by id; 404 for any other id."""
    _check_model(svc, model_id.lstrip("/"))
    return _model(svc)


# Litestar merges exception handlers over app → router → handler and picks one by status code, then
# by the exception's MRO: this ``Exception`` key wins only while the app maps nothing more specific
# (``service.app`` maps ``Exception`` alone).
def _provide_svc(request: Request) -> ServiceState:
    """The app's ``ServiceState``, looked up through ``service.app.service_state`` so these routes
    do not depend on the name under which the app injects it."""
    from service.app import service_state

    st = service_state(request.app)
    if st is None:
        raise Unavailable("the engine is not started")
    return st


openai_router = Router(path="/v1", route_handlers=[chat_completions, completions, list_models, get_model],
                       dependencies={"svc": Provide(_provide_svc, sync_to_thread=False)},
                       exception_handlers={Exception: openai_exception_handler}, tags=["openai"])

openai_route_handlers: list = [openai_router]
