"""Service-level errors and the one place that turns any domain error into a problem.

Handlers raise; they never build error responses themselves. ``to_problem`` maps an exception
from the service, the grammar compiler or the engine to ``(Problem, headers)`` so that the
``/generate`` handlers (problem-details JSON) and the OpenAI-compatible routes (OpenAI's error
shape) report the same status and message for the same fault. ``named_as`` makes an error name
the field as the request spelled it; ``log_refused`` writes the one log line of a refused request.
For a newcomer's first mistakes: ``unknown_field_hint`` names the field Stencil takes where a body
sends another server's (``response_format`` on ``/generate``, vLLM's ``guided_json`` on ``/v1``) or a
misspelt one; ``wrong_method`` turns ``GET /generate`` into a 405 saying how to call the route.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from stencil.engine.async_engine import EngineDeadError
from stencil.engine.llm_engine import EngineError, EngineOverloaded
from stencil.grammar.base import GrammarError, GrammarTimeout
from stencil.schemas.common import Problem

log = logging.getLogger("stencil.errors")
_LOGGED_MESSAGE_CHARS = 200


class ServiceError(Exception):
    """Base of the errors the service raises on purpose; ``status`` is the HTTP status."""

    status = 500
    title = "Internal Server Error"

    def __init__(self, detail: str, *, field: str | None = None, keyword: str | None = None,
                 path: str | None = None, position: int | None = None, lead: bool = False):
        super().__init__(detail)
        self.detail = detail
        self.field = field
        # the detail begins with the field's name: a request that calls the field otherwise gets
        # its own name there (``named_as``), the rest of the message untouched
        self.lead = lead and field is not None and detail.startswith(field)
        self.keyword = keyword
        self.path = path
        self.position = position


class InputError(ServiceError):
    """The request is well-formed but asks for something invalid (bad schema, prompt too long)."""

    status = 400
    title = "Bad Request"


class Unauthorized(ServiceError):
    """Missing or wrong API key."""

    status = 401
    title = "Unauthorized"


class PayloadTooLarge(ServiceError):
    """The request body exceeds the configured limit."""

    status = 413
    title = "Payload Too Large"


class Overloaded(ServiceError):
    """Too many requests are waiting; retry after ``retry_after`` seconds."""

    status = 429
    title = "Too Many Requests"

    def __init__(self, detail: str, retry_after: int = 1):
        super().__init__(detail)
        self.retry_after = retry_after


class QueueTimeout(Overloaded):
    """The request waited past its deadline without a running slot: it was taken off the queue
    (never started, nothing was generated); retry after ``retry_after`` seconds. A 429, like
    any refusal for load: the server was too busy, the request itself is fine."""


class Unavailable(ServiceError):
    """The service is draining for shutdown or its engine is dead."""

    status = 503
    title = "Service Unavailable"


class GenerationTimeout(ServiceError):
    """The request ran past the configured deadline; it was aborted in the engine."""

    status = 504
    title = "Gateway Timeout"


class ClientDisconnected(ServiceError):
    """The client went away before the answer was ready; the request was aborted.

    499 is nginx's "client closed request": nobody reads this response, the status is for logs
    and metrics.
    """

    status = 499
    title = "Client Closed Request"


class MethodNotAllowed(ServiceError):
    """The route exists but not for this method; ``allow`` lists the methods it takes."""

    status = 405
    title = "Method Not Allowed"

    def __init__(self, detail: str, allow: str):
        super().__init__(detail)
        self.allow = allow


class GenerationFailed(ServiceError):
    """The engine reported an error for this request alone (the batch went on)."""

    status = 500
    title = "Internal Server Error"


def to_problem(exc: BaseException, request_id: str | None = None,
               retry_after: int = 1) -> tuple[Problem, dict[str, str]]:
    """Map an exception to a problem-details body and extra response headers.

    Args:
        exc: any exception raised while serving a request.
        request_id: the id the request was logged under (echoed in the body).
        retry_after: seconds suggested to a client refused for overload.

    Returns:
        ``(problem, headers)``; unknown exceptions become a 500 whose detail names only the
        request id, so internal messages never leak to clients.
    """
    headers: dict[str, str] = {}
    if isinstance(exc, ServiceError):
        if isinstance(exc, Overloaded):
            headers["Retry-After"] = str(exc.retry_after)
        if isinstance(exc, Unauthorized):
            headers["WWW-Authenticate"] = "Bearer"
        if isinstance(exc, MethodNotAllowed):
            headers["Allow"] = exc.allow
        p = Problem(title=exc.title, status=exc.status, detail=exc.detail, field=exc.field,
                    keyword=exc.keyword, path=exc.path, position=exc.position)
    elif isinstance(exc, GrammarTimeout):
        p = Problem(title="Bad Request", status=400, detail=f"grammar compile timed out: {exc}",
                    keyword=exc.keyword, path=exc.path, position=exc.position, field=exc.field)
    elif isinstance(exc, GrammarError):
        p = Problem(title="Bad Request", status=400, detail=str(exc), keyword=exc.keyword,
                    path=exc.path, position=exc.position, line=exc.line, column=exc.column,
                    field=exc.field or ("grammar" if exc.line is not None else None))
    elif isinstance(exc, EngineOverloaded):
        headers["Retry-After"] = str(retry_after)
        p = Problem(title="Too Many Requests", status=429, detail=str(exc))
    elif isinstance(exc, EngineError):
        p = Problem(title="Bad Request", status=400, detail=str(exc), field=getattr(exc, "field", None))
    elif isinstance(exc, EngineDeadError):
        p = Problem(title="Service Unavailable", status=503, detail=str(exc))
    elif isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        p = Problem(title="Gateway Timeout", status=504, detail="the request timed out")
    elif isinstance(exc, UnicodeDecodeError):
        # Raised while the framework decodes the body: bytes the client sent, not our fault.
        p = Problem(title="Bad Request", status=400,
                    detail=f"the body is not valid UTF-8 ({exc.reason} at byte {exc.start})")
    elif isinstance(exc, RecursionError) and "deserializ" in str(exc):
        # msgspec's decoder refuses nesting deeper than its recursion limit.
        p = Problem(title="Bad Request", status=400, detail="the body nests JSON too deeply to decode")
    else:
        p = Problem(title="Internal Server Error", status=500,
                    detail=f"internal error; see the server log for request {request_id}")
    p.request_id = request_id
    return p, headers


@contextmanager
def named_as(names: dict[str, str]) -> Iterator[None]:
    """Errors raised inside name the request's own fields rather than the generation core's.

    The core speaks of ``prompt``, ``max_tokens`` and ``response_schema``; a chat request sent
    ``messages`` and ``max_completion_tokens``, a Responses request ``input`` and ``text.format``.

    Args:
        names: core field → the request's field.

    Raises:
        InputError: for an ``InputError`` or ``EngineError`` whose ``field`` is a key of
            ``names``: the same fault naming the request's field, in ``field`` and, where the
            error says its message begins with the field's name (``lead``), there ("max_tokens is
            10^9; ..." → "max_completion_tokens is 10^9; ..."); the message is never searched.
            Every other exception passes unchanged.
    """
    try:
        yield
    except (InputError, EngineError) as e:
        new = names.get(e.field or "")
        if new is None:
            raise
        message = e.detail if isinstance(e, InputError) else str(e)
        if e.lead:
            message = new + message[len(e.field):]
        raise InputError(message, field=new, keyword=getattr(e, "keyword", None), path=getattr(e, "path", None),
                         position=getattr(e, "position", None), lead=e.lead) from None


def client_left_during_body(exc: BaseException) -> bool:
    """Whether ``exc`` is Litestar's 500 for a body that never ended because the client left (or
    ``stencil.service.http_limits`` timed the body out): no server fault, and nobody reads the answer."""
    return (getattr(exc, "status_code", None) == 500 and not isinstance(exc, ServiceError)
            and str(getattr(exc, "detail", "")) == "client disconnected prematurely")


def log_refused(method: str, path: str, status: int, field: str | None, message: str,
                request_id: str | None) -> None:
    """One INFO line for a request answered with a 4xx: method, path, status, field and the
    message (each cut at 200 characters: both may quote the client); never the body."""
    log.info("refused %s %s with %d%s: %s", method, path, status, f" ({_cut(field)})" if field else "",
             _cut(message), extra={"request_id": request_id})


def _cut(text: str) -> str:
    return text if len(text) <= _LOGGED_MESSAGE_CHARS else text[:_LOGGED_MESSAGE_CHARS - 3] + "..."


# -- a newcomer's first mistakes -------------------------------------------------------------------

# Fields other servers take (OpenAI, vLLM's guided_*, llama.cpp, Ollama, TGI) → where Stencil takes the
# same thing, in order: the first whose top field the refusing body has is named (``/generate`` has
# response_schema, chat and completions structured_outputs and response_format, /v1/responses text).
FOREIGN_FIELDS: dict[str, tuple[str, ...]] = {
    "response_format": ("response_schema", "text.format"),
    "response_schema": ("response_format", "text.format"),
    "schema": ("response_schema", "response_format", "text.format"),
    "json_schema": ("response_schema", "response_format", "text.format"),
    "format": ("response_schema", "response_format", "text.format"),
    "guided_json": ("response_schema", "structured_outputs.json", "text.format"),
    "guided_regex": ("regex", "structured_outputs.regex"),
    "regex": ("structured_outputs.regex",),
    "pattern": ("regex", "structured_outputs.regex"),
    "guided_choice": ("choice", "structured_outputs.choice"),
    "choice": ("structured_outputs.choice",),
    "guided_grammar": ("grammar", "structured_outputs.grammar"),
    "grammar": ("structured_outputs.grammar",),
    "max_new_tokens": ("max_tokens", "max_output_tokens"),
    "n_predict": ("max_tokens", "max_output_tokens"),
    "max_completion_tokens": ("max_tokens", "max_output_tokens"),
    "max_tokens": ("max_output_tokens",),
    "inputs": ("prompt", "input"),
}
# What the named field takes, where its value is not the foreign field's as it stands.
_TAKES = {
    "response_schema": "the JSON Schema itself",
    "response_format": '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
    "text.format": '{"type": "json_schema", "name": ..., "schema": {...}}',
    "structured_outputs.json": "the JSON Schema itself",
    "grammar": '{"lark": "..."}',
    "structured_outputs.grammar": "the Lark grammar text",
}
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_PATH_PART = re.compile(r"\[\d+\]|[^.\[\]]+")


def unknown_field_hint(message: str, at: str, body_type: Any) -> str:
    """What to add to msgspec's "unknown field" message: ``"; did you mean `response_schema`?"``.

    Args:
        message: msgspec's message (``"Object contains unknown field `schema`"``); any other
            message gets no hint.
        at: where the object is in the body (``""``: the top, ``"messages[0]"``).
        body_type: the msgspec type the whole body decodes to (its fields are the known names).

    Returns:
        ``""`` when there is nothing to suggest, else the hint: a field from ``FOREIGN_FIELDS``
        the body has (with what it takes, where that differs), else the nearest known field
        (``difflib``).
    """
    named = _UNKNOWN.search(message)
    fields = _fields_at(body_type, at) if named else ()
    if not fields:
        return ""
    name = named.group(1)
    for target in FOREIGN_FIELDS.get(name, ()) if not at else ():
        if target.split(".")[0] in fields:
            takes = _TAKES.get(target)
            return f"; did you mean `{target}`?" + (f" (it takes {takes})" if takes else "")
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def _fields_at(body_type: Any, at: str) -> tuple[str, ...]:
    """The field names (as sent) of the Struct at path ``at`` of ``body_type``; empty where the
    path leads to no Struct."""
    try:
        info = msgspec.inspect.type_info(body_type)
    except Exception:  # noqa: BLE001 - a type msgspec cannot describe: no hint, the error stands
        return ()
    for part in _PATH_PART.findall(at):
        info = _struct_or_list(info)
        if part.startswith("["):
            info = info.item_type if isinstance(info, msgspec.inspect.ListType) else None
        elif isinstance(info, msgspec.inspect.StructType):
            info = next((f.type for f in info.fields if f.encode_name == part), None)
        else:
            info = None
        if info is None:
            return ()
    info = _struct_or_list(info)
    return tuple(f.encode_name for f in info.fields) if isinstance(info, msgspec.inspect.StructType) else ()


def _struct_or_list(info):
    """The Struct (or list) member of an optional or union type; the type itself otherwise."""
    if isinstance(info, msgspec.inspect.UnionType):
        return next((t for t in info.types
                     if isinstance(t, (msgspec.inspect.StructType, msgspec.inspect.ListType))), None)
    return info


# What to send to each POST route, said when it is asked with another method.
_HOW = {"/generate": "POST /generate with a JSON body such as {\"prompt\": \"...\", \"response_schema\": {...}}",
        "/v1/chat/completions": "POST /v1/chat/completions with an OpenAI chat body {\"model\": ..., \"messages\": [...]}",
        "/v1/completions": "POST /v1/completions with an OpenAI completions body {\"model\": ..., \"prompt\": ...}",
        "/v1/responses": "POST /v1/responses with an OpenAI Responses body {\"model\": ..., \"input\": ...}"}


def wrong_method(method: str, path: str, allow: str) -> MethodNotAllowed:
    """The 405 for ``method path`` where the route takes only ``allow`` (Litestar's ``Allow``
    header, ``"POST, OPTIONS"``): the detail names the route, the method to use and, for the
    generation routes, the body to send, and points at the API documentation (``/schema``)."""
    methods = [m.strip() for m in allow.split(",") if m.strip() and m.strip() != "OPTIONS"] or ["POST"]
    how = _HOW.get(path.rstrip("/")) if methods == ["POST"] else None
    use = how or f"{' or '.join(methods)} {path}"
    return MethodNotAllowed(f"{path} does not take {method}: use {use}; every route is documented at /schema", allow=allow)
