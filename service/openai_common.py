"""What the OpenAI-compatible routes share: errors in OpenAI's shape, the model check, refused
fields, the constraint of an answer (response format and tools), its check, logprobs, SSE.

Chat completions and completions live in ``stencil.service.openai_api``, the Responses API in
``stencil.service.responses_api``; both turn their wire types into the generation core's calls
(``stencil.service.generation``) through these helpers, so limits, grammar, validation and errors are
the same everywhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.tool_calls import tool_call_spec
from stencil.schemas.openai import ErrorBody, ErrorResponse, TokenLogprob, TopLogprob
from stencil.service import generation as gen
from stencil.service import inputs
from stencil.service.openapi_docs import error_responses
from stencil.service.errors import ClientDisconnected, GenerationFailed, InputError, ServiceError, client_left_during_body, \
    log_refused, named_as, to_problem
from stencil.service.state import ServiceState, service_state
from stencil.service.tool_parser import ParsedCall, parse_answer
from stencil.service.tools import ToolError, ToolPlan, arguments_schema, is_strict
from stencil.service.wire import invalid_field

log = logging.getLogger("stencil.openai")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable", 504: "timeout"}
_FIELD_PARAM = {"response_schema": "response_format", "regex": "tools"}
WARNINGS_HEADER = "X-Stencil-Warnings"
# Statuses each generation route can answer with, in OpenAI's error shape
# (``openai_exception_handler``); body validation errors are 400 here, as in OpenAI's API.
GENERATION_ERRORS = error_responses(ErrorResponse, "application/json",
                                    (400, 401, 404, 413, 415, 429, 500, 503, 504))
_MAX_HEADER_CHARS = 4000
MAX_TEMPERATURE = 2.0  # OpenAI's range is 0..2 (``POST /generate`` takes up to the engine's 1e6)


class NotFound(ServiceError):
    status = 404
    title = "Not Found"


# -- errors --------------------------------------------------------------------------------------


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> Response:
    """An OpenAI-shaped error response: ``{"error": {"message", "type", "param", "code"}}``."""
    body = ErrorResponse(ErrorBody(message=message, type=ERROR_TYPES.get(status, "server_error"),
                                   param=param, code=code))
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json",
                    headers=headers or {})


def openai_exception_handler(request: Request, exc: Exception) -> Response:
    """Map any exception raised under ``/v1`` (unknown routes included) to OpenAI's error shape,
    with the status ``stencil.service.errors.to_problem`` gives every route; body validation errors are
    400 naming the field as ``param``, as in OpenAI's API. A 4xx is logged in one INFO line
    (``stencil.service.errors.log_refused``), a 5xx as an error."""
    rid = request.scope.get("state", {}).get("request_id")
    status, message, param, code, headers = _openai_error_fields(request, exc, rid)
    if status >= 500:
        log.error("request failed with %d: %s", status, exc, exc_info=status == 500, extra={"request_id": rid})
    elif status >= 400:
        log_refused(request.method, request.url.path, status, param, message, rid)
    return openai_error(status, message, param, code, headers)


def _openai_error_fields(request: Request, exc: Exception,
                         rid: str | None) -> tuple[int, str, str | None, str | None, dict[str, str] | None]:
    """(status, message, param, code, headers) of an exception raised under ``/v1``."""
    if isinstance(exc, ExceptionGroup):  # a TaskGroup of n choices: report the first failure
        exc = exc.exceptions[0]
    if isinstance(exc, ToolError):
        return 400, str(exc), exc.param, None, None
    if isinstance(exc, ValidationException):
        extra = exc.extra if isinstance(exc.extra, list) else []
        items = [e for e in extra if isinstance(e, dict)]
        if not items and "malformed" in str(exc.detail).lower():
            return 400, f"the body is not valid JSON: {exc.detail}", None, None, None
        if len(items) == 1 and items[0].get("message") == "'data'":  # Litestar found no body to decode
            return 400, "the body is empty: send a JSON object", None, None, None
        details = "; ".join(f"{e.get('key') or 'body'}: {e.get('message', '')}" for e in items)
        return 400, f"{exc.detail}{': ' + details if details else ''}", invalid_field(items), None, None
    if client_left_during_body(exc):
        return 408, "the client left before sending the whole body", None, None, None
    if isinstance(exc, HTTPException) and not isinstance(exc, ServiceError):
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path} is not a route of this server: {message}"
        if isinstance(exc.__cause__, SerializationException):  # the body could not be decoded
            message = f"the body is not valid JSON: {message}"
        return exc.status_code, message, None, None, exc.headers
    state = service_state(request.app)
    problem, headers = to_problem(exc, rid, state.config.retry_after_s if state is not None else 1)
    param = _FIELD_PARAM.get(problem.field or "", problem.field)
    message = problem.detail if problem.path is None or problem.path in problem.detail else \
        f"{problem.detail} (at {problem.path})"
    return problem.status, message, param, problem.keyword, headers


def openai_temperature(value: float | None) -> float:
    """``temperature`` of an OpenAI request: 1 when absent (OpenAI's default).

    Raises:
        InputError: (field ``temperature``) outside OpenAI's 0..2.
    """
    if value is None:
        return 1.0
    if not 0 <= value <= MAX_TEMPERATURE:  # NaN fails too
        raise InputError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {value}", field="temperature")
    return value


def check_model(service: ServiceState, model: str | None) -> str:
    """The served model's id; ``NotFound`` (404, param ``model``) for any other."""
    if model is not None and model != service.model_name:
        raise NotFound(f"the model {model!r} does not exist; this server serves {service.model_name!r}",
                       field="model")
    return service.model_name


def refuse_unserved(data: Any, unserved: dict[str, tuple[Any, str]]) -> None:
    """400 naming the first field of ``unserved`` that ``data`` sets to a non-neutral value.

    Args:
        data: a decoded request Struct.
        unserved: field → (neutral values allowed, why it is not served).
    """
    for name, (neutral, why) in unserved.items():
        value = getattr(data, name)
        if value is None or value in neutral:
            continue
        raise InputError(f"{name} is not supported: {why}", field=name)


def logit_bias_ids(bias: dict[str, float] | None, vocab_size: int,
                   param: str = "logit_bias") -> dict[int, float] | None:
    """``{"1234": -100}`` (OpenAI's JSON form) → ``{1234: -100.0}``.

    Raises:
        InputError: a key that is not a token id of this model's vocabulary.
    """
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InputError(f"{param}: key {key!r} is not a token id", field=param) from None
        if not 0 <= token < vocab_size:
            raise InputError(f"{param}: token id {token} is not in this model's vocabulary (0..{vocab_size - 1})",
                             field=param)
        out[token] = float(value)
    return out


def vocab_size(service: ServiceState) -> int:
    return service.engine.vocab_size


# -- the constraint of an answer -----------------------------------------------------------------


@dataclass(slots=True)
class Constraint:
    """What an answer must be, and how it is checked afterwards.

    Attributes:
        spec: the grammar (``None``: unconstrained text).
        schema: the response format's JSON Schema (``None`` for text), checked with jsonschema.
        plan: the tool plan (inactive without tools).
        warnings: keywords relaxed in the tools' parameters (the response format's come with
            its compiled grammar, known once ``gen.start`` compiled it).
    """

    spec: GrammarSpec | None
    schema: Any
    plan: ToolPlan
    warnings: list[str] = field(default_factory=list)

    @property
    def constrained(self) -> bool:
        return self.spec is not None


async def constraint(service: ServiceState, schema: Any, strict: bool, plan: ToolPlan,
                     parameters_field: str = "tools[{i}].function.parameters",
                     format_field: str = "response_format") -> Constraint:
    """The grammar of a whole answer: the response format's schema, or the tool-call regex.

    Args:
        schema: the response format's JSON Schema, or ``None``.
        strict: the response format's ``strict`` (True: fail closed; False: relax and warn).
        plan: the tool plan; when active the grammar is ``stencil.grammar.tool_calls.tool_call_spec``
            (text answers in auto mode follow ``schema`` when given).
        parameters_field: where the request holds function ``i``'s parameters, for errors.
        format_field: where it holds the response format, for errors.

    Raises:
        InputError: a schema or parameters over the limits or invalid (``field`` and message
            name ``format_field`` or the tool's ``parameters_field``).
        stencil.grammar.base.GrammarError: a keyword of a strict schema that cannot be enforced.
    """
    if not plan.active:
        with named_as({"response_schema": format_field}):
            spec = await inputs.checked_grammar_spec(service, response_schema=schema, strict=strict)
        return Constraint(spec, schema, plan)
    for i, fn in enumerate(plan.functions):
        if fn.parameters is not None:
            with named_as({"response_schema": parameters_field.format(i=i)}):
                await inputs.check_schema_off_loop(service, fn.parameters)
    if schema is not None:
        with named_as({"response_schema": format_field}):
            await inputs.check_schema_off_loop(service, schema)
    # A large schema can take a while to translate; keep the event loop serving others.
    with grammar_field():
        spec, warnings = await asyncio.to_thread(tool_call_spec, plan.calls(parameters_field), schema,
                                                 text_strict=strict, text_field=format_field)
    return Constraint(spec, schema, plan, warnings)


@contextmanager
def grammar_field(name: str | None = None) -> Iterator[None]:
    """Turn a ``GrammarError`` raised inside into an ``InputError`` naming the request field
    ``name`` (``None``: the error's own ``field``; keyword and JSON pointer kept), so OpenAI
    clients see it as the error's ``param``."""
    try:
        yield
    except GrammarError as e:
        raise InputError(str(e), field=name or e.field, keyword=e.keyword, path=e.path,
                         position=e.position) from None


async def start_all(service: ServiceState, jobs: list[tuple[list[int], Any]], spec: GrammarSpec | None, rid: str,
                    format_field: str = "response_format", receive=None) -> list[gen.GenerationStream]:
    """Admit every choice (grammar compiled) before any runs, so a refusal (400/429) comes first,
    then wait for each to be scheduled (``GenerationStream.wait_started``: a request that waits
    past its deadline is a 429; ``receive`` notices a client leaving meanwhile); all or none:
    if one is refused, those already admitted are given up (``aclose``: on a cluster their
    replicas abort them) before the error is raised."""
    streams: list[gen.GenerationStream] = []
    with grammar_field(format_field):
        try:
            for k, (ids, p) in enumerate(jobs):
                streams.append(await gen.start(service, ids, p, spec, f"{rid}-{k}" if len(jobs) > 1 else rid, wait=False))
            for s in streams:
                await s.wait_started(receive)
        except BaseException:
            for st in streams:
                await st.aclose()
            raise
    return streams


def relaxed(c: Constraint, stream: gen.GenerationStream) -> list[str]:
    """Every keyword the grammar relaxes for this answer (tools' and response format's)."""
    return list(c.warnings) + [w for w in stream.warnings if w not in c.warnings]


def warnings_header(warnings: list[str]) -> dict[str, str]:
    """``X-Stencil-Warnings`` with the relaxed keywords (ASCII, ``" | "``-joined, capped).
    Control characters (a property name may hold CR / LF) are written as escapes, as non-ASCII
    ones are: a header value holds none (the server refused to send one that did, and the
    client got no answer at all)."""
    if not warnings:
        return {}
    text = " | ".join(warnings).encode("ascii", "backslashreplace").decode()
    text = _HEADER_CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return {WARNINGS_HEADER: text[:_MAX_HEADER_CHARS]}


_HEADER_CONTROLS = re.compile(r"[\x00-\x1f\x7f]")


def schema_errors(service: ServiceState, schema: Any, text: str) -> list[str]:
    """Why ``text`` fails ``schema`` (JSON, then jsonschema with formats); empty when it passes."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return [f"not valid JSON: {e}"]
    validator = service.checker.validator(json.dumps(schema, sort_keys=False, separators=(",", ":")))
    return [f"fails the schema at {_pointer(e.path)}: {e.message}"
            for e in sorted(validator.iter_errors(value), key=lambda e: list(e.path))[:5]]


def call_errors(service: ServiceState, plan: ToolPlan, name: str, arguments: str) -> list[str]:
    """Why a call's arguments fail its function's parameters (empty when they pass)."""
    fn = plan.function(name)
    if fn is None:
        return [f"calls unknown function {name!r}"]
    return [f"tool {name}: arguments {e}" for e in schema_errors(service, arguments_schema(fn), arguments)]


def _pointer(parts) -> str:
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


# -- logprobs ------------------------------------------------------------------------------------


def token_bytes(service: ServiceState, token_id: int) -> bytes:
    """The bytes a token stands for (the grammar's vocabulary; the tokenizer as a fallback)."""
    vocab = service.engine.vocab
    raw = vocab.token_bytes.get(token_id) if vocab is not None else None
    if raw is None:
        raw = service.engine.tokenizer.decode([token_id]).encode()
    return raw


def token_text(raw: bytes) -> str:
    """A token's text; part of a multi-byte character comes as OpenAI's ``bytes:\\x..`` form."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def token_logprobs(service: ServiceState, token_ids: list[int], logprobs: list[float] | None,
                   tops: list[list[tuple[int, float]]] | None) -> list[TokenLogprob] | None:
    """OpenAI's per-token logprob items (with ``top_logprobs`` when asked)."""
    if logprobs is None:
        return None
    items = []
    for k, (t, lp) in enumerate(zip(token_ids, logprobs)):
        raw = token_bytes(service, t)
        alternatives = []
        for alt, alt_lp in (tops[k] if tops and k < len(tops) else []):
            alt_raw = token_bytes(service, alt)
            alternatives.append(TopLogprob(token=token_text(alt_raw), logprob=alt_lp, bytes=list(alt_raw)))
        items.append(TokenLogprob(token=token_text(raw), logprob=lp, bytes=list(raw), top_logprobs=alternatives))
    return items


# -- running and streaming -----------------------------------------------------------------------


async def run_all(streams: list[gen.GenerationStream], base_id: str, receive) -> list[gen.GenerationResult]:
    """Run admitted requests to the end, together.

    A failure of one cancels the rest (raised as an ``ExceptionGroup``); the client hanging up
    (``http.disconnect`` on the ASGI ``receive``) aborts all and raises ``ClientDisconnected``.
    """
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


async def merged(streams: list[gen.GenerationStream]) -> AsyncIterator[tuple[int, Any]]:
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
SSE_HEADERS = {"Cache-Control": "no-cache", "Content-Type": "text/event-stream; charset=utf-8"}


# U+0085, U+2028 and U+2029 may stand raw in a JSON string, but Python's str.splitlines breaks
# lines at them, and so does httpx's iter_lines: a client reading a stream line by line that way
# would get an event cut in two (SSE itself breaks only at CR and LF). Their escapes decode to the
# same text. In UTF-8 these byte runs can only be those characters.
_LINE_BREAKS_BEYOND_SSE = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))
_EVENT_ENCODER = msgspec.json.Encoder()


def event_json(obj: Any) -> bytes:
    """``obj`` as one line of JSON (UTF-8) for an event's ``data:``: msgspec's encoding with the
    three line breaks that str.splitlines knows beyond CR and LF escaped."""
    data = _EVENT_ENCODER.encode(obj)
    if b"\xc2\x85" in data or b"\xe2\x80" in data:
        for raw, escaped in _LINE_BREAKS_BEYOND_SSE:
            data = data.replace(raw, escaped)
    return data


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (``event_json``), with an ``event:`` line
    when given."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + event_json(obj) + b"\n\n"


def error_fields(exc: BaseException) -> ErrorBody:
    """OpenAI's error body for an exception raised after a stream began."""
    problem, _ = to_problem(exc)
    return ErrorBody(message=problem.detail, type=ERROR_TYPES.get(problem.status, "server_error"),
                     param=_FIELD_PARAM.get(problem.field or "", problem.field), code=problem.keyword)


# -- the verdict on an answer --------------------------------------------------------------------


@dataclass(slots=True)
class Verdict:
    """A finished answer read back: text or calls, how it ended, whether it passed its checks.

    Attributes:
        text: the text answer (``None`` when the answer is calls).
        calls: the calls, arguments as the model wrote them (compact JSON).
        finish_reason: the engine's ("stop", "length"), or "tool_calls" for complete calls.
        valid: passed jsonschema (response format, or each call's parameters); ``None`` for
            unconstrained text.
        problems: why it is not valid, then the generation's own notes (the budget's narrowing,
            the run-on guard, a lowered ``max_tokens``): the choice's ``warnings``.
    """

    text: str | None
    calls: list[ParsedCall]
    finish_reason: str
    valid: bool | None
    problems: list[str]


def verdict(service: ServiceState, c: Constraint, r: gen.GenerationResult, relaxed_warnings: list[str]) -> Verdict:
    """Read a finished answer under its constraint (whole or streamed answers alike).

    Output cut short (``length``, or a stop string inside a call) comes back as plain text; with
    ``tool_choice: "auto"`` a text answer cut at ``max_tokens`` is judged as the text answer it is
    (no ``valid`` without a schema for text), a cut call as not valid.

    Raises:
        GenerationFailed: the arguments of a ``strict: true`` function fail their schema
            (a grammar defect: refuse rather than hand the client a bad call).
    """
    if not c.plan.active:
        if c.spec is None:
            return Verdict(r.text, [], r.finish_reason, None, [])
        problems = [w for w in r.warnings if w not in relaxed_warnings]
        return Verdict(r.text, [], r.finish_reason, r.valid, problems)
    auto = c.plan.mode == "auto"
    syntax = c.plan.syntax
    parsed = parse_answer(r.text, auto, syntax) if r.finish_reason == "stop" else None
    if parsed is None and auto and r.finish_reason == "length":
        cut = parse_answer(r.text, True, syntax)
        if cut is not None and not cut[1]:
            parsed = cut  # a text answer cut at max_tokens is still a text answer (any text is one)
    if parsed is None:
        why = "output was cut at max_tokens before it was complete" if r.finish_reason == "length" \
            else "output is not a complete answer"
        return Verdict(r.text, [], r.finish_reason, False, [why])
    text, calls = parsed
    # the generation's own notes (the budget's narrowing and where, the run-on guard, a lowered
    # max_tokens), as the response_format path above gives them: not problems of the answer
    notes = [w for w in r.warnings if w not in relaxed_warnings]
    if calls:
        problems = []
        for call in calls:
            errors = call_errors(service, c.plan, call.name, call.arguments)
            fn = c.plan.function(call.name)
            if errors and fn is not None and is_strict(fn):
                raise GenerationFailed(f"tool call arguments for {call.name!r} fail their schema although "
                                       f"it is strict: {errors[0]}")
            problems += errors
        return Verdict(None, calls, "tool_calls", not problems, problems + notes)
    if c.schema is None:
        return Verdict(text, [], r.finish_reason, None, notes)
    problems = schema_errors(service, c.schema, text or "")
    return Verdict(text, [], r.finish_reason, not problems, problems + notes)
