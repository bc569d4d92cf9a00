"""The Litestar application: lifespan owning the engine, DI of the service state, error mapping.

``create_app(engine_config_or_engine, service_config)`` builds the app. The lifespan loads the
model off the event loop, starts the engine thread, and on shutdown stops admitting (503),
lets in-flight requests finish within ``shutdown_grace_s``, then stops the engine. Handlers get
``service: ServiceState`` by dependency injection. Every domain error becomes an RFC 9457
problem (``application/problem+json``) in one place, ``_problem_response``.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import HTTPException, MethodNotAllowedException, SerializationException, ValidationException
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.background_tasks import BackgroundTask
from litestar.response import ServerSentEvent

from stencil.engine.async_engine import AsyncEngine, EngineDeadError
from stencil.engine.config import EngineConfig
from stencil.engine.llm_engine import EngineError, EngineOverloaded
from stencil.grammar.base import GrammarError
from stencil.schemas.common import Problem
from stencil.schemas.generate import (GenerateRequest, GenerateResponse, HealthResponse, StreamDelta, StreamError,
                              StreamFinal)
from stencil.service import generation, inputs, reasoning, reasoning_formats, tool_formats
from stencil.service.errors import (InputError, ServiceError, Unauthorized, Unavailable, client_left_during_body,
                            log_refused, named_as, to_problem, wrong_method)
from stencil.service.metrics import Metrics
from stencil.service.openai_api import openai_route_handlers
from stencil.service.openai_common import event_json, openai_exception_handler
from stencil.service.prompts import check_template_renders
from stencil.service.openapi_docs import StreamableOperation, StrictStructSchemaPlugin, error_responses
from stencil.service.responses_api import responses_route_handlers
from stencil.service.state import STATE_KEY, ServiceConfig, ServiceState, StateHolder, service_state
from stencil.service.validation import OutputChecker
from stencil.service.wire import invalid_field, strict_body

log = logging.getLogger("stencil.app")

PROBLEM_JSON = "application/problem+json"
_PUBLIC = ("/health", "/metrics", "/schema")  # reachable without the API key
_ERROR_RESPONSES = error_responses(Problem, PROBLEM_JSON, (400, 401, 413, 415, 422, 429, 503, 504, 500))


def _request_id(connection: ASGIConnection) -> str:
    return connection.scope.setdefault("state", {}).setdefault("request_id", "req-" + uuid.uuid4().hex)


# -- errors ----------------------------------------------------------------------------------------

def _problem_response(request: Request, exc: Exception) -> Response:
    if request.url.path == "/v1" or request.url.path.startswith("/v1/"):
        # Errors met before a /v1 route is found (404, 405) still speak OpenAI's shape.
        return openai_exception_handler(request, exc)
    rid = _request_id(request)
    holder: StateHolder = request.app.state[STATE_KEY]
    retry = holder.state.config.retry_after_s if holder.state else 1
    if isinstance(exc, ValidationException):
        problem, headers = _validation_problem(exc), {}
        problem.request_id = rid
    elif client_left_during_body(exc):
        # Litestar says 500, but the client left (or ``stencil.service.http_limits`` timed its body out):
        # nobody will read this answer, and it is no server fault.
        problem = Problem(title="Request Timeout", status=408, detail="the client left before sending the whole body",
                          request_id=rid)
        headers = {}
    elif isinstance(exc, HTTPException) and not isinstance(exc, ServiceError):
        detail = str(exc.detail)
        if isinstance(exc.__cause__, SerializationException):  # the body could not be decoded
            detail = f"the body is not valid JSON: {detail}"
        problem = Problem(title=_TITLES.get(exc.status_code, "Error"), status=exc.status_code,
                          detail=detail, request_id=rid)
        headers = dict(exc.headers or {})
    else:
        problem, headers = to_problem(exc, rid, retry)
    if problem.status >= 500:
        log.error("request failed with %d: %s", problem.status, exc, exc_info=problem.status == 500,
                  extra={"request_id": rid})
    elif problem.status >= 400:
        log_refused(request.method, request.url.path, problem.status, problem.field, problem.detail or "", rid)
    return Response(content=problem, status_code=problem.status, media_type=PROBLEM_JSON,
                    headers={**headers, "X-Request-Id": rid})


def _wrong_method_response(request: Request, exc: MethodNotAllowedException) -> Response:
    allow = str((exc.headers or {}).get("allow") or "")
    return _problem_response(request, wrong_method(request.method, request.url.path, allow))


_TITLES = {400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
           413: "Payload Too Large", 415: "Unsupported Media Type", 422: "Unprocessable Content",
           429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}

def _validation_problem(exc: ValidationException) -> Problem:
    """422 naming the field msgspec rejected; 400 when the body is not JSON at all.

    Litestar puts ``{"message": ..., "key": "max_tokens"}`` items in ``exc.extra``; the key is
    the body field (``data.`` prefix removed) and is the most useful thing to tell a client.
    """
    extra = exc.extra if isinstance(exc.extra, list) else []
    items = [e for e in extra if isinstance(e, dict)]
    if not items:
        text = str(exc.detail)
        if "malformed" in text.lower():
            return Problem(title="Bad Request", status=400, detail=f"the body is not valid JSON: {text}")
        return Problem(title="Unprocessable Content", status=422, detail=text)
    if len(items) == 1 and items[0].get("message") == "'data'":  # Litestar found no body to decode
        return Problem(title="Bad Request", status=400, detail="the body is empty: send a JSON object")
    messages = [f"{e['key']}: {e.get('message')}" if e.get("key") and e.get("key") != "data" else str(e.get("message"))
                for e in items]
    return Problem(title="Unprocessable Content", status=422, detail="; ".join(messages), field=invalid_field(items))


# -- auth and metrics middleware -------------------------------------------------------------------

def _api_key_guard(holder: StateHolder) -> Callable:
    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        key = holder.state.config.api_key if holder.state else None
        if not key or connection.scope["path"].startswith(_PUBLIC):
            return
        given = connection.headers.get("x-api-key") or ""
        auth = connection.headers.get("authorization") or ""
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise Unauthorized("missing or wrong API key (send 'Authorization: Bearer <key>')")
    return guard


def _observe_middleware(holder: StateHolder, known: Callable[[], set[str]]):
    """ASGI middleware: request id per HTTP request, ``X-Request-Id`` header, status counts (499
    for a response whose body never ended: a stream the client dropped)."""
    def factory(app):
        async def middleware(scope, receive, send):
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            rid = _request_id(_ScopeView(scope))
            status = {"code": 500, "started": False, "ended": False}

            async def send_wrapper(message):
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    status["ended"] = True
                if message["type"] == "http.response.start":
                    status["started"] = True
                    status["code"] = message["status"]
                    headers = list(message.get("headers", []))
                    if not any(k.lower() == b"x-request-id" for k, _ in headers):
                        headers.append((b"x-request-id", rid.encode()))
                    message = {**message, "headers": headers}
                await send(message)

            try:
                await app(scope, receive, send_wrapper)
            finally:
                if holder.state is not None:
                    path = scope["path"]
                    endpoint = path if path in known() else "other"
                    # A response begun but never ended: the client left mid-stream (nginx's 499),
                    # not the 200 its headers said.
                    code = 499 if status["started"] and not status["ended"] else status["code"]
                    holder.state.metrics.requests.labels(endpoint, str(code)).inc()
        return middleware
    return factory


class _ScopeView:
    __slots__ = ("scope",)

    def __init__(self, scope) -> None:
        self.scope = scope


# -- handlers --------------------------------------------------------------------------------------

def _response_of(result: generation.GenerationResult, notes: list[str] = ()) -> GenerateResponse:
    return GenerateResponse(id=result.id, text=result.text, output=result.output, valid=result.valid,
                            finish_reason=result.finish_reason, usage=result.usage, timings=result.timings,
                            warnings=[*notes, *result.warnings], logprobs=result.logprobs,
                            closed_by_budget=result.closed_by_budget, shortened=result.shortened,
                            truncated_value=result.truncated_value, reasoning=result.reasoning)


async def _sse_events(gen: generation.GenerationStream, rid: str, notes: list[str] = ()) -> AsyncIterator[str]:
    """``data:`` payloads: deltas, then the final fields (or an error), then ``[DONE]``;
    ``notes``: the request's own warnings, with the final's."""
    try:
        async for item in gen:
            if isinstance(item, generation.GenerationDelta):
                if item.text or item.logprobs or item.reasoning:
                    yield event_json(StreamDelta(text=item.text, logprobs=item.logprobs,
                                                 reasoning=item.reasoning or None)).decode()
            else:
                yield event_json(StreamFinal(id=item.id, output=item.output, valid=item.valid,
                                                  finish_reason=item.finish_reason, usage=item.usage,
                                                  timings=item.timings, warnings=[*notes, *item.warnings],
                                                  closed_by_budget=item.closed_by_budget,
                                                  shortened=item.shortened,
                                                  truncated_value=item.truncated_value)).decode()
    except (ServiceError, EngineError, EngineOverloaded, EngineDeadError, GrammarError) as e:
        problem, _ = to_problem(e, rid)
        yield event_json(StreamError(error=problem)).decode()
    except Exception as e:  # noqa: BLE001 - headers are sent; the client must still learn it failed
        log.exception("stream failed", extra={"request_id": rid})
        problem, _ = to_problem(e, rid)
        yield event_json(StreamError(error=problem)).decode()
    yield "[DONE]"


@post("/generate", status_code=200, responses=_ERROR_RESPONSES, operation_class=StreamableOperation,
      guards=[strict_body(GenerateRequest)],
      summary="Generate text, constrained or not",
      description="JSON answer, or server-sent events with `\"stream\": true` (text deltas, a final event "
                  "with output/valid/finish_reason/usage, then `[DONE]`).")
async def generate_handler(data: GenerateRequest, service: ServiceState, request: Request) -> GenerateResponse:
    arrival = time.perf_counter()
    rid = _request_id(request)
    cfg = service.config
    messages = [{"role": m.role, "content": m.content} for m in data.messages] if data.messages is not None else None
    if data.parse_special_tokens and data.prompt is None:
        raise InputError("parse_special_tokens applies to a plain 'prompt'; message content is always plain text",
                         field="parse_special_tokens")
    if messages is None and (data.chat_template_kwargs is not None or data.reasoning_effort is not None):
        field = "chat_template_kwargs" if data.chat_template_kwargs is not None else "reasoning_effort"
        raise InputError(f"{field} applies to messages (a plain prompt has no chat template)", field=field)
    thinking = reasoning.plan(service, data.reasoning_effort, data.chat_template_kwargs) \
        if messages is not None else reasoning.ReasoningPlan(None)
    prompt_ids = await inputs.tokenize(service, prompt=data.prompt, messages=messages,
                                           parse_special_tokens=data.parse_special_tokens,
                                           template_kwargs=thinking.kwargs)
    params = inputs.sampling_params(cfg, **inputs.sampling_fields(data),
                                    reasoning=thinking.params(service.engine.tokenizer, prompt_ids))
    spec = await inputs.checked_grammar_spec(service, response_schema=data.response_schema, regex=data.regex,
                                                 choice=data.choice, whitespace=data.whitespace, strict=data.strict,
                                                 additional_properties=data.additional_properties,
                                                 grammar=data.grammar.lark if data.grammar is not None else None)
    with named_as({"prompt": "messages"} if messages is not None else {}):  # the engine says "prompt"
        gen = await generation.start(service, prompt_ids, params, spec, rid, arrival, data.grammar_backend,
                                     generation.client_id(request.headers, request.client), receive=request.receive,
                                     queue_timeout_s=data.queue_timeout)
    if data.stream:
        # The content-type header is explicit: for streams Litestar prefers the route's JSON media type.
        headers = {"cache-control": "no-cache", "content-type": "text/event-stream; charset=utf-8"}
        if gen.replica is not None:  # on a cluster: which replica admitted it
            headers["x-stencil-replica"] = gen.replica
        return ServerSentEvent(_sse_events(gen, rid, thinking.warnings), headers=headers,  # type: ignore[return-value]
                               background=BackgroundTask(generation.close_streams, [gen]))
    body = _response_of(await generation.collect(gen, request.receive), thinking.warnings)
    if gen.replica is not None:
        return Response(body, headers={"x-stencil-replica": gen.replica})  # type: ignore[return-value]
    return body


@get("/health", responses={503: ResponseSpec(HealthResponse, description="draining or engine dead")},
     summary="Engine liveness and statistics")
async def health_handler(service: ServiceState) -> Response[HealthResponse]:
    eng = service.engine
    stats = eng.stats()
    # A cluster ingress (stencil.service.cluster) reports each replica; it is dead when none is up.
    replicas = eng.replica_health()
    if not eng.is_alive or (replicas is not None and not any(r.get("status") == "ok" for r in replicas)):
        status, code = "dead", 503
    elif service.draining:
        status, code = "draining", 503
    else:
        status, code = "ok", 200
    body = HealthResponse(status=status, model=service.model_name, inflight=service.inflight, engine=stats,
                          kernels=eng.kernels, replicas=replicas,
                          error=repr(eng.error) if eng.error is not None else None)
    return Response(body, status_code=code)


@get("/metrics", media_type="text/plain", summary="Prometheus metrics", include_in_schema=True)
async def metrics_handler(service: ServiceState) -> Response[bytes]:
    body, ctype = service.metrics.render()
    return Response(body, media_type=ctype)


def stop_engine(aeng: AsyncEngine) -> None:
    """Stop the engine thread and the grammar compiler's pool (``shutdown`` does both; never
    raises: shutdown must finish)."""
    try:
        aeng.shutdown()
    except Exception:  # noqa: BLE001
        log.exception("engine shutdown failed")


# -- the factory -----------------------------------------------------------------------------------

def _provide_openai_state(request: Request) -> ServiceState:
    st = service_state(request.app)
    if st is None:
        raise Unavailable("the engine is not started")
    return st


_OPENAI_ROUTER: Router | None = None


def _openai_router() -> Router:
    """The ``/v1`` routes (chat completions, completions, models, responses), their state
    injected as ``service`` like every route's (the router's own provider reads it from the
    request's app, since one router serves every app) and their errors in OpenAI's shape. Built
    once; every app shares it.

    Litestar merges exception handlers over app, router and handler and picks one by status
    code, then by the exception's MRO: the router's ``Exception`` handler wins while the app maps
    nothing more specific (``create_app`` maps ``Exception`` alone).
    """
    global _OPENAI_ROUTER
    if _OPENAI_ROUTER is None:
        _OPENAI_ROUTER = Router(path="/v1", route_handlers=[*openai_route_handlers, *responses_route_handlers],
                                dependencies={"service": Provide(_provide_openai_state, sync_to_thread=False)},
                                exception_handlers={Exception: openai_exception_handler}, tags=["openai"])
    return _OPENAI_ROUTER


def create_app(engine: EngineConfig | AsyncEngine | Any, config: ServiceConfig | None = None, *,
               route_handlers: Sequence = (), include_openai: bool = True,
               on_engine_dead: Callable[[BaseException], None] | None = None,
               freeze_heap: bool = False) -> Litestar:
    """Build the Stencil app.

    Args:
        engine: an ``EngineConfig`` (the model is loaded at startup, off the event loop), an
            ``AsyncEngine`` (started at startup), a ``stencil.service.cluster.cluster_engine.ClusterEngine``
            (the Ray Serve ingress: replicas do the generating), or any other
            ``stencil.service.engine_client.EngineClient``. Either way the app owns it and shuts it down.
        config: service limits; ``None`` = defaults (API key from ``STENCIL_API_KEY``).
        route_handlers: more routes; they can ask for ``service: ServiceState`` and raise the
            errors ``stencil.service.errors.to_problem`` knows.
        include_openai: also serve the OpenAI-compatible ``/v1`` routes (``stencil.service.openai_api``).
        on_engine_dead: called (on the engine thread) with the exception if the engine loop
            dies; the CLI uses it to make the server exit non-zero.
        freeze_heap: once the engine is up, move every object alive into the collector's
            permanent generation (``gc.freeze``), so full collections scan only what requests
            made. For a process that serves one app for its life (``stencil serve``); a process
            that builds many apps (tests) would keep their cyclic garbage for ever.

    Returns:
        A Litestar app serving ``POST /generate``, ``GET /health``, ``GET /metrics``, the
        ``/v1`` routes and the OpenAPI schema at ``/schema/openapi.json``.
    """
    cfg = (config or ServiceConfig()).validate()
    holder = StateHolder()

    @asynccontextmanager
    async def lifespan(app: Litestar):
        aeng = await asyncio.to_thread(AsyncEngine, engine) if isinstance(engine, EngineConfig) else engine

        def dead(exc: BaseException) -> None:
            log.critical("engine loop died: %r; failing in-flight requests", exc)
            if on_engine_dead is not None:
                on_engine_dead(exc)

        aeng.on_dead = dead
        aeng.start()
        if cfg.chat_template is not None:  # (parsed by ServiceConfig.validate)
            aeng.tokenizer.chat_template = cfg.chat_template
            try:
                check_template_renders(aeng.tokenizer)
            except Exception:
                await asyncio.to_thread(stop_engine, aeng)
                raise
        from stencil.engine.models.source import ModelPathError, resolve_model_path

        try:  # a GGUF file's stem, or the directory's name
            default_name = resolve_model_path(aeng.model_path).name
        except ModelPathError:
            default_name = Path(aeng.model_path).name
        model_name = cfg.model_name or default_name
        fmt = reasoning_formats.resolve(cfg.reasoning_format, getattr(aeng.tokenizer, "chat_template", None))
        tool_format, tool_format_known = tool_formats.resolve(cfg.tool_call_format,
                                                              getattr(aeng.tokenizer, "chat_template", None))
        holder.state = ServiceState(engine=aeng, config=cfg, metrics=Metrics(lambda: aeng),
                                    checker=OutputChecker(), model_name=model_name, reasoning=fmt,
                                    tool_format=tool_format)
        # With freeze_heap, what loading left (tokenizer tables, vocabularies, modules: ~363k
        # objects with the default model) lives as long as the server: out of the collector's
        # sight, so a full collection scans only what requests made. Measured on the loaded
        # default model: a full gc.collect() took 185-203 ms (holding the GIL: event loop and
        # engine loop both stood still), 0 ms after the freeze; under 2,000 soak clients
        # /health's p99 showed those pauses.
        if freeze_heap:
            gc.collect()
            gc.freeze()
        if not getattr(aeng.tokenizer, "chat_template", None):
            log.info("serving %s: a model without a chat template (a base model): prompts only (/generate's "
                     "prompt, /v1/completions); chat requests get a 400 (give it one with --chat-template)",
                     model_name)
        else:
            log.info("serving %s (reasoning format: %s%s)", model_name, fmt.name if fmt else "none",
                     ", detected from its chat template" if cfg.reasoning_format in (None, reasoning_formats.AUTO)
                     else "")
            log.info("tool calls in the %s format (%s)", tool_format.name,
                     "as configured" if cfg.tool_call_format not in (None, tool_formats.AUTO)
                     else "detected from the chat template" if tool_format_known
                     else "the chat template shows no tool-call syntax Stencil knows: Hermes' <tool_call> blocks")
        try:
            yield
        finally:
            state = holder.state
            state.draining = True
            deadline = time.monotonic() + cfg.shutdown_grace_s
            while state.inflight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if state.inflight:
                log.warning("shutdown: aborting %d in-flight requests after %.0f s", state.inflight,
                            cfg.shutdown_grace_s)
            await asyncio.to_thread(stop_engine, aeng)

    def provide_state() -> ServiceState:
        if holder.state is None:
            raise EngineDeadError("the engine is not started")
        return holder.state

    handlers = [generate_handler, health_handler, metrics_handler, *route_handlers]
    if include_openai:
        handlers.append(_openai_router())
    known_paths: set[str] = set()

    app = Litestar(
        route_handlers=handlers,
        lifespan=[lifespan],
        dependencies={"service": Provide(provide_state, sync_to_thread=False)},
        exception_handlers={Exception: _problem_response, MethodNotAllowedException: _wrong_method_response},
        guards=[_api_key_guard(holder)],
        middleware=[_observe_middleware(holder, lambda: known_paths)],
        request_max_body_size=cfg.max_body_bytes,
        logging_config=None,  # the CLI configures logging (structured, with request ids)
        plugins=[StrictStructSchemaPlugin()],  # the document says which bodies refuse unknown fields
        openapi_config=OpenAPIConfig(title="Stencil", version="0.1.0",
                                     description="Structured generation: JSON that matches your schema."),
        state=State({STATE_KEY: holder}),
    )
    known_paths.update(r.path for r in app.routes)
    return app
