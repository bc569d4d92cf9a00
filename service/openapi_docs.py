"""What the OpenAPI schema promises beyond what Litestar infers from handler signatures.

Litestar derives the success response from a handler's return annotation and adds a generic
400 for body validation; it cannot know that ``stream: true`` turns a 200 into server-sent
events, nor the shape of the errors our own exception handlers write. Without these, a client
(or a schema-driven fuzzer such as schemathesis) would be told a 429 or an event stream is
undocumented, and the error bodies could not be checked against any schema. Two more things
it cannot infer: which request types refuse unknown fields (``StrictStructSchemaPlugin``) and
which answers feed which operations (``with_links``).
"""

from __future__ import annotations

from dataclasses import dataclass

from litestar._openapi.schema_generation import SchemaCreator
from litestar._openapi.schema_generation.plugins.struct import StructSchemaPlugin
from litestar.openapi import ResponseSpec
from litestar.openapi.spec import Link, OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Operation, Schema
from litestar.typing import FieldDefinition

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


def with_links(base: type[Operation], links: dict[str, dict[str, Link]]) -> type[Operation]:
    """A subclass of the operation class ``base`` whose responses carry OpenAPI ``links``.

    Litestar's ``ResponseSpec`` cannot say that a value of one answer is the input of another
    operation; links do (``status code → name → Link``), so a client, and schemathesis's
    stateful testing, can chain calls: list the models, then fetch one or generate with it.

    Raises:
        KeyError: when building the document, a status code that the operation does not document.
    """
    def __post_init__(self) -> None:
        parent = getattr(base, "__post_init__", None)
        if parent is not None:
            parent(self)
        for code, named in links.items():
            response = (self.responses or {})[code]
            if isinstance(response, OpenAPIResponse):
                response.links = {**(response.links or {}), **named}

    cls = type(f"{base.__name__}WithLinks", (base,), {"__post_init__": __post_init__})
    return dataclass(cls)  # a fresh __init__ that calls this __post_init__


class StrictStructSchemaPlugin(StructSchemaPlugin):
    """Litestar's msgspec Struct schemas, plus ``additionalProperties: false`` where the Struct
    says ``forbid_unknown_fields=True``.

    Litestar's own plugin drops that fact, so the document told clients that any extra field
    is allowed while the server answers it with a 422 (and a fuzzer's "valid" bodies carried
    unknown fields). Registered with the app, it is consulted before the built-in one.
    """

    def to_openapi_schema(self, field_definition: FieldDefinition, schema_creator: SchemaCreator) -> Schema:
        schema = super().to_openapi_schema(field_definition, schema_creator)
        if field_definition.type_.__struct_config__.forbid_unknown_fields:
            schema.additional_properties = False
        return schema


@dataclass
class RefusedOperation(Operation):
    """An operation that never succeeds (a route kept so clients of another API get a clear
    error): the success response Litestar infers from the handler is dropped from the document,
    leaving the documented errors."""

    def __post_init__(self) -> None:
        for code in [c for c in (self.responses or {}) if c.startswith("2")]:
            del self.responses[code]
