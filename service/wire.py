"""Strict request bodies: JSON only, every value of its declared type.

Litestar converts bodies with msgspec's lenient mode (``strict=False``), which turns
``"max_tokens": "5"`` into 5 and ``"stream": "true"`` into True, and it decodes a body sent as
``text/plain`` all the same. The OpenAPI schema promises an integer and a boolean in a JSON
body, so ``strict_body(T)`` is a route guard that checks the raw body against ``T`` with
msgspec's strict mode before Litestar parses it:

- a ``Content-Type`` other than ``application/json`` (or ``application/*+json``), or none at
  all, is a 415 (``curl -d`` sends ``application/x-www-form-urlencoded``; ``-H 'Content-Type:'``
  sends none: either way the body is not declared JSON);
- a body over the app's ``request_max_body_size`` is a 413 stating the limit in bytes;
- a value of the wrong type is a ``ValidationException`` whose ``key`` is the field's path
  (``max_tokens``, ``messages[0].role``): a 422 problem on ``/generate``, a 400 in OpenAI's shape
  under ``/v1`` (each router's exception handler; ``invalid_field`` finds the field for both).

Bodies that are not JSON at all, or empty, are left to Litestar's own decoding, which already
answers them with a 400. The body is read once: Litestar caches it for the handler.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec
from litestar.connection import ASGIConnection
from litestar.exceptions import ValidationException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.handlers import BaseRouteHandler

from stencil.service.errors import InputError, PayloadTooLarge, ServiceError, unknown_field_hint


class UnsupportedMediaType(ServiceError):
    """The body is not sent as JSON."""

    status = 415
    title = "Unsupported Media Type"


_JSON_TYPE = re.compile(r"^application/(?:[\w.+-]+\+)?json$")
_AT = re.compile(r" - at `\$(.*)`$")
_NAMED = re.compile(r"(?:unknown|missing required) field `([^`]*)`")


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json``, ``application/problem+json``... (parameters such as charset ignored);
    ``None`` or empty (no header) is not JSON."""
    if content_type is None or not content_type.strip():
        return False
    return _JSON_TYPE.match(content_type.split(";", 1)[0].strip().lower()) is not None


def invalid_field(items: list[dict]) -> str | None:
    """The body field a ``ValidationException``'s ``extra`` items name: the first item's ``key``
    (Litestar's ``data`` prefix is no field), followed by the field an "unknown field" or
    "missing required field" message names (``messages[0]`` + ``role`` → ``messages[0].role``);
    ``None`` when they name none."""
    keys = [str(e["key"]) for e in items if e.get("key") and e.get("key") != "data"]
    field = keys[0] if keys else None
    named = _NAMED.search(str(items[0].get("message", ""))) if items else None
    if named:
        field = named.group(1) if field is None else f"{field}.{named.group(1)}"
    return field


def field_of(error: msgspec.ValidationError) -> tuple[str, str]:
    """(field path, message) of a msgspec error: ``"Expected `int`, got `str` - at `$.max_tokens`"``
    → ``("max_tokens", "Expected `int`, got `str`")``; the root is ``""``."""
    text = str(error)
    m = _AT.search(text)
    if m is None:
        return "", text
    return m.group(1).lstrip("."), text[:m.start()]


def strict_body(body_type: Any) -> Callable:
    """A Litestar guard that refuses non-JSON bodies, too large ones and values of the wrong type.

    Args:
        body_type: the msgspec Struct (or any msgspec type) the route's ``data`` has.

    Raises (from the guard):
        UnsupportedMediaType: (415, field ``content-type``) no ``Content-Type``, or not JSON.
        PayloadTooLarge: (413) the body is over the limit; the message states it in bytes.
        ValidationException: a value of the wrong type; its ``key`` is the field's path.
        InputError: (400) a body that ends inside its JSON value, saying at which byte.
    """
    decoder = msgspec.json.Decoder(body_type, strict=True)

    async def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        ctype = connection.headers.get("content-type")
        if not is_json_media_type(ctype):
            sent = f"not {ctype.split(';', 1)[0].strip()!r}" if ctype and ctype.strip() else "the request has none"
            raise UnsupportedMediaType(f"the body must be JSON (Content-Type: application/json); {sent}",
                                       field="content-type")
        try:
            body = await connection.body()  # type: ignore[attr-defined]  # guards of HTTP routes get a Request
        except RequestEntityTooLarge:
            limit = handler.resolve_request_max_body_size()
            size = connection.headers.get("content-length")
            raise PayloadTooLarge(f"the body has {size} bytes; this server takes at most {limit} bytes"
                                  if size and size.isdigit() else
                                  f"the body is over this server's limit of {limit} bytes") from None
        if not body.strip():
            return
        try:
            decoder.decode(body)
        except msgspec.ValidationError as e:
            try:  # a value the type refuses may come before the place where the text stops being JSON
                msgspec.json.decode(body)
            except msgspec.DecodeError as d:
                _not_json(body, d)
                return
            except RecursionError:
                pass  # nested past what an untyped decode reaches: the type's error names the field
            key, message = field_of(e)
            message += unknown_field_hint(message, key, body_type)  # "; did you mean `response_schema`?"
            raise ValidationException(detail=f"Validation failed for {connection.method} {connection.url.path}",
                                      extra=[{"message": message, "key": key}]) from None
        except msgspec.DecodeError as e:
            _not_json(body, e)

    return guard


def _not_json(body: bytes, error: msgspec.DecodeError) -> None:
    """A body that is not JSON: one cut inside its value is a 400 saying at which byte; any other
    is left to Litestar's own decoding, which answers it with a 400 naming the byte.

    Raises:
        InputError: the body ends inside its JSON value.
    """
    if "truncated" in str(error):  # msgspec names no position here: the body's end is it
        raise InputError(f"the body is not valid JSON: it ends at byte {len(body)}, inside the JSON value "
                         "(truncated)") from None
