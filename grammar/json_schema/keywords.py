"""JSON Schema's keywords as the compiler sorts them, and two facts of instances every
rewrite needs (``json_type``, ``enum_values``). A leaf of ``stencil.grammar.json_schema``: the compiler,
``oneof`` and ``handover`` all read these. ``unknown_keywords`` names the keys no draft defines
(a typo such as ``"proprties"`` is legal JSON Schema, and silently admits anything).
"""

from __future__ import annotations

import difflib
import functools
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


# Keywords of some draft (04 to 2020-12) that the sets above leave out: known, so never "unknown".
OTHER_KEYWORDS = {"$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor", "dependentSchemas",
                  "maxContains", "minContains", "unevaluatedItems", "unevaluatedProperties", "contentSchema",
                  "extends", "disallow", "divisibleBy"}
KNOWN_KEYWORDS = frozenset(ANNOTATIONS | ASSERTIONS | OTHER_KEYWORDS
                           | {k for kws in TYPE_KEYWORDS.values() for k in kws})
# Where a schema holds schemas: one, a list of them, or a map of names to them.
_ONE = frozenset({"additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
                  "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema", "items"})
_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"})
_HOLDERS = _ONE | _LIST | _MAP
MAX_UNKNOWN_NOTES = 8  # a schema written for another tool may carry dozens: name a few, count the rest
# The formats the drafts (04 to 2020-12) define, and OpenAPI's data-type formats (int32, double, ... common
# in schemas written from OpenAPI documents). Any other name is an annotation JSON Schema ignores, so a
# typo ("emial") constrains nothing: said like an unknown keyword.
KNOWN_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "idn-email", "hostname",
                           "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid",
                           "uri-template", "json-pointer", "relative-json-pointer", "regex", "host-name",
                           "ip-address", "color", "utc-millisec",
                           "int32", "int64", "float", "double", "byte", "binary", "password"})


def unknown_keywords(schema: object) -> list[str]:
    """Notes on the keys of ``schema`` (and of every subschema) that no JSON Schema draft defines, and on
    ``format`` names none defines (``KNOWN_FORMATS``).

    JSON Schema ignores such keys, so the schema stays served as written; but a typo
    (``"proprties"``) then constrains nothing, and only a note tells the client. Extension keys
    (``x-...``) are skipped; values that are data (``enum``, ``const``, ``default``, ``examples``)
    and the contents of unknown keys are not read.

    Returns:
        At most ``MAX_UNKNOWN_NOTES + 1`` lines (a schema's own keys before its subschemas'), each
        ``"unknown keyword 'proprties' at #: ignored; did you mean 'properties'?"`` (the hint where
        ``difflib`` finds a close known keyword; the path a JSON pointer as the compiler's
        warnings write it), and a last line counting those left out.
    """
    notes: list[str] = []
    found = 0
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str) and not _known_dialect(schema["$schema"]):
        notes.append(f"unknown $schema {schema['$schema']!r}: read as JSON Schema 2020-12")
    # Each stacked subschema carries where it is as a chain of (parent's place, segment); the
    # JSON pointer is written only for a note (most schemas have none to write, and the walk is
    # on every compile's path to the first mask).
    stack: list[tuple[object, tuple | None]] = [(schema, None)]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        subschemas: list[tuple[object, tuple]] = []
        for key, value in node.items():
            if key not in KNOWN_KEYWORDS:
                if isinstance(key, str) and not key.startswith("x-"):
                    found += 1
                    if found <= MAX_UNKNOWN_NOTES:
                        notes.append(_unknown_note(key, _path(where)))
                continue
            if key not in _HOLDERS:
                if key == "format" and isinstance(value, str) and value not in KNOWN_FORMATS:
                    found += 1
                    if found <= MAX_UNKNOWN_NOTES:
                        close = _close_format(value)
                        notes.append(f"unknown format {value!r} at {_path(where)}: ignored (an annotation)"
                                     + (f"; did you mean {close!r}?" if close else ""))
                continue
            if isinstance(value, dict):
                if key in _ONE:
                    subschemas.append((value, (where, key)))
                elif key in _MAP:
                    place = (where, key)
                    subschemas += [(v, (place, str(k))) for k, v in value.items() if isinstance(v, dict)]
            elif key in _LIST and isinstance(value, list):
                place = (where, key)
                subschemas += [(v, (place, i)) for i, v in enumerate(value) if isinstance(v, dict)]
        stack += reversed(subschemas)  # (depth first, in the document's order)
    if found > MAX_UNKNOWN_NOTES:
        notes.append(f"{found - MAX_UNKNOWN_NOTES} more unknown keywords (ignored)")
    return notes


@functools.lru_cache(maxsize=256)
def _known_dialect(uri: str) -> bool:
    """Whether ``$schema`` ``uri`` names a draft jsonschema knows (draft 3 to 2020-12, its reading of
    the URI: trailing "#" and the scheme as it normalizes them)."""
    from jsonschema import validators

    return validators.validator_for({"$schema": uri}, default=None) is not None


JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")  # ``type``'s names


@functools.lru_cache(maxsize=256)
def close_type(name: str) -> str | None:
    """The JSON type ``name`` most likely meant when it names none ("objekt", "String", "nul"), or None."""
    if name in JSON_TYPES:
        return None
    close = difflib.get_close_matches(name.lower(), JSON_TYPES, n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown_note(key: str, path: str) -> str:
    close = _close_keyword(key)
    return f"unknown keyword {key!r} at {path}: ignored" + (f"; did you mean {close!r}?" if close else "")


# A suggestion costs difflib ~0.3 ms (one key against the ~100 keywords), on the compile's path;
# schemas of one family repeat the same unknown keys ("markdownDescription", "tsType"), so each
# is looked up once.
@functools.lru_cache(maxsize=4096)
def _close_keyword(key: str) -> str | None:
    close = difflib.get_close_matches(key, KNOWN_KEYWORDS, n=1, cutoff=0.75)
    return close[0] if close else None


@functools.lru_cache(maxsize=1024)
def _close_format(name: str) -> str | None:
    close = difflib.get_close_matches(name, KNOWN_FORMATS, n=1, cutoff=0.75)
    return close[0] if close else None


def _path(where: tuple | None) -> str:
    """The JSON pointer (``#/properties/a~1b/0``) of a place ``unknown_keywords`` stacked: a chain
    of ``(parent's place, segment)``, None at the root."""
    parts = []
    while where is not None:
        where, segment = where
        parts.append(_pointer(segment) if isinstance(segment, str) else str(segment))
    return "/".join(["#", *reversed(parts)])


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
