"""Strict request bodies: JSON only, every value of its declared type.

Litestar converts bodies with msgspec's lenient mode (``strict=False``), which turns
``"max_tokens": "5"`` into 5 and ``"stream": "true"`` into True, and it decodes a body sent as
``text/plain`` all the same. The OpenAPI schema promises an integer and a boolean in a JSON
body, so ``strict_body(T)`` is a route guard that checks the raw body against ``T`` with
msgspec's strict mode before Litestar parses it:

- a ``Content-Type`` other than ``application/json`` (or ``application/*+json``) is a 415;
  no header at all is read as JSON (simple clients omit it);
- a value of the wrong type is a ``ValidationException`` whose ``key`` is the field's path
  (``max_tokens``, ``messages[0].role``): a 422 problem on ``/generate``, a 400 in OpenAI's shape
  under ``/v1`` (each router's exception handler).

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
from litestar.handlers import BaseRouteHandler

from service.errors import ServiceError


class UnsupportedMediaType(ServiceError):
    """The body is not sent as JSON."""

    status = 415
    title = "Unsupported Media Type"


_JSON_TYPE = re.compile(r"^application/(?:[\w.+-]+\+)?json$")
_AT = re.compile(r" - at `\$(.*)`$")


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json``, ``application/problem+json``... (parameters such as charset ignored);
    ``None`` (no header) counts as JSON."""
    if content_type is None or not content_type.strip():
        return True
    return _JSON_TYPE.match(content_type.split(";", 1)[0].strip().lower()) is not None


def field_of(error: msgspec.ValidationError) -> tuple[str, str]:
    """(field path, message) of a msgspec error: ``"Expected `int`, got `str` - at `$.max_tokens`"``
    → ``("max_tokens", "Expected `int`, got `str`")``; the root is ``""``."""
    text = str(error)
    m = _AT.search(text)
    if m is None:
        return "", text
    return m.group(1).lstrip("."), text[:m.start()]


def strict_body(body_type: Any) -> Callable:
    """A Litestar guard that refuses non-JSON bodies (415) and values of the wrong type (422/400).

    Args:
        body_type: the msgspec Struct (or any msgspec type) the route's ``data`` has.
    """
    decoder = msgspec.json.Decoder(body_type, strict=True)

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        ctype = connection.headers.get("content-type")
        if not is_json_media_type(ctype):
            raise UnsupportedMediaType(f"the body must be JSON (Content-Type: application/json), "
                                       f"not {ctype.split(';', 1)[0].strip()!r}", field="content-type")
        body = await connection.body()  # type: ignore[attr-defined]  # guards of HTTP routes get a Request
        if not body.strip():
            return
        try:
            decoder.decode(body)
        except msgspec.ValidationError as e:
            key, message = field_of(e)
            raise ValidationException(detail=f"Validation failed for {connection.method} {connection.url.path}",
                                      extra=[{"message": message, "key": key}]) from None
        except msgspec.DecodeError:
            return  # not JSON: Litestar's own decoding answers it with a 400

    return guard
