"""Sufficient tests that two schemas admit no common instance (for exact ``oneOf``).

``oneOf`` equals ``anyOf`` exactly when its branches are pairwise disjoint (2020-12 §10.2.1.3).
We prove disjointness by: disjoint type sets; finite value sets (``enum``/``const``) of one
branch that the other rejects (checked with ``jsonschema``); or a property required by both
whose subschemas are disjoint (a discriminator), or required by one and forbidden by the other.
When no proof is found the caller fails closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grammar.json_schema import SchemaCompiler

_ALL = {"object", "array", "string", "number", "integer", "boolean", "null"}
_IMPLIED = {
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "minProperties", "maxProperties", "propertyNames"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "contains", "additionalItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
}


def possible_types(s: object) -> set[str]:
    """Types an instance of ``s`` may have, by its ``type`` keyword (all when absent)."""
    if not isinstance(s, dict):
        return set() if s is False else set(_ALL)
    if "enum" in s or "const" in s:
        from grammar.json_schema import _enum_values, _json_type
        out = {_json_type(v) for v in _enum_values(s)}
        return out | ({"number"} if "integer" in out else set())
    t = s.get("type")
    if t is None:
        return set(_ALL)
    out = {t} if isinstance(t, str) else set(t)
    if "integer" in out:
        out.add("number")
    if "number" in out:
        out.add("integer")
    return out


def _forbids(s: dict, name: str) -> bool:
    props = s.get("properties", {})
    if name in props:
        return props[name] is False
    return s.get("additionalProperties", True) is False and not s.get("patternProperties")


def generated_types(s: object) -> set[str]:
    """Types of the instances the grammar writes for ``s`` (keywords imply a missing ``type``)."""
    if isinstance(s, dict) and "type" not in s and "enum" not in s and "const" not in s:
        implied = {t for t, kws in _IMPLIED.items() if any(k in s for k in kws)}
        if implied:
            return implied
    return possible_types(s)


def _one_way(c: "SchemaCompiler", a: dict, b: dict, depth: int) -> bool:
    """True only if no instance the grammar writes for ``a`` validates against ``b``."""
    ta = generated_types(a)
    if not ta & possible_types(b):
        return True
    if ("enum" in a or "const" in a) and not any(c.value_valid(v, b) for v in _values(a)):
        return True
    if ta <= {"object"}:
        pa, pb = a.get("properties", {}), b.get("properties", {})
        ra, rb = set(a.get("required", [])), set(b.get("required", []))
        for name in ra & rb:
            if name in pa and name in pb and disjoint(c, pa[name], pb[name], depth + 1):
                return True
        if any(_forbids(b, n) for n in ra) or any(_forbids(a, n) for n in rb):
            return True
    return False


def disjoint(c: "SchemaCompiler", a: object, b: object, depth: int = 0) -> bool:
    """True only if no instance the grammar writes for one branch validates against the other."""
    if depth > 4:
        return False
    a = c._deref(a, "#")
    b = c._deref(b, "#")
    if a is False or b is False:
        return True
    if a is True or b is True:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    return _one_way(c, a, b, depth) and _one_way(c, b, a, depth)


def _values(s: dict) -> list:
    from grammar.json_schema import _enum_values
    return _enum_values(s)
