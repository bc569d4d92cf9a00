"""Service-level errors and the one place that turns any domain error into a problem.

Handlers raise; they never build error responses themselves. ``to_problem`` maps an exception
from the service, the grammar compiler or the engine to ``(Problem, headers)`` so that the
``/generate`` handlers (problem-details JSON) and the OpenAI-compatible routes (OpenAI's error
shape) report the same status and message for the same fault. ``named_as`` makes an error name
the field as the request spelled it; ``log_refused`` writes the one log line of a refused request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager

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
