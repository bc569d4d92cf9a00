"""Intersection of two JSON Schemas (``allOf``), keyword by keyword.

``merge(a, b)`` returns one schema that admits exactly the instances both admit, or raises
``MergeError`` naming the keyword it cannot combine exactly. Subschemas of a common property
or of ``items`` are not merged here but wrapped as ``{"allOf": [x, y]}`` and merged lazily when
the compiler reaches them (so recursive ``$ref``s are never expanded eagerly). Both inputs must
have their own top-level ``$ref`` already resolved.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal

from stencil.grammar.json_schema.complement import NOT_PATTERNS


class MergeError(ValueError):
    def __init__(self, keyword: str, message: str):
        super().__init__(message)
        self.keyword = keyword
        self.message = message


_TYPE_ORDER = ("null", "boolean", "object", "array", "number", "integer", "string")


def json_key(value: object) -> str:
    """A key that tells JSON values apart the way JSON Schema equality does, as jsonschema
    decides it (1 == 1.0 == 1e0, 10 == 10.0, 0 == -0.0, 1e20 == 10**20, 1 != true; 1e300 !=
    10**300, the float's exact value being another integer)."""
    def norm(v):
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            return ["#num", _number_key(v)]
        if isinstance(v, list):
            return [norm(x) for x in v]
        return {k: norm(x) for k, x in v.items()}
    return json.dumps(norm(value), sort_keys=True)


def _number_key(v: int | float) -> str:
    """The number's value as digits and a power of ten, trailing zeros taken off (exact: no
    decimal context rounds it). A float is read as its shortest decimal below 2**53, where it
    equals an integer only when that decimal does, and as its exact value from there on (as
    Python compares a float with an integer)."""
    if v == 0:
        return "0"
    if isinstance(v, float) and math.isfinite(v):
        d = Decimal(repr(v)) if abs(v) < 2 ** 53 else Decimal(v)
    else:
        d = Decimal(v) if isinstance(v, int) else Decimal(repr(v))
    sign, digits, exp = d.as_tuple()
    if not isinstance(exp, int):  # NaN, infinity (a Python schema may hold them)
        return repr(v)
    text = "".join(map(str, digits))
    stripped = text.rstrip("0")
    return f"{'-' if sign else ''}{stripped}e{exp + len(text) - len(stripped)}"


def types_of(schema: dict) -> set[str] | None:
    t = schema.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else set(t)


def _intersect_types(a: set[str] | None, b: set[str] | None) -> list[str] | None:
    if a is None:
        return None if b is None else sorted(b, key=_TYPE_ORDER.index)
    if b is None:
        return sorted(a, key=_TYPE_ORDER.index)
    out = a & b
    if "integer" in a and "number" in b or "number" in a and "integer" in b:
        out.add("integer")
    return sorted(out, key=_TYPE_ORDER.index)


def _both(x, y):
    if x is True or x is None:
        return y
    if y is True or y is None:
        return x
    if x is False or y is False:
        return False
    if x == y:
        return x
    return {"allOf": [x, y]}


def _tighter(a: dict, b: dict, key: str, pick) -> object:
    if key not in a:
        return b[key]
    if key not in b:
        return a[key]
    return pick(a[key], b[key])


def _key_schema(schema: dict, name: str) -> object:
    """What ``schema``'s ``properties`` / ``additionalProperties`` demand of property ``name``
    (``True`` when nothing). Its ``patternProperties`` that match ``name`` are not included: they
    stay in the merged schema's ``patternProperties``, which apply to every key, declared or
    not; and where one matches, ``additionalProperties`` does not apply."""
    if name in schema.get("properties", {}):
        return schema["properties"][name]
    if any(re.search(p, name) for p in schema.get("patternProperties") or {}):
        return True
    return schema.get("additionalProperties", True)


def _merge_objects(a: dict, b: dict, out: dict) -> None:
    """The object keywords of ``allOf: [a, b]`` as one object's, exactly.

    A key declared by either side takes both sides' demands (``_key_schema``); the patterns of
    both apply to every key, as ``patternProperties`` always do (one pattern on both sides takes
    both schemas); a key that is neither declared nor matched by a pattern takes both
    ``additionalProperties``. One case has no single-object form: an undeclared key that only
    the other side's patterns match, where this side's ``additionalProperties`` is not ``true``
    (it would apply in ``a`` and not in the merge): refused, unless the other side's patterns are
    among this side's own.

    Raises:
        MergeError: ``patternProperties`` in that case (a pattern that is not valid Python
            ``re`` is named the same way).
    """
    props_a, props_b = a.get("properties", {}), b.get("properties", {})
    pats_a, pats_b = a.get("patternProperties") or {}, b.get("patternProperties") or {}
    addl_a, addl_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
    for own, other, addl in ((pats_a, pats_b, addl_a), (pats_b, pats_a, addl_b)):
        if addl is not True and addl != {} and not set(other) <= set(own):
            raise MergeError("patternProperties", "cannot merge differing patternProperties beside an "
                             "additionalProperties that is not true")
    if props_a or props_b:
        names = list(props_a) + [n for n in props_b if n not in props_a]
        try:
            out["properties"] = {n: _both(_key_schema(a, n), _key_schema(b, n)) for n in names}
        except re.error:
            raise MergeError("patternProperties", "cannot merge patternProperties whose pattern Python's "
                             "re cannot read") from None
    if "additionalProperties" in a or "additionalProperties" in b:
        addl = _both(addl_a, addl_b)
        if addl is not True:
            out["additionalProperties"] = addl
    if pats_a or pats_b:
        out["patternProperties"] = {p: _both(pats_a[p], pats_b[p]) if p in pats_b else pats_a[p] for p in pats_a}
        out["patternProperties"].update((p, pats_b[p]) for p in pats_b if p not in pats_a)
    required = list(a.get("required", [])) + [r for r in b.get("required", []) if r not in a.get("required", [])]
    if required:
        out["required"] = required
    if "propertyNames" in a or "propertyNames" in b:
        out["propertyNames"] = _both(a.get("propertyNames", True), b.get("propertyNames", True))


def _merge_arrays(a: dict, b: dict, out: dict) -> None:
    for key in ("prefixItems", "additionalItems"):
        if key in a and key in b and a[key] != b[key]:
            raise MergeError(key, f"cannot merge two different {key}")
    ia, ib = a.get("items"), b.get("items")
    if isinstance(ia, list) or isinstance(ib, list):
        if ia is not None and ib is not None and ia != ib:
            raise MergeError("items", "cannot merge tuple items with other items")
    elif "items" in a and "items" in b:
        out["items"] = _both(ia, ib)
    if "prefixItems" in a and "items" in b and "prefixItems" not in b or (
            "prefixItems" in b and "items" in a and "prefixItems" not in a):
        raise MergeError("prefixItems", "cannot merge prefixItems with plain items")


def _lcm_multiple(x, y):
    if x == y:
        return x
    dx, dy = Decimal(str(x)), Decimal(str(y))
    big, small = (dx, dy) if dx >= dy else (dy, dx)
    if (big / small) == (big / small).to_integral_value():
        return x if dx >= dy else y
    if dx == dx.to_integral_value() and dy == dy.to_integral_value():
        return math.lcm(int(dx), int(dy))
    raise MergeError("multipleOf", "cannot merge these multipleOf values")


def _same(key: str):
    def pick(x, y):
        if x != y:
            raise MergeError(key, f"cannot merge two different {key} values")
        return x
    return pick


_PICKS = {
    "minimum": max, "exclusiveMinimum": max, "maximum": min, "exclusiveMaximum": min,
    "minLength": max, "maxLength": min, "minItems": max, "maxItems": min,
    "minProperties": max, "maxProperties": min, "minContains": max, "maxContains": min,
    "uniqueItems": lambda x, y: bool(x or y), "multipleOf": _lcm_multiple,
}


def merge(a: object, b: object) -> object:
    """The intersection of schemas ``a`` and ``b`` (booleans allowed); raises ``MergeError``."""
    if a is True:
        return b
    if b is True:
        return a
    if a is False or b is False:
        return False
    assert isinstance(a, dict) and isinstance(b, dict)
    out: dict = {}
    for source in (b, a):  # a's annotations win
        out.update({k: v for k, v in source.items() if k not in _HANDLED})
    if NOT_PATTERNS in a or NOT_PATTERNS in b:  # both sides' excluded patterns
        out[NOT_PATTERNS] = [*a.get(NOT_PATTERNS, []), *b.get(NOT_PATTERNS, [])]
    types = _intersect_types(types_of(a), types_of(b))
    if types is not None:
        out["type"] = types
    enums = [s["enum"] for s in (a, b) if "enum" in s] + [[s["const"]] for s in (a, b) if "const" in s]
    if enums:
        keep = {json_key(v) for v in enums[0]}
        for other in enums[1:]:
            keep &= {json_key(v) for v in other}
        out["enum"] = [v for v in enums[0] if json_key(v) in keep]
    for key, pick in _PICKS.items():
        if key in a or key in b:
            out[key] = _tighter(a, b, key, pick)
    for key in ("pattern", "format", "contains", "not", "if", "then", "else", "dependencies",
                "dependentRequired", "dependentSchemas", "unevaluatedProperties",
                "unevaluatedItems", "oneOf", "$dynamicRef", "$recursiveRef"):
        if key in a or key in b:
            out[key] = _tighter(a, b, key, _same(key))
    _merge_objects(a, b, out)
    _merge_arrays(a, b, out)
    for key in ("items", "prefixItems", "additionalItems"):
        if key not in out:
            for source in (a, b):
                if key in source:
                    out[key] = source[key]
                    break
    any_a, any_b = a.get("anyOf"), b.get("anyOf")
    if any_a is not None and any_b is not None:
        if len(any_a) * len(any_b) > 64:
            raise MergeError("anyOf", "anyOf cross product too large")
        out["anyOf"] = [{"allOf": [x, y]} for x in any_a for y in any_b]
    elif any_a is not None or any_b is not None:
        out["anyOf"] = any_a if any_a is not None else any_b
    return out


_HANDLED = {"type", "enum", "const", "properties", "additionalProperties", "patternProperties",
            "required", "propertyNames", "items", "prefixItems", "additionalItems", "anyOf",
            "allOf", "pattern", "format", "contains", "not", "if", "then", "else",
            "dependencies", "dependentRequired", "dependentSchemas", "unevaluatedProperties",
            "unevaluatedItems", "oneOf", "$ref", "$dynamicRef", "$recursiveRef", *_PICKS}
