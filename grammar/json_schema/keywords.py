"""JSON Schema's keywords as the compiler sorts them, and two facts of instances every
rewrite needs (``json_type``, ``enum_values``). A leaf of ``stencil.grammar.json_schema``: the compiler,
``oneof`` and ``handover`` all read these.
"""

from __future__ import annotations

import re

from stencil.grammar.json_schema.merge import json_key

# An escaped ASCII character in a schema's JSON text: where the text holds none, a key is spelled
# as it reads, so a substring test of the text can stand in for a walk of the document.
ASCII_ESCAPE = re.compile(r"\\u00[0-7]")

TYPE_KEYWORDS = {
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "propertyNames", "minProperties", "maxProperties", "dependentRequired",
               "dependencies"),
    "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "contains",
              "uniqueItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
ANNOTATIONS = {"title", "description", "examples", "default", "$comment", "$schema", "$id", "id",
                "deprecated", "readOnly", "writeOnly", "$anchor", "definitions", "$defs",
                "contentMediaType", "contentEncoding", "contentSchema", "$vocabulary"}
ASSERTIONS = {"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
               "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems",
               "uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties",
               "required", "dependentRequired", "properties", "patternProperties",
               "additionalProperties", "propertyNames", "items", "prefixItems", "additionalItems",
               "contains", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
               "not", "if", "then", "else", "dependentSchemas", "dependencies", "format", "$ref"}


def json_type(v: object) -> str:
    """The JSON Schema type of a decoded JSON value (an integral float is ``"integer"``)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def enum_values(schema: dict) -> list:
    """The values ``enum`` and ``const`` together allow (``const`` alone: its one value; both:
    the ``enum`` values equal to it); empty when the schema has neither."""
    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
    if "const" in schema:
        values = [v for v in values if json_key(v) == json_key(schema["const"])] if "enum" in schema \
            else [schema["const"]]
    return values
