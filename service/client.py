"""Stencil's Python client: typed extraction, raw generation and streaming over ``POST /generate``.

Depends only on httpx and msgspec (pydantic is used when, and only when, a pydantic model is
passed in), and imports nothing of the server: ``pip install httpx msgspec`` and ``pip install
--no-deps`` of this package are enough (docs/api.md, "The typed client"; ``tests/service/test_client_light.py``). ``stream_extract`` yields typed partial answers as they stream (``Partial``: the
fields complete so far, the values complete at any depth, and the one being written), then the
validated instance; ``extract_iter`` yields the items of one list of the answer, typed, each as soon
as it has ended in the stream. ``Client`` is
synchronous, ``AsyncClient`` the asyncio twin; both share the request building, schema
derivation, retry timing and answer decoding defined here.

    client = Client("http://127.0.0.1:8000")
    person = client.extract(Person, "Ada Lovelace, 36, London")   # -> Person instance
    for item in client.stream_extract(Person, "Ada Lovelace, 36, London"):
        ...   # Partial(done={"name": "Ada Lovelace"}, writing="age"), ..., then a Person
    for line in client.extract_iter(Invoice, text, items="lines"):
        ...   # each Invoice.lines[i], a Line, once its closing brace has streamed

Validation and batches: ``extract(tp, text, validate=fn, max_retries=N)`` re-asks an answer that
fails validation (the type's own checks, pydantic validators, ``fn``), telling the model the error,
and raises ``ValidationFailed`` with every attempt when none passes; ``extract_many(tp, texts,
concurrency=N, progress=cb)`` extracts many texts at once, results in input order. Hooks given to
the constructor (``on_request``, ``on_response``, ``on_retry``) see every request, answer and re-ask.

Retries: 429 and 503 answers (and connection failures) are retried up to ``max_retries`` times,
waiting the server's ``Retry-After`` when it sends one, else an exponential backoff
(``backoff_s * 2**attempt``, capped at ``max_backoff_s``).
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import dataclasses
import email.utils
import json
import sys
import threading
import time
import types
import typing
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
import msgspec

from stencil.service.partial_json import ItemPath, PartialDocument

T = TypeVar("T")

RETRY_STATUSES = frozenset({429, 503})


class StencilError(Exception):
    """A request failed: the server refused it, it timed out, or the answer was unusable.

    Attributes:
        status: HTTP status of the server's answer; ``None`` for transport failures and timeouts.
        message: the server's own message (problem-details ``detail`` or OpenAI ``error.message``)
            when it sent one, else a description of what failed.
        body: the decoded error body, when the server sent JSON.
    """

    def __init__(self, message: str, status: int | None = None, body: Any = None):
        super().__init__(f"HTTP {status}: {message}" if status is not None else message)
        self.message = message
        self.status = status
        self.body = body


class ExtractionError(StencilError):
    """The server answered 200 but gave no output that fits the type.

    Attributes:
        response: the whole ``/generate`` answer (``text``, ``finish_reason``, ``valid``...).
    """

    def __init__(self, message: str, response: dict):
        super().__init__(message, status=200, body=response)
        self.response = response


@dataclass(frozen=True, slots=True)
class Attempt:
    """One answer of ``extract`` that failed validation.

    Attributes:
        text: the answer's text, as the model wrote it (and as the re-ask quoted it back).
        error: the validation error, as short as the re-ask told it to the model.
        response: the whole ``/generate`` answer.
    """

    text: str
    error: str
    response: dict


class ValidationFailed(ExtractionError):
    """Every answer ``extract`` got (the first and ``max_retries`` re-asks) failed validation.

    Validation is building the typed value (a type's constraints, pydantic field and model
    validators) and then ``extract``'s ``validate``. ``__cause__`` is the last answer's error.

    Attributes:
        attempts: each answer in order, with its error (``len == max_retries + 1``).
        response: the last answer.
    """

    def __init__(self, attempts: list[Attempt]):
        super().__init__(f"{len(attempts)} answer(s) failed validation, the last: {attempts[-1].error}",
                         attempts[-1].response)
        self.attempts = attempts


# -- schemas from types ----------------------------------------------------------------------------


def json_schema_for(tp: Any) -> dict:
    """JSON Schema of a msgspec Struct, dataclass, TypedDict, pydantic model or any msgspec type.

    Local ``$ref``s are inlined unless they are recursive (then ``$defs`` stays, holding only the
    recursive definitions); objects with ``properties`` and no ``additionalProperties`` get
    ``additionalProperties: false``, since the type names every field it can hold.

    Raises:
        TypeError: msgspec cannot describe the type.
    """
    model_json_schema = getattr(tp, "model_json_schema", None)
    if callable(model_json_schema):
        schema = model_json_schema()
    elif _uses_pydantic(tp):  # list[Model] and the like: msgspec does not know pydantic's models
        from pydantic import TypeAdapter

        schema = TypeAdapter(tp).json_schema()
    else:
        schema = msgspec.json.schema(tp)
    defs = dict(schema.pop("$defs", None) or schema.pop("definitions", None) or {})
    kept: dict[str, Any] = {}
    out = _inline(schema, defs, kept, ())
    if kept:
        out = dict(out)
        out["$defs"] = kept
    return out


def _ref_name(ref: str) -> str | None:
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix):
            return ref[len(prefix):]
    return None


def _inline(node: Any, defs: dict, kept: dict, stack: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_inline(x, defs, kept, stack) for x in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    name = _ref_name(ref) if isinstance(ref, str) else None
    if name is not None and name in defs:
        if name in stack:  # recursive: keep the reference, resolve its target once under $defs
            if name not in kept:
                kept[name] = {}  # placeholder: a reference met while resolving it stays a reference
                kept[name] = _inline(defs[name], defs, kept, (name,))
            return {k: v for k, v in node.items() if k != "$ref"} | {"$ref": f"#/$defs/{name}"}
        target = _inline(defs[name], defs, kept, stack + (name,))
        siblings = {k: _inline(v, defs, kept, stack) for k, v in node.items() if k != "$ref"}
        return {**target, **siblings}
    out = {k: _inline(v, defs, kept, stack) for k, v in node.items()}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _is_pydantic(tp: Any) -> bool:
    return callable(getattr(tp, "model_validate", None)) and callable(getattr(tp, "model_json_schema", None))


def _uses_pydantic(tp: Any) -> bool:
    """``tp`` is a pydantic model or holds one in its arguments (``list[Model]``, ``Model | None``)."""
    return _is_pydantic(tp) or any(_uses_pydantic(arg) for arg in typing.get_args(tp))


def decode_output(tp: type[T], output: Any) -> T:
    """Turn the server's parsed ``output`` into an instance of ``tp``.

    Raises:
        msgspec.ValidationError / pydantic.ValidationError: the output does not fit the type.
    """
    if _is_pydantic(tp):
        return tp.model_validate(output)  # type: ignore[attr-defined]
    return _converter(tp, _uses_pydantic(tp))(output)


# -- partial answers ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Partial(Generic[T]):
    """A typed answer still being written (``stream_extract``).

    The server's grammar makes every streamed prefix the start of a valid answer, so the fields
    in ``done`` are final: later text never changes them.

    Attributes:
        type: the type being extracted.
        done: the fields completed so far, by name, each already of its declared type (a
            nested model is an instance of it, a set a set, an Enum its member).
        writing: the path of the value being written now (``"home.city"``, ``"tags[1]"``), or
            ``None`` between fields.
        text: the JSON text so far.
        value: the answer so far as JSON values (``PartialDocument.value``): every value complete
            at any depth, inside the objects and arrays still open, which hold the members and
            elements complete so far (``{"name": "Ann", "home": {}, "tags": ["red"]}`` while the
            home's city and the second tag are written). Not typed: half an object is no
            instance of its type. Final as ``done`` is: a later partial only adds to it.
    """

    type: type
    done: dict[str, Any]
    writing: str | None
    text: str
    value: Any = None


def field_types(tp: Any) -> dict[str, tuple[str, Any]]:
    """JSON member name → (attribute name, declared type) of a pydantic model, msgspec Struct,
    dataclass or TypedDict (``{}`` for other types)."""
    if _is_pydantic(tp):
        return {(f.alias or name): (name, f.annotation) for name, f in tp.model_fields.items()}
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return {f.encode_name: (f.name, f.type) for f in msgspec.structs.fields(tp)}
    if dataclasses.is_dataclass(tp) or typing.is_typeddict(tp):
        return {name: (name, hint) for name, hint in typing.get_type_hints(tp).items()}
    return {}


def _converter(tp: Any, pydantic_model: bool) -> Callable[[Any], Any]:
    """JSON value → ``tp``: pydantic's ``TypeAdapter`` for a type built of pydantic models, else
    ``msgspec.convert``. Build it once per type: an adapter costs a schema build."""
    if pydantic_model:
        from pydantic import TypeAdapter

        return TypeAdapter(tp).validate_python
    return lambda value: msgspec.convert(value, type=tp)


def _typed_value(tp: Any, value: Any, pydantic_model: bool) -> Any:
    return _converter(tp, pydantic_model)(value)


class _PartialReader:
    """Text deltas of a ``/generate`` stream → ``Partial`` items (each field converted once)."""

    def __init__(self, tp: Any) -> None:
        self.tp = tp
        self.fields = field_types(tp)
        self.pydantic = _is_pydantic(tp)
        self.doc = PartialDocument()
        self.done: dict[str, Any] = {}

    @property
    def text(self) -> str:
        return self.doc.text

    def push(self, delta: str) -> Partial:
        self.doc.feed(delta)
        for key, value in self.doc.done.items():
            if key not in self.fields or self.fields[key][0] in self.done:
                continue
            name, declared = self.fields[key]
            try:
                self.done[name] = _typed_value(declared, value, self.pydantic)
            except Exception:  # noqa: BLE001 - a relaxed keyword let it through: keep the JSON value
                self.done[name] = value
        return Partial(self.tp, dict(self.done), self.doc.writing, self.doc.text, self.doc.value)


# -- items of a list, as they end (extract_iter) ----------------------------------------------------------


def _unwrap(tp: Any) -> Any:
    """``Annotated[X, ...]`` and ``X | None`` → ``X`` (repeatedly)."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            rest = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp
            tp = rest[0]
        else:
            return tp


_LISTS = (list, set, frozenset, collections.abc.Sequence, collections.abc.MutableSequence)


def _element_type(tp: Any) -> Any | None:
    """The element type of a list-like type (``list[X]``, ``tuple[X, ...]``, ``set[X]``,
    ``Sequence[X]``; ``Any`` when bare), else None."""
    tp = _unwrap(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        return args[0] if len(args) == 2 and args[1] is Ellipsis else None
    if origin in _LISTS:
        return args[0] if args else Any
    return Any if tp in _LISTS else None


def _type_name(tp: Any) -> str:
    return str(tp) if typing.get_args(tp) else getattr(tp, "__name__", str(tp))


def item_path(tp: Any, items: str | None = None) -> tuple[ItemPath, Any]:
    """Where ``extract_iter``'s items stand in an answer of type ``tp``, and their declared type.

    ``items=None``: ``tp`` is a list type (``list[X]``, ``tuple[X, ...]``, ``set[X]``,
    ``Sequence[X]``, ``Annotated`` or not) and its elements are the items. ``items="a.b"``:
    field names, dot-separated (each the JSON member name or the attribute name), leading from
    ``tp`` to a list field, whose elements are the items; a list met before the last name is
    walked through, each element in turn (``"sections.lines"``: the lines of every section, in
    document order). ``X | None`` on the way is taken as ``X``.

        item_path(Invoice, "lines") == (("lines", None), Line)   # Invoice.lines: list[Line]
        item_path(list[Line]) == ((None,), Line)

    Raises:
        TypeError: a name is no field of the type it is looked up in, or the path does not end
            at a list.
    """
    path: list[str | None] = []
    at = tp
    for name in items.split(".") if items is not None else ():
        while (element := _element_type(at)) is not None:
            path.append(None)
            at = element
        fields = field_types(_unwrap(at))
        key = name if name in fields else next((k for k, (attr, _) in fields.items() if attr == name), None)
        if key is None:
            raise TypeError(f"extract_iter: {_type_name(at)} has no field {name!r} (it has: "
                            f"{', '.join(fields) or 'no fields'})")
        path.append(key)
        at = fields[key][1]
    element = _element_type(at)
    if element is None:
        raise TypeError(f"extract_iter: items={items!r} of {_type_name(tp)} is {_type_name(at)}, not a list"
                        if items is not None else
                        f"extract_iter: {_type_name(tp)} is not a list type; name a list field of it with items=")
    return (*path, None), element


class _ItemReader:
    """Text deltas of a ``/generate`` stream → the items of one list of the answer, typed, each
    as its end streams (``extract_iter``)."""

    def __init__(self, tp: Any, items: str | None) -> None:
        path, self.item_type = item_path(tp, items)
        self.where = items or "the list"
        self.convert = _converter(self.item_type, _uses_pydantic(tp))
        self.doc = PartialDocument(path)
        self.count = 0

    @property
    def text(self) -> str:
        return self.doc.text

    def push(self, delta: str) -> list[Any]:
        """The items that ended in ``delta``, typed, in order.

        Raises:
            ExtractionError: an item does not fit its type (``response``: the text so far).
        """
        out = []
        for value in self.doc.feed(delta):
            try:
                out.append(self.convert(value))
            except Exception as e:  # noqa: BLE001 - msgspec or pydantic validation error, reported alike
                raise ExtractionError(f"item {self.count} of {self.where} does not fit "
                                      f"{_type_name(self.item_type)}: {e}", {"text": self.doc.text}) from e
            self.count += 1
        return out


# -- request / answer helpers -------------------------------------------------------------------------


def _with_schema(gen_kwargs: dict, schema: dict) -> dict:
    """``gen_kwargs`` with the ``response_schema`` derived from the type; one given as well is a
    ``TypeError``, as it is for ``stream_extract`` (the type says what the answer is)."""
    if "response_schema" in gen_kwargs:
        raise TypeError("response_schema is derived from the type; do not pass it as well")
    return dict(gen_kwargs, response_schema=schema)


def _body(text_or_messages: str | list[dict], **fields: Any) -> dict:
    body: dict[str, Any] = {}
    if isinstance(text_or_messages, str):
        body["prompt"] = text_or_messages
    else:
        body["messages"] = list(text_or_messages)
    body.update({k: v for k, v in fields.items() if v is not None})
    return body


def _error_from(resp: httpx.Response) -> StencilError:
    try:
        data = resp.json()
    except ValueError:
        return StencilError(resp.text or resp.reason_phrase, resp.status_code)
    message = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            message = err.get("message")
        message = message or data.get("detail") or data.get("title")
    return StencilError(str(message or data), resp.status_code, data)


def retry_delay(resp: httpx.Response | None, attempt: int, backoff_s: float, max_backoff_s: float) -> float:
    """Seconds to wait before retry ``attempt`` (0-based).

    ``Retry-After`` (seconds or an HTTP date, RFC 9110 §10.2.3) wins when present, capped at
    ``max_backoff_s``; otherwise ``backoff_s * 2**attempt``, capped likewise.
    """
    header = resp.headers.get("retry-after") if resp is not None else None
    if header:
        header = header.strip()
        try:
            return min(max(float(header), 0.0), max_backoff_s)
        except ValueError:
            when = email.utils.parsedate_to_datetime(header) if header else None
            if when is not None:
                return min(max(when.timestamp() - time.time(), 0.0), max_backoff_s)
    return min(backoff_s * (2 ** attempt), max_backoff_s)


def _output_of(answer: dict, relaxed: bool) -> Any:
    """The answer's parsed output.

    ``relaxed`` (the request said ``strict: false``): an output the server's jsonschema check
    found invalid (a relaxed keyword was broken, e.g. a duplicate in a ``set``) is still offered
    to the type, which has the last word.

    Raises:
        ExtractionError: no output (cut at ``max_tokens``), or one the server found invalid
            while not ``relaxed``.
    """
    output = answer.get("output")
    if output is None or (answer.get("valid") is False and not relaxed):
        raise ExtractionError(
            f"no valid output (finish_reason={answer.get('finish_reason')!r}, "
            f"text={str(answer.get('text'))[:200]!r})", answer)
    return output


def _extracted(tp: type[T], answer: dict, relaxed: bool = False) -> T:
    """The answer's output as a ``tp``; an output that does not fit is an ``ExtractionError``."""
    output = _output_of(answer, relaxed)
    try:
        return decode_output(tp, output)
    except Exception as e:  # noqa: BLE001 - msgspec or pydantic validation error, reported alike
        raise ExtractionError(f"output does not fit {getattr(tp, '__name__', tp)}: {e}", answer) from e


# What a failed validation raises: a type's own check (msgspec.ValidationError; pydantic's
# ValidationError is a ValueError) or the caller's ``validate``. Other exceptions are bugs: not re-asked.
VALIDATION_ERRORS = (ValueError, AssertionError, msgspec.ValidationError)

MAX_ERROR_CHARS = 300  # of a validation error told to the model: enough for a few fields' messages


def validation_message(e: BaseException) -> str:
    """A validation error in one short line, as the re-ask tells it to the model.

    pydantic's errors become ``loc: msg`` pairs (no documentation links); others their ``str``
    (an empty ``assert``'s the exception's name). Cut at ``MAX_ERROR_CHARS``.
    """
    pydantic_core = sys.modules.get("pydantic_core")  # loaded only if the caller uses pydantic
    if pydantic_core is not None and isinstance(e, pydantic_core.ValidationError):
        parts = []
        for err in e.errors(include_url=False):
            loc = ".".join(str(x) for x in err["loc"])
            parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
        text = "; ".join(parts)
    else:
        text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def reask_message(error: str) -> str:
    """The user turn that follows an answer which failed validation."""
    return f"That answer is not valid: {error}. Answer again with this fixed."


class _Reask:
    """One ``extract`` with re-asks: the conversation so far and the answers that failed.

    Shared by the sync and async clients, which differ only in how they send ``prompt``.
    """

    def __init__(self, tp: Any, text_or_messages: str | list[dict], validate: Callable[[Any], Any] | None,
                 max_retries: int, relaxed: bool, on_retry: Callable[[int, BaseException], Any] | None):
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.tp, self.validate, self.max_retries, self.relaxed = tp, validate, max_retries, relaxed
        self.on_retry = on_retry
        self.attempts: list[Attempt] = []
        # A re-ask needs turns: with retries allowed, a plain prompt is sent as one user message.
        if isinstance(text_or_messages, str):
            self.prompt: str | list[dict] = (
                [{"role": "user", "content": text_or_messages}] if max_retries else text_or_messages)
        else:
            self.prompt = list(text_or_messages)

    def judge(self, answer: dict) -> tuple[bool, Any]:
        """``(True, value)`` when the answer validates, ``(False, None)`` when ``prompt`` now
        holds the re-ask.

        Raises:
            ExtractionError: the answer has no output (cut at ``max_tokens``): not re-asked.
            ValidationFailed: it failed validation and no re-ask is left.
        """
        output = _output_of(answer, self.relaxed)
        try:
            value = decode_output(self.tp, output)
            if self.validate is not None:
                self.validate(value)
            return True, value
        except VALIDATION_ERRORS as e:
            text = str(answer.get("text") or "")
            error = validation_message(e)
            self.attempts.append(Attempt(text, error, answer))
            if len(self.attempts) > self.max_retries:
                raise ValidationFailed(self.attempts) from e
            if self.on_retry is not None:
                self.on_retry(len(self.attempts), e)
            self.prompt = [*self.prompt, {"role": "assistant", "content": text},
                           {"role": "user", "content": reask_message(error)}]
            return False, None


class _Batch:
    """``extract_many``'s bookkeeping: hands out indices in input order, keeps results in place,
    counts finished items for ``progress``, and stops handing out after the first error unless
    ``return_exceptions``. Not locked: the sync client calls it under its own lock."""

    def __init__(self, total: int, progress: Callable[[int, int], Any] | None, return_exceptions: bool):
        self.results: list[Any] = [None] * total
        self.total, self.progress, self.return_exceptions = total, progress, return_exceptions
        self.next = 0
        self.done = 0
        self.error: BaseException | None = None

    def take(self) -> int | None:
        """The next index to extract, or None when all are handed out or an error stopped the batch."""
        if self.next >= self.total or self.error is not None:
            return None
        self.next += 1
        return self.next - 1

    def finish(self, i: int, result: Any, failed: bool) -> None:
        if failed and not self.return_exceptions:
            self.error = self.error or result
        self.results[i] = result
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)


def _workers(concurrency: int, total: int) -> int:
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    return min(concurrency, total)


def _sse_events():
    """Stateful SSE parser (WHATWG HTML §9.2): feed lines, get ``(event, data)`` at blank lines."""
    event, data = "message", []

    def feed(line: str):
        nonlocal event, data
        if line == "":
            if not data:
                event = "message"
                return None
            out = (event, "\n".join(data))
            event, data = "message", []
            return out
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            event = value
        elif field == "data":
            data.append(value)
        return None

    return feed


class _TextStream:
    """Turns SSE lines of a ``/generate`` stream into text deltas; keeps the final event.

    Shared by the sync and async clients, which differ only in how they read lines.
    """

    def __init__(self) -> None:
        self._feed = _sse_events()
        self._parts: list[str] = []
        self.last: dict | None = None

    def line(self, line: str) -> str | None:
        """Feed one line; return a text delta when one completes, else None."""
        ev = self._feed(line)
        if ev is None:
            return None
        text, final = _delta_of(ev[1])
        if final is not None:
            self.last = {**final, "text": "".join(self._parts)}
            return None
        if text:
            self._parts.append(text)
            return text
        return None


def _delta_of(data: str) -> tuple[str | None, dict | None]:
    """(text delta, final event) carried by one ``/generate`` SSE ``data:`` payload.

    The server sends ``{"type": "delta", "text"}`` events, then ``{"type": "final", ...}``
    (``output``, ``valid``, ``finish_reason``, ``usage``...) or ``{"type": "error", "error":
    <problem>}``, then ``[DONE]``. Unknown event types are skipped.

    Raises:
        StencilError: on an ``error`` event, with the problem's status and detail.
    """
    if data == "[DONE]":
        return None, None
    payload = json.loads(data)
    kind = payload.get("type") if isinstance(payload, dict) else None
    if kind == "delta":
        return payload.get("text") or "", None
    if kind == "final":
        return None, payload
    if kind == "error":
        problem = payload.get("error") or {}
        raise StencilError(str(problem.get("detail") or problem), problem.get("status"), payload)
    return None, None


RequestHook = Callable[[dict], Any]
ResponseHook = Callable[[dict, dict], Any]
RetryHook = Callable[[int, BaseException], Any]


class _Base:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0,
                 max_retries: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 on_request: RequestHook | None = None, on_response: ResponseHook | None = None,
                 on_retry: RetryHook | None = None):
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout = timeout
        self.last: dict | None = None  # final event of the latest stream()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.on_request, self.on_response, self.on_retry = on_request, on_response, on_retry

    def _requested(self, body: dict) -> None:
        if self.on_request is not None:
            self.on_request(body)

    def _answered(self, body: dict, answer: dict | None) -> None:
        if self.on_response is not None and answer is not None:
            self.on_response(body, answer)

    def _timeout_error(self, e: Exception) -> StencilError:
        return StencilError(f"request timed out after {self.timeout} s: {e!r}")


class Client(_Base):
    """Synchronous client.

    Args:
        base_url: the server's root, e.g. ``"http://127.0.0.1:8000"``.
        api_key: sent as ``Authorization: Bearer ...`` when given.
        timeout: seconds allowed for connecting and for each read (a whole non-streamed answer).
        max_retries: retries after 429/503 answers or connection failures (not ``extract``'s
            re-asks, which its own ``max_retries`` allows).
        backoff_s / max_backoff_s: first backoff and its cap, in seconds.
        on_request: ``on_request(body)``, before each ``/generate`` request is sent (once per
            request: the 429/503 retries of one request do not call it again).
        on_response: ``on_response(body, answer)`` after each successful answer: the decoded JSON,
            or for a stream its final event plus the whole ``text``. A request that fails calls
            nothing: it raises ``StencilError``.
        on_retry: ``on_retry(attempt, error)`` before each re-ask of ``extract``: ``attempt`` the
            number of the answer that failed (1 for the first), ``error`` its validation error.
        Hooks run in the calling thread (``extract_many``: in its worker threads, one at a time
        per worker, so several may run at once); what they raise propagates.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0,
                 max_retries: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None, on_request: RequestHook | None = None,
                 on_response: ResponseHook | None = None, on_retry: RetryHook | None = None):
        super().__init__(base_url, api_key, timeout, max_retries, backoff_s, max_backoff_s,
                         on_request, on_response, on_retry)
        self._http = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=timeout,
                                  transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, body: dict, stream: bool) -> httpx.Response:
        """POST /generate with retries; the returned response is open (read it or close it)."""
        for attempt in range(self.max_retries + 1):
            try:
                req = self._http.build_request("POST", "/generate", json=body)
                resp = self._http.send(req, stream=True)
            except httpx.TimeoutException as e:
                raise self._timeout_error(e) from e
            except httpx.TransportError as e:
                if attempt == self.max_retries:
                    raise StencilError(f"cannot reach {self.base_url}: {e!r}") from e
                time.sleep(retry_delay(None, attempt, self.backoff_s, self.max_backoff_s))
                continue
            if resp.status_code < 400:
                if not stream:
                    resp.read()
                return resp
            resp.read()
            resp.close()
            if resp.status_code in RETRY_STATUSES and attempt < self.max_retries:
                time.sleep(retry_delay(resp, attempt, self.backoff_s, self.max_backoff_s))
                continue
            raise _error_from(resp)
        raise AssertionError("unreachable")

    def generate(self, text_or_messages: str | list[dict], **gen_kwargs: Any) -> dict:
        """``POST /generate``; returns the answer as a dict (``text``, ``output``, ``valid``, ...).

        ``gen_kwargs`` are body fields: ``response_schema``, ``regex``, ``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``.

        Raises:
            StencilError: an error answer (after retries), a timeout or a connection failure.
        """
        body = _body(text_or_messages, **gen_kwargs)
        self._requested(body)
        try:
            answer = self._send(body, stream=False).json()
        except httpx.TimeoutException as e:
            raise self._timeout_error(e) from e
        self._answered(body, answer)
        return answer

    def extract(self, tp: type[T], text_or_messages: str | list[dict], *,
                validate: Callable[[T], Any] | None = None, max_retries: int = 0, **gen_kwargs: Any) -> T:
        """Generate JSON constrained by ``tp``'s schema and decode it into a ``tp`` instance.

        With ``strict=False`` the server relaxes keywords its grammar cannot enforce exactly
        (a ``set``'s ``uniqueItems``), and the type, not the server's jsonschema check, decides
        whether the answer fits.

        Validation and re-asks: the answer is validated by building the ``tp`` (its constraints,
        pydantic field and model validators), then by ``validate(value)`` when given, which
        raises ``ValueError``, ``AssertionError`` or a pydantic ``ValidationError`` for what a
        schema cannot say (an end date before the start date); its return value is ignored. An
        answer that fails is re-asked, up to ``max_retries`` times: the conversation gets the
        answer as an assistant turn and a user turn naming the error (``reask_message``), and
        the next answer is validated alike. With ``max_retries > 0`` a plain-text prompt is
        sent as one user message, so there are turns to add to.

        A re-ask resends the whole conversation; the server's prefix cache serves the blocks
        (16 tokens) it has already seen (``usage.cached_tokens``). In
        ``test_client_extract.py::test_reask_after_a_failed_check_then_accepts`` (tiny model)
        the re-ask had 32 of its 78 prompt tokens cached: the first prompt's 34 tokens, down to
        whole blocks (the quoted answer is tokenized anew from its text, so the block holding
        the generated tokens does not match). Against ``stencil serve`` (default model, ``python
        examples/extract_many.py``, which prints each re-ask's counts; AMD EPYC, 2 cores) the
        re-asks of 117 and 190 tokens had 64 and 128 cached: every whole block of the
        conversation before them.

        Raises:
            StencilError: a request failed.
            ExtractionError: no valid output (e.g. ``finish_reason == "length"``); not re-asked.
            ValidationFailed: every answer failed validation; ``.attempts`` holds each answer's
                text and error.
        """
        asker = _Reask(tp, text_or_messages, validate, max_retries, gen_kwargs.get("strict") is False,
                       self.on_retry)
        schema = json_schema_for(tp)
        while True:
            ok, value = asker.judge(self.generate(asker.prompt, response_schema=schema, **gen_kwargs))
            if ok:
                return value

    def extract_many(self, tp: type[T], texts: Iterable[str | list[dict]], *, concurrency: int = 8,
                     progress: Callable[[int, int], Any] | None = None, return_exceptions: bool = False,
                     validate: Callable[[T], Any] | None = None, max_retries: int = 0,
                     **gen_kwargs: Any) -> list[Any]:
        """``extract`` of each text (or message list), ``concurrency`` at a time; results in input order.

        Runs on a pool of ``concurrency`` threads sharing this client's connection pool (the
        sync client needs no event loop); each thread takes the next text when its last is done,
        so at most ``concurrency`` requests are in flight (an item's re-asks follow one another).
        ``progress(done, total)`` is called as each item finishes, failed ones included, from
        the worker threads one call at a time. ``validate``, ``max_retries`` and ``gen_kwargs``
        are ``extract``'s, for every item.

        Errors: with ``return_exceptions`` an item that fails holds its exception in the result
        list. Without, the first failure stops the handing out of texts; the requests in flight
        finish (their results are dropped), then that exception is raised.

        Raises:
            ValueError: ``concurrency < 1``.
            StencilError / ExtractionError / ValidationFailed: an item failed (without
                ``return_exceptions``).
        """
        items = list(texts)
        batch = _Batch(len(items), progress, return_exceptions)
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    i = batch.take()
                if i is None:
                    return
                try:
                    result, failed = self.extract(tp, items[i], validate=validate, max_retries=max_retries,
                                                  **gen_kwargs), False
                except Exception as e:  # noqa: BLE001 - kept for the caller, as asyncio.gather does
                    result, failed = e, True
                with lock:
                    batch.finish(i, result, failed)

        workers = _workers(concurrency, len(items))
        if workers:
            with ThreadPoolExecutor(workers, thread_name_prefix="stencil-extract") as pool:
                for f in [pool.submit(work) for _ in range(workers)]:
                    f.result()
        if batch.error is not None:
            raise batch.error
        return batch.results

    def stream(self, text_or_messages: str | list[dict], **gen_kwargs: Any) -> Iterator[str]:
        """Yield text deltas of a streamed ``/generate``.

        Afterwards ``self.last`` holds the final event (``output``, ``valid``, ``finish_reason``,
        ``usage``, ``timings``) plus the whole ``text``.

        Raises:
            StencilError: the request failed before or during the stream.
        """
        self.last = None
        body = _body(text_or_messages, stream=True, **gen_kwargs)
        self._requested(body)
        resp = self._send(body, stream=True)
        events = _TextStream()
        try:
            for line in resp.iter_lines():
                text = events.line(line)
                self.last = events.last
                if text:
                    yield text
        except httpx.TimeoutException as e:
            raise self._timeout_error(e) from e
        finally:
            resp.close()
        self._answered(body, self.last)

    def stream_extract(self, tp: type[T], text_or_messages: str | list[dict],
                       **gen_kwargs: Any) -> Iterator[Partial[T] | T]:
        """Extract ``tp`` as the answer streams: a ``Partial`` per text delta (the fields complete
        so far, typed, and the one being written), then the validated ``tp`` instance.

        Raises:
            StencilError: the request failed.
            ExtractionError: the finished answer is not valid (e.g. cut at ``max_tokens``).
        """
        reader = _PartialReader(tp)
        for delta in self.stream(text_or_messages, response_schema=json_schema_for(tp), **gen_kwargs):
            yield reader.push(delta)
        yield _extracted(tp, self.last or {"text": reader.text}, gen_kwargs.get("strict") is False)

    def extract_iter(self, tp: Any, text_or_messages: str | list[dict], *, items: str | None = None,
                     **gen_kwargs: Any) -> Iterator[Any]:
        """Extract ``tp`` as the answer streams and yield the items of one of its lists, typed, each
        as soon as it has ended: at the delta holding its closing bracket, brace or quote (a
        number, ``true``, ``false`` or ``null`` at the delimiter after it), not at the answer's end.

            for person in client.extract_iter(list[Person], text): ...
            for line in client.extract_iter(Invoice, text, items="lines"): ...
            for line in client.extract_iter(Report, text, items="sections.lines"): ...

        Which list: with ``items=None`` the answer is the list (``tp`` is ``list[X]``,
        ``tuple[X, ...]``, ``set[X]`` or ``Sequence[X]``); else ``items`` names a list field of
        ``tp`` at any depth by dot-separated field names (``item_path`` reads it; a list on the
        way is walked through: ``"sections.lines"`` yields every section's lines in order). The
        model is asked for the whole ``tp`` (its schema is the ``response_schema``), so a path
        keeps an invoice's other fields in the answer; the items are what is yielded. Each is
        converted to the list's element type as ``extract`` converts an answer (pydantic when
        ``tp`` is or holds a pydantic model, else msgspec: Structs, dataclasses, TypedDicts,
        plain types). The grammar makes every prefix the start of a valid answer, so an item
        that has ended is final.

        The whole answer is validated once the stream ends, as ``stream_extract`` does, but not
        yielded: ``self.last["output"]`` holds it as JSON; ``stream_extract`` yields it typed.
        Hooks run as for ``stream``: ``on_request`` before the request, ``on_response`` after
        the last item. Breaking out of the loop closes the stream.

        Raises:
            TypeError: ``tp`` is no list type and ``items`` is None, or ``items`` names no
                list field (raised here, before any request is sent).
            StencilError: the request failed.
            ExtractionError: an item does not fit its type (raised in its place; ``response``
                holds the text so far), or the finished answer is not valid (e.g. cut at
                ``max_tokens``; raised after the items that had ended, which stand).
        """
        reader = _ItemReader(tp, items)
        schema = json_schema_for(tp)
        return self._items(reader, tp, text_or_messages, _with_schema(gen_kwargs, schema))

    def _items(self, reader: _ItemReader, tp: Any, text_or_messages: str | list[dict],
               gen_kwargs: dict) -> Iterator[Any]:
        with contextlib.closing(self.stream(text_or_messages, **gen_kwargs)) as deltas:
            for delta in deltas:
                yield from reader.push(delta)
        _extracted(tp, self.last or {"text": reader.text}, gen_kwargs.get("strict") is False)


class AsyncClient(_Base):
    """asyncio twin of ``Client`` (same arguments, ``await``-able methods, ``async for`` streams)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0,
                 max_retries: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None, on_request: RequestHook | None = None,
                 on_response: ResponseHook | None = None, on_retry: RetryHook | None = None):
        super().__init__(base_url, api_key, timeout, max_retries, backoff_s, max_backoff_s,
                         on_request, on_response, on_retry)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=timeout,
                                       transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _send(self, body: dict, stream: bool) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            try:
                req = self._http.build_request("POST", "/generate", json=body)
                resp = await self._http.send(req, stream=True)
            except httpx.TimeoutException as e:
                raise self._timeout_error(e) from e
            except httpx.TransportError as e:
                if attempt == self.max_retries:
                    raise StencilError(f"cannot reach {self.base_url}: {e!r}") from e
                await asyncio.sleep(retry_delay(None, attempt, self.backoff_s, self.max_backoff_s))
                continue
            if resp.status_code < 400:
                if not stream:
                    await resp.aread()
                return resp
            await resp.aread()
            await resp.aclose()
            if resp.status_code in RETRY_STATUSES and attempt < self.max_retries:
                await asyncio.sleep(retry_delay(resp, attempt, self.backoff_s, self.max_backoff_s))
                continue
            raise _error_from(resp)
        raise AssertionError("unreachable")

    async def generate(self, text_or_messages: str | list[dict], **gen_kwargs: Any) -> dict:
        """See ``Client.generate``."""
        body = _body(text_or_messages, **gen_kwargs)
        self._requested(body)
        try:
            answer = (await self._send(body, stream=False)).json()
        except httpx.TimeoutException as e:
            raise self._timeout_error(e) from e
        self._answered(body, answer)
        return answer

    async def extract(self, tp: type[T], text_or_messages: str | list[dict], *,
                      validate: Callable[[T], Any] | None = None, max_retries: int = 0, **gen_kwargs: Any) -> T:
        """See ``Client.extract`` (``validate`` is a plain function, called in the event loop)."""
        asker = _Reask(tp, text_or_messages, validate, max_retries, gen_kwargs.get("strict") is False,
                       self.on_retry)
        schema = json_schema_for(tp)
        while True:
            ok, value = asker.judge(await self.generate(asker.prompt, response_schema=schema, **gen_kwargs))
            if ok:
                return value

    async def extract_many(self, tp: type[T], texts: Iterable[str | list[dict]], *, concurrency: int = 8,
                           progress: Callable[[int, int], Any] | None = None, return_exceptions: bool = False,
                           validate: Callable[[T], Any] | None = None, max_retries: int = 0,
                           **gen_kwargs: Any) -> list[Any]:
        """See ``Client.extract_many``: here ``concurrency`` tasks in the running event loop take
        the texts in turn, and ``progress`` is called in the loop. Cancelling the call cancels
        the requests in flight."""
        items = list(texts)
        batch = _Batch(len(items), progress, return_exceptions)

        async def work() -> None:
            while (i := batch.take()) is not None:
                try:
                    result, failed = await self.extract(tp, items[i], validate=validate, max_retries=max_retries,
                                                        **gen_kwargs), False
                except Exception as e:  # noqa: BLE001 - kept for the caller, as asyncio.gather does
                    result, failed = e, True
                batch.finish(i, result, failed)

        await asyncio.gather(*(work() for _ in range(_workers(concurrency, len(items)))))
        if batch.error is not None:
            raise batch.error
        return batch.results

    async def stream(self, text_or_messages: str | list[dict], **gen_kwargs: Any) -> AsyncIterator[str]:
        """See ``Client.stream``."""
        self.last = None
        body = _body(text_or_messages, stream=True, **gen_kwargs)
        self._requested(body)
        resp = await self._send(body, stream=True)
        events = _TextStream()
        try:
            async for line in resp.aiter_lines():
                text = events.line(line)
                self.last = events.last
                if text:
                    yield text
        except httpx.TimeoutException as e:
            raise self._timeout_error(e) from e
        finally:
            await resp.aclose()
        self._answered(body, self.last)

    async def stream_extract(self, tp: type[T], text_or_messages: str | list[dict],
                             **gen_kwargs: Any) -> AsyncIterator[Partial[T] | T]:
        """See ``Client.stream_extract``."""
        reader = _PartialReader(tp)
        async for delta in self.stream(text_or_messages, response_schema=json_schema_for(tp), **gen_kwargs):
            yield reader.push(delta)
        yield _extracted(tp, self.last or {"text": reader.text}, gen_kwargs.get("strict") is False)

    def extract_iter(self, tp: Any, text_or_messages: str | list[dict], *, items: str | None = None,
                     **gen_kwargs: Any) -> AsyncIterator[Any]:
        """See ``Client.extract_iter``: ``async for item in client.extract_iter(...)`` (a plain
        method returning the iterator, so that a bad ``items`` raises ``TypeError`` at the call)."""
        reader = _ItemReader(tp, items)
        schema = json_schema_for(tp)
        return self._items(reader, tp, text_or_messages, _with_schema(gen_kwargs, schema))

    async def _items(self, reader: _ItemReader, tp: Any, text_or_messages: str | list[dict],
                     gen_kwargs: dict) -> AsyncIterator[Any]:
        async with contextlib.aclosing(self.stream(text_or_messages, **gen_kwargs)) as deltas:
            async for delta in deltas:
                for item in reader.push(delta):
                    yield item
        _extracted(tp, self.last or {"text": reader.text}, gen_kwargs.get("strict") is False)
