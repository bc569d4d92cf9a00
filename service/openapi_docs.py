"""What the OpenAPI schema promises beyond what Litestar infers from handler signatures.

Litestar derives the success response from a handler's return annotation and adds a generic
400 for body validation; it cannot know that ``stream: true`` turns a 200 into server-sent
events, nor the shape of the errors our own exception handlers write. Without these, a client
(or a schema-driven fuzzer such as schemathesis) would be told a 429 or an event stream is
undocumented, and the error bodies could not be checked against any schema.
"""

from __future__ import annotations

from dataclasses import dataclass

from litestar.openapi import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Operation, Schema

EVENT_STREAM = "text/event-stream"

ERROR_DESCRIPTIONS = {
    400: "invalid schema, regex, prompt or parameter",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body too large",
    415: "body not sent as JSON (Content-Type must be application/json)",
    422: "body does not match the request type",
    429: "waiting queue full; see Retry-After",
    500: "internal error (request id in the body)",
    503: "draining or engine dead",
    504: "request deadline passed",
}


def error_responses(body_type: type, media_type: str, codes: tuple[int, ...]) -> dict[int, ResponseSpec]:
    """``responses=`` entries documenting each status in ``codes`` with the error body ``body_type``.

    Raises:
        KeyError: a code without a description in ``ERROR_DESCRIPTIONS``.
    """
    return {code: ResponseSpec(body_type, description=ERROR_DESCRIPTIONS[code], media_type=media_type)
            for code in codes}


@dataclass
class StreamableOperation(Operation):
    """An operation whose 200 answer is JSON, or an event stream when the body asks ``stream: true``.

    Pass as ``operation_class=`` to a route decorator (Litestar builds the operation, then
    ``__post_init__`` adds the ``text/event-stream`` media type to the documented 200). As
    OpenAPI 3.1 tools read a stream's ``schema``, it describes one event: a ``data`` field holding
    the JSON of one chunk (the route's description names the type), the last one ``[DONE]``.
    """

    def __post_init__(self) -> None:
        ok = (self.responses or {}).get("200")
        if isinstance(ok, OpenAPIResponse):
            event = Schema(type=OpenAPIType.OBJECT, required=["data"],
                           properties={"data": Schema(type=OpenAPIType.STRING),
                                       "event": Schema(type=OpenAPIType.STRING)})
            ok.content = {**(ok.content or {}), EVENT_STREAM: OpenAPIMediaType(schema=event)}
